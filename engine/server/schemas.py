"""Request bodies, validated: anything out of range is a 400 naming the field.

Unknown fields are ignored (clients send many: user, logit_bias, parallel_tool_calls, …);
fields we would have to get wrong (n > 1, tool_choice "required", suffix) are refused. Logprobs are OpenAI's:
chat's `logprobs` (bool) and `top_logprobs` (0..20, only with logprobs), completions' `logprobs` (0..20) and
`echo`, with `max_tokens: 0` for the prompt's logprobs alone (engine.server.logprobs).
Text anywhere in a body must be valid Unicode: JSON can spell a lone surrogate ("\\ud800"), which
no tokenizer can encode.
"""
from __future__ import annotations

import re
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.logprobs import MAX_TOP
from engine.sampling import MAX_PENALTY, SEED_MAX, SEED_MIN

_SURROGATE = re.compile("[\ud800-\udfff]")


class FieldError(ValueError):
    """A whole-body check's finding, with the dotted path of the field it is about."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def _no_lone_surrogates(value, path: str = "") -> None:
    if isinstance(value, str):
        if m := _SURROGATE.search(value):
            raise FieldError(path or "body", f"holds a lone UTF-16 surrogate (U+{ord(m.group()):04X} at character "
                                             f"{m.start()}); text must be valid Unicode")
    elif isinstance(value, dict):
        for k, v in value.items():
            _no_lone_surrogates(k, path or "body")
            _no_lone_surrogates(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _no_lone_surrogates(v, f"{path}.{i}" if path else str(i))


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Request(_Body):
    """A whole request body: checked for text no tokenizer can take before any field is."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, v):
        _no_lone_surrogates(v)
        return v


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    # extra fields (name, reasoning_content, …) pass through to the chat template
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v):
        if isinstance(v, list) and not all(isinstance(p, dict) and p.get("type") == "text" for p in v):
            raise ValueError("only text content parts ({'type': 'text', 'text': …}) are supported")
        return v

    @model_validator(mode="after")
    def _content_present(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Request):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    # None: the server's default (engine serve --temperature/--top-p, else the model's generation_config.json,
    # else OpenAI's 1.0), as vLLM takes the model's generation config.
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)      # 64 bits, as the sampler takes it
    # OpenAI's penalties, and vLLM's / llama-server's top_k, min_p and repetition_penalty (engine.sampling)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    top_k: int = Field(default=0, ge=0, lt=2**31)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=MAX_PENALTY)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)           # one choice per request
    ignore_eos: bool = False                        # vLLM's extension

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        v = [v] if isinstance(v, str) else (v or [])
        if len(v) > 4:
            raise ValueError("at most 4 stop strings")
        return v


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto"], None] = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = Field(default=None, strict=True)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP, strict=True)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "needs logprobs: true")
        return self

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, v):
        if v not in (None, "none", "auto"):
            raise ValueError("only 'auto' and 'none' are supported (the engine does not constrain decoding)")
        return v


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = Field(default=None, ge=0)         # 0: with echo, the prompt's logprobs alone
    echo: bool = Field(default=False, strict=True)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP, strict=True)
    suffix: Any = None

    @field_validator("suffix")
    @classmethod
    def _unsupported(cls, v, info):
        if v:
            raise ValueError(f"{info.field_name} is not supported by this server")
        return v

    @model_validator(mode="after")
    def _nothing_to_generate(self):
        if self.max_tokens == 0 and not self.echo:
            raise FieldError("max_tokens", "0 generates nothing; it is only for echo (the prompt's logprobs)")
        return self

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("the prompt is empty")
        if isinstance(v, list) and isinstance(v[0], list) and any(not p for p in v):
            raise ValueError("a token-id prompt is empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: each a text or a list of token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and isinstance(self.prompt[0], int):
            return [list(self.prompt)]
        return list(self.prompt)


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self
