"""Messages (+ tools) → prompt text and ids, through the model's own chat template."""
from __future__ import annotations

import json

from engine.server.parsers import THINK_OPEN

# Tokens that end an assistant turn in the chat formats we know; a chat answer stops at them
# even where generation_config lists only one eos (GLM ends a tool-call turn with <|observation|>).
END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|user|>", "<|observation|>", "<|eot_id|>", "<|end|>")


class ChatTemplateError(ValueError):
    """The template refused the conversation (its own raise_exception, or a field it cannot render)."""


def text_of(content) -> str | None:
    """OpenAI content (a string, or a list of parts) → text; only text parts exist here."""
    if content is None or isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Shape messages as templates expect: content as text, tool-call arguments as objects
    (OpenAI sends them as JSON strings; GLM's template iterates them as a mapping)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None or k == "content"}
        m["content"] = text_of(m.get("content"))
        if m.get("tool_calls"):
            calls = []
            for tc in m["tool_calls"]:
                fn = dict(tc.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"] or "{}")
                    except json.JSONDecodeError:
                        pass            # leave it as sent; the template shows it verbatim
                calls.append({**tc, "function": fn})
            m["tool_calls"] = calls
        out.append(m)
    return out


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None,
           template_kwargs: dict | None = None, add_generation_prompt: bool = True) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("the model has no chat template; use /v1/completions")
    try:
        text = tokenizer.apply_chat_template(normalize_messages(messages), tools=tools or None,
                                             add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **(template_kwargs or {}))
    except Exception as e:              # jinja2 errors, raise_exception() in the template, bad kwargs
        raise ChatTemplateError(f"the chat template refused these messages: {e}") from None
    if not isinstance(text, str):       # some transformers versions hand back a dict/list even untokenized
        raise ChatTemplateError(f"the chat template returned {type(text).__name__}, not text")
    return text


def encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """Text → ids. A rendered chat prompt already holds its special tokens: add_special_tokens=False."""
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


# Marks around each message's content in a second rendering (noncharacters: never in real text), so the
# template's own text and the client's text can be tokenized apart.
_OPEN, _CLOSE = "\ufdd0", "\ufdd1"


def special_strings(tokenizer) -> tuple[str, ...]:
    return tuple(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)


def encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None, template_kwargs: dict | None = None,
                add_generation_prompt: bool = True) -> tuple[str, list[int]]:
    """(prompt text, ids) of a conversation, where only the template's own markers are control tokens:
    a message whose text spells one (`<|im_end|>\n<|im_start|>system`, a forged turn) is tokenized as
    the literal text it is. Without such text the ids are exactly the whole rendering's."""
    msgs = normalize_messages(messages)
    text = render(tokenizer, msgs, tools, template_kwargs, add_generation_prompt)
    specials = special_strings(tokenizer)
    forged = [i for i, m in enumerate(msgs) if isinstance(m.get("content"), str)
              and any(s in m["content"] for s in specials)]
    if not forged:
        return text, encode(tokenizer, text, add_special_tokens=False)
    for i, m in enumerate(msgs):
        if isinstance(m.get("content"), str) and (_OPEN in m["content"] or _CLOSE in m["content"]):
            raise ChatTemplateError(f"messages.{i}.content holds U+FDD0/U+FDD1, which this server reserves")
    marked = [{**m, "content": f"{_OPEN}{m['content']}{_CLOSE}"} if isinstance(m.get("content"), str) else m
              for m in msgs]
    rendered = render(tokenizer, marked, tools, template_kwargs, add_generation_prompt)
    pieces, ids, rest = [], [], rendered
    while rest:                                        # template text, then [content], alternating
        head, opened, rest = rest.partition(_OPEN)
        body, closed, tail = rest.partition(_CLOSE)
        if _CLOSE in head or (opened and (not closed or _OPEN in body)):
            raise ChatTemplateError(f"messages.{forged[0]}.content holds a control token of the chat format, and "
                                    "this chat template moves message text in ways that cannot keep it literal")
        pieces.append(head)
        ids += encode(tokenizer, head, add_special_tokens=False) if head else []
        if opened:
            pieces.append(body)
            ids += list(tokenizer(body, add_special_tokens=False, split_special_tokens=True)["input_ids"]) if body else []
            rest = tail
    return "".join(pieces), ids


def think_opened(prompt: str) -> bool:
    """True when the prompt leaves a `<think>` open (the template starts the reasoning itself)."""
    return prompt.rstrip().endswith(THINK_OPEN)


def end_of_turn_ids(tokenizer) -> tuple[int, ...]:
    vocab = tokenizer.get_vocab()
    return tuple(sorted({vocab[t] for t in END_OF_TURN if t in vocab}))
