"""Count tokens the way the server does: its own tokenizer endpoint, else its own usage figures.

Never characters / 4. The detected source is recorded (`TokenCounter.source`) so the evidence says
whose count a figure is. Endpoints, in the order tried:
  POST /tokenize {"messages"} / {"prompt"}   vLLM, sglang, Kiln's engine → {"count"} or {"tokens"}
  POST /tokenize {"content"}                 llama.cpp                   → {"tokens"}
  POST /v1/token/encode {"text"}             TabbyAPI                    → {"length"} or {"tokens"}
  usage.prompt_tokens of 1-token probes      any server that reports usage ("calibrated")
"""
from __future__ import annotations

from tool.checks.client import Client, ClientError

_PROBE = "The quick brown fox jumps over the lazy dog."


def _count_of(data: dict, *keys: str) -> int | None:
    for k in keys:
        v = data.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        if isinstance(v, list):
            return len(v)
    return None


class TokenCounter:
    """count_text(text): tokens of raw text; count_messages(messages): tokens of the whole chat
    prompt as the server renders it (template included)."""

    source = "none"          # whose count count_messages gives (the context gate's figure)

    @property
    def text_source(self) -> str:
        """Whose count count_text gives: the label of a raw-text count (the speed gate's)."""
        return self.source

    def __init__(self, client: Client, model: str):
        self.client, self.model = client, model
        self.template_overhead: int | None = None   # chat prompt tokens beyond the text's own

    def count_text(self, text: str) -> int:
        raise NotImplementedError

    def count_messages(self, messages: list[dict]) -> int:
        """Text endpoints: the texts' count plus the chat template's overhead, measured once
        from a probe request's usage.prompt_tokens."""
        if self.template_overhead is None:
            self.template_overhead = self._measure_overhead()
        return sum(self.count_text(m.get("content") or "") for m in messages) + self.template_overhead

    def correct_overhead(self, messages: list[dict], server_prompt_tokens: int) -> None:
        """The server's usage for a real request disagreed with our count: adopt its offset."""
        counted = self.count_messages(messages)
        self.template_overhead = (self.template_overhead or 0) + server_prompt_tokens - counted

    def _measure_overhead(self) -> int:
        messages = [{"role": "user", "content": _PROBE}]
        try:
            pt = probe_prompt_tokens(self.client, self.model, messages)
        except ClientError:
            return 0        # the real request's usage corrects it (correct_overhead)
        return max(0, pt - self.count_text(_PROBE))

    def describe(self) -> dict:
        return {"token_count_source": self.source, "template_overhead_tokens": self.template_overhead}


def probe_prompt_tokens(client: Client, model: str, messages: list[dict]) -> int:
    """usage.prompt_tokens of a 1-token chat completion: the server's own count of exactly this prompt
    (greedy, sent explicitly like every gate's request: the one token must not hang on a server's default)."""
    answer = client.chat({"model": model, "messages": messages, "max_tokens": 1, "temperature": 0.0})
    pt = (answer.usage or {}).get("prompt_tokens")
    if not isinstance(pt, int) or pt <= 0:
        raise ClientError("the server reports no usage.prompt_tokens")
    return pt


class VllmTokenize(TokenCounter):
    """/tokenize with {"prompt"} (and {"messages"} where the server renders chats itself)."""

    def __init__(self, client, model, messages_ok: bool):
        super().__init__(client, model)
        self.messages_ok = messages_ok
        self.source = "/tokenize {messages}" if messages_ok else "/tokenize {prompt}"

    @property
    def text_source(self) -> str:
        return "/tokenize {prompt}"      # count_text sends {"prompt"} whatever count_messages sends

    def count_text(self, text: str) -> int:
        data = self.client.request_json("POST", "//tokenize", {"model": self.model, "prompt": text,
                                                               "add_special_tokens": False}, record=False)
        n = _count_of(data, "count", "tokens")
        if n is None:
            raise ClientError("/tokenize answered without count or tokens")
        return n

    def count_messages(self, messages: list[dict]) -> int:
        if not self.messages_ok:
            return super().count_messages(messages)
        data = self.client.request_json("POST", "//tokenize", {"model": self.model, "messages": messages,
                                                               "add_generation_prompt": True}, record=False)
        n = _count_of(data, "count", "tokens")
        if n is None:
            raise ClientError("/tokenize answered without count or tokens")
        return n + (self.template_overhead or 0)   # 0 unless the server's usage disagreed


class LlamaCppTokenize(TokenCounter):
    source = "/tokenize {content} (llama.cpp)"

    def count_text(self, text: str) -> int:
        data = self.client.request_json("POST", "//tokenize", {"content": text, "add_special": False}, record=False)
        n = _count_of(data, "tokens")
        if n is None:
            raise ClientError("/tokenize answered without tokens")
        return n


class TabbyEncode(TokenCounter):
    source = "/v1/token/encode {text} (TabbyAPI)"

    def count_text(self, text: str) -> int:
        data = self.client.request_json("POST", "/token/encode", {"text": text, "add_bos_token": False},
                                        record=False)
        n = _count_of(data, "length", "tokens")
        if n is None:
            raise ClientError("/v1/token/encode answered without length or tokens")
        return n


class Calibrated(TokenCounter):
    """No tokenizer endpoint: every count is a probe request's usage.prompt_tokens. Exact for a
    whole chat prompt; raw text is that minus a one-word prompt's count (the template)."""

    source = "calibrated from usage.prompt_tokens"

    def count_messages(self, messages: list[dict]) -> int:
        return probe_prompt_tokens(self.client, self.model, messages) + (self.template_overhead or 0)

    def count_text(self, text: str) -> int:
        if not hasattr(self, "_base"):
            self._base = probe_prompt_tokens(self.client, self.model, [{"role": "user", "content": "Hi"}]) - 1
        return probe_prompt_tokens(self.client, self.model, [{"role": "user", "content": text}]) - self._base

    def correct_overhead(self, messages, server_prompt_tokens):
        pass    # already the server's own count of the same prompt


def detect(client: Client, model: str) -> TokenCounter:
    """The best token counter this server offers. A probe must count a non-empty text as > 0
    tokens (llama.cpp answers {"tokens": []} to bodies it does not understand)."""
    def works(path: str, body: dict, *keys: str) -> bool:
        try:
            n = _count_of(client.request_json("POST", path, body, record=False, timeout_s=30), *keys)
        except ClientError:
            return False
        return bool(n)

    if works("//tokenize", {"model": model, "prompt": _PROBE}, "count", "tokens"):
        ok = works("//tokenize", {"model": model, "messages": [{"role": "user", "content": _PROBE}]},
                   "count", "tokens")
        return VllmTokenize(client, model, messages_ok=ok)
    if works("//tokenize", {"content": _PROBE}, "tokens"):
        return LlamaCppTokenize(client, model)
    if works("/token/encode", {"text": _PROBE}, "length", "tokens"):
        return TabbyEncode(client, model)
    return Calibrated(client, model)
