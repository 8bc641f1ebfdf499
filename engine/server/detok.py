"""Token ids → text, one token at a time, without splitting a UTF-8 character or a merge.

Byte-level BPE tokens can end mid-character, and some tokenizers change a token's text by
its left neighbour, so each step decodes a short window (from the last emitted boundary)
and emits only what became final (the offsets scheme of text-generation-inference / vLLM).
"""
from __future__ import annotations

from engine.server.parsers import PARSER_TAGS


def hidden_token_ids(tokenizer) -> frozenset[int]:
    """Special tokens never shown as text (role tags, end of turn), except the tags the parsers read.

    Decoding keeps special tokens (so `<think>`, `<tool_call>` survive where a tokenizer marks
    them special) and drops these ids instead."""
    return frozenset(i for i, t in tokenizer.added_tokens_decoder.items()
                     if t.special and t.content not in PARSER_TAGS)


class Detokenizer:
    def __init__(self, tokenizer, hidden: frozenset[int]):
        self.tok = tokenizer
        self.hidden = hidden
        self.ids: list[int] = []
        self.prefix = 0                 # start of the decode window (context for the next token)
        self.read = 0                   # ids before this are already emitted

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        if token_id in self.hidden:
            return ""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        return ""                       # an incomplete character: wait for the next token

    def finish(self) -> str:
        """Whatever is still held (an incomplete character at the end shows as U+FFFD)."""
        if self.read == len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return now[len(before):]
