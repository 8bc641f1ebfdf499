"""The engine's token logprobs (engine.logprobs.TokenLogprob) in the OpenAI API's two shapes:

- chat (`logprobs: true`, `top_logprobs: N`): choices[].logprobs = {"content": [{token, logprob, bytes,
  top_logprobs: [{token, logprob, bytes}, ...]}], "refusal": null};
- completions (`logprobs: N`, `echo`): choices[].logprobs = {tokens, token_logprobs, top_logprobs, text_offset},
  where each top_logprobs entry maps the N most likely tokens' text, and the chosen token's, to their logprobs (so up
  to N + 1 entries, as OpenAI and vLLM say; where two tokens share a text, e.g. two halves of characters that both
  show as U+FFFD, the likelier one's), and a prompt's first token has null in both.

A token's text is its own bytes decoded as UTF-8 (a token ending mid-character shows U+FFFD there; `bytes` holds the
exact bytes). JSON has no -inf: a logprob of -inf (a token the model gives no chance) is -9999.0, as OpenAI's and
vLLM's.
"""
from __future__ import annotations

import weakref

from engine.logprobs import TokenLogprob

FLOOR = -9999.0


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, each printable stand-in char → the byte it stands for."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


_BYTES = _byte_decoder()


class TokenText:
    """Each token id's (text, bytes) under one tokenizer, cached."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
        self.special = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        if (hit := self._cache.get(token_id)) is not None:
            return hit
        raw = None
        if token_id in self.special:
            raw = self.special[token_id].encode()
        else:
            piece = self.tok.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                if self.byte_level and all(c in _BYTES for c in piece):
                    raw = bytes(_BYTES[c] for c in piece)
                elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):    # SentencePiece's bytes
                    raw = bytes([int(piece[3:5], 16)])
        if raw is None:
            raw = self.tok.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False).encode()
        out = (raw.decode("utf-8", errors="replace"), list(raw))
        self._cache[token_id] = out
        return out


_texts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def token_text(tokenizer) -> TokenText:
    """The tokenizer's TokenText (one per tokenizer, kept while it lives)."""
    try:
        t = _texts.get(tokenizer)
        if t is None:
            t = _texts[tokenizer] = TokenText(tokenizer)
        return t
    except TypeError:                   # not weak-referenceable: an uncached one
        return TokenText(tokenizer)


def finite(x: float) -> float:
    return x if x > FLOOR else FLOOR            # also NaN → FLOOR (a comparison with NaN is False)


def chat_content(text: TokenText, items: list[tuple[int, TokenLogprob]]) -> list[dict]:
    """Chat's logprobs.content entries of these (token id, TokenLogprob)."""
    out = []
    for token_id, lp in items:
        s, b = text(token_id)
        top = []
        for i, v in lp.top:
            ts, tb = text(i)
            top.append({"token": ts, "logprob": finite(v), "bytes": tb})
        out.append({"token": s, "logprob": finite(lp.logprob), "bytes": b, "top_logprobs": top})
    return out


def chat_logprobs(text: TokenText, items: list[tuple[int, TokenLogprob]]) -> dict:
    return {"content": chat_content(text, items), "refusal": None}


class CompletionLogprobs:
    """Completions' logprobs of one choice, built as its tokens come; text_offset counts characters of the choice's
    text from `offset` on (each token's text length after the one before it)."""

    def __init__(self, text: TokenText, offset: int = 0):
        self.text, self.offset = text, offset

    def block(self, items: list[tuple[int, TokenLogprob | None]]) -> dict:
        """The logprobs object of these tokens (a prompt's first carries None), continuing the offsets."""
        tokens, chosen, tops, offsets = [], [], [], []
        for token_id, lp in items:
            s, _ = self.text(token_id)
            tokens.append(s)
            offsets.append(self.offset)
            self.offset += len(s)
            if lp is None:
                chosen.append(None)
                tops.append(None)
                continue
            chosen.append(finite(lp.logprob))
            top: dict[str, float] = {}
            for i, v in lp.top:             # two tokens of one text (partial characters): the likelier one
                top.setdefault(self.text(i)[0], finite(v))
            top.setdefault(s, finite(lp.logprob))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}

