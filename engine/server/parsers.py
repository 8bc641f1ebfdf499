"""Turn a model's raw output text into OpenAI's fields, incrementally.

Text arrives in arbitrary chunks (a token may be half a tag). Every parser here is a small
state machine with `feed(text) -> pieces` and `finish() -> pieces`, and holds back a suffix
that could still become a tag, so a stream never shows `</thi` and the pieces of a streamed
run equal those of the same text fed whole.

    StopMatcher      `stop` strings: cut the text at the first match
    ReasoningSplitter  text up to `</think>` → reasoning, the rest → content
    ToolCallParser   `<tool_call>…</tool_call>` blocks in content → ToolCall (GLM or Hermes/Qwen)
    OutputParser     the last two chained, as the chat endpoint uses them
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# Tags the parsers consume: the detokenizer must show them even where the tokenizer marks them special.
PARSER_TAGS = frozenset({THINK_OPEN, THINK_CLOSE, CALL_OPEN, CALL_CLOSE,
                         "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"})


def held_suffix(text: str, tags) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags` (could still become it)."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


@dataclass
class ToolCall:
    name: str
    arguments: str                      # a JSON object, as a string (OpenAI's shape)
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Piece:
    kind: str                           # "content" | "reasoning" | "tool_call"
    text: str = ""
    call: ToolCall | None = None


class StopMatcher:
    """Cuts generated text at the first of the `stop` strings (the match itself is not shown)."""

    def __init__(self, stops):
        self.stops = [s for s in (stops or []) if s]
        self.buf = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        self.buf += text
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buf, self.stopped = self.buf[:min(hits)], "", True
            return out
        keep = held_suffix(self.buf, self.stops)
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out

    def finish(self) -> str:
        out, self.buf = self.buf, ""
        return out


class ReasoningSplitter:
    """Splits text at `</think>` into reasoning and content.

    `opened=True` when the prompt already opened `<think>` (the template ends with it): the output
    starts as reasoning. Otherwise the output is reasoning only if it begins with `<think>`.
    A repeated leading `<think>` is dropped; leading whitespace of each part is dropped; stray
    think tags never reach content.
    """

    def __init__(self, opened: bool = False):
        self.state = "reasoning" if opened else "start"
        self.buf = ""
        self.lead = True                # at the start of the current part: drop whitespace and a repeated <think>

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        out: list[Piece] = []
        while self.buf:
            if self.state == "start":
                stripped = self.buf.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self.buf, self.state = stripped[len(THINK_OPEN):], "reasoning"
                    continue
                if not stripped or THINK_OPEN.startswith(stripped):
                    break               # could still be "<think>": wait
                self.state = "content"
                continue
            if self.lead:
                self.buf = self.buf.lstrip()
                if self.state == "reasoning" and self.buf.startswith(THINK_OPEN):
                    self.buf = self.buf[len(THINK_OPEN):]
                    continue
                if not self.buf or (self.state == "reasoning" and THINK_OPEN.startswith(self.buf)):
                    break
                self.lead = False
            if self.state == "reasoning":
                i = self.buf.find(THINK_CLOSE)
                if i >= 0:
                    self._emit(out, "reasoning", self.buf[:i])
                    self.buf, self.state, self.lead = self.buf[i + len(THINK_CLOSE):], "content", True
                    continue
                keep = held_suffix(self.buf, (THINK_CLOSE,))
            else:                       # content: drop stray think tags
                while THINK_OPEN in self.buf or THINK_CLOSE in self.buf:
                    self.buf = self.buf.replace(THINK_OPEN, "").replace(THINK_CLOSE, "")
                keep = held_suffix(self.buf, (THINK_OPEN, THINK_CLOSE))
            self._emit(out, self.state, self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            break
        return out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        rest, self.buf = self.buf, ""
        if self.state == "start":
            rest = "" if rest.strip() in ("", THINK_OPEN) else rest
            self.state = "content"
        if self.lead:
            rest = rest.lstrip()
        self._emit(out, self.state, rest)
        return out

    @staticmethod
    def _emit(out, kind, text):
        if text:
            out.append(Piece(kind, text))


_GLM_ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_NAME = re.compile(r"[A-Za-z0-9_.:\-]+")


def parse_tool_call(body: str, string_params: dict[str, set[str]] | None = None) -> ToolCall | None:
    """One `<tool_call>` body → ToolCall, or None when it is neither format.

    Hermes/Qwen: `{"name": "f", "arguments": {...}}`. GLM: `f<arg_key>k</arg_key><arg_value>v</arg_value>…`;
    a GLM value becomes a JSON value when it parses as one, unless the tool's schema declares that
    parameter a string (`string_params[name]`), as GLM's own parser does ("17" for a city stays "17").
    """
    text = body.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict):
            return None
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))
    i = text.find("<arg_key>")
    name = (text if i < 0 else text[:i]).strip()
    if not _NAME.fullmatch(name):
        return None
    args: dict = {}
    pos = len(text) if i < 0 else i
    strings = (string_params or {}).get(name, set())
    while pos < len(text):
        m = _GLM_ARG.match(text, pos)
        if not m:
            return None if text[pos:].strip() else ToolCall(name, json.dumps(args, ensure_ascii=False))
        key, raw = m.group(1).strip(), m.group(2)
        args[key] = raw if key in strings else _json_or_text(raw)
        pos = m.end()
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _json_or_text(raw: str):
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


class ToolCallParser:
    """Content text → content pieces and ToolCall pieces. A block that parses as neither format,
    or is never closed, stays content exactly as generated."""

    def __init__(self, string_params: dict[str, set[str]] | None = None):
        self.string_params = string_params
        self.buf = ""
        self.in_call = False

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        out: list[Piece] = []
        while True:
            if not self.in_call:
                i = self.buf.find(CALL_OPEN)
                if i < 0:
                    keep = held_suffix(self.buf, (CALL_OPEN,))
                    if len(self.buf) > keep:
                        out.append(Piece("content", self.buf[:len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                if i:
                    out.append(Piece("content", self.buf[:i]))
                self.buf, self.in_call = self.buf[i + len(CALL_OPEN):], True
            j = self.buf.find(CALL_CLOSE)
            if j < 0:
                return out
            body, self.buf, self.in_call = self.buf[:j], self.buf[j + len(CALL_CLOSE):], False
            call = parse_tool_call(body, self.string_params)
            out.append(Piece("tool_call", call=call) if call else Piece("content", CALL_OPEN + body + CALL_CLOSE))

    def finish(self) -> list[Piece]:
        rest = (CALL_OPEN if self.in_call else "") + self.buf
        self.buf, self.in_call = "", False
        return [Piece("content", rest)] if rest else []


class OutputParser:
    """The chat endpoint's parser: reasoning split first, then tool calls in the content (when tools are on)."""

    def __init__(self, *, think_opened: bool = False, tools: bool = False,
                 string_params: dict[str, set[str]] | None = None):
        self.reasoning = ReasoningSplitter(think_opened)
        self.tools = ToolCallParser(string_params) if tools else None

    def feed(self, text: str) -> list[Piece]:
        return self._route(self.reasoning.feed(text), final=False)

    def finish(self) -> list[Piece]:
        return self._route(self.reasoning.finish(), final=True)

    def _route(self, pieces: list[Piece], final: bool) -> list[Piece]:
        if self.tools is None:
            return pieces
        out: list[Piece] = []
        for p in pieces:
            out.extend(self.tools.feed(p.text) if p.kind == "content" else [p])
        if final:
            out.extend(self.tools.finish())
        return out


def string_params_of(tools: list[dict] | None) -> dict[str, set[str]]:
    """{function name: names of its parameters declared `"type": "string"`} from OpenAI `tools`."""
    out: dict[str, set[str]] = {}
    for t in tools or []:
        fn = t.get("function") or {}
        props = ((fn.get("parameters") or {}).get("properties") or {})
        out[fn.get("name", "")] = {k for k, v in props.items() if isinstance(v, dict) and v.get("type") == "string"}
    return out


@dataclass
class Assembled:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


def assemble(pieces: list[Piece]) -> Assembled:
    """Pieces of a whole answer → the non-streamed message fields (content null when only tool calls)."""
    reasoning = "".join(p.text for p in pieces if p.kind == "reasoning")
    content = "".join(p.text for p in pieces if p.kind == "content")
    calls = [p.call for p in pieces if p.kind == "tool_call"]
    if calls and not content.strip():
        content = None
    return Assembled(reasoning or None, content, calls)
