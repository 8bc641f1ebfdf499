"""Log-probabilities of tokens, as the OpenAI API and vLLM report them: the model's own distribution, log_softmax of
the raw logits in fp32, before any sampling transform (temperature, penalties, top-k/top-p/min-p). The one home of
this math: a decode step's rows that asked (engine.scheduler), the first token after a prefill, and a prompt's
positions (echo's prompt logprobs) all come through LogprobTable.

A table computes on the logits' device at once (so a step launched ahead, engine.decode_ahead, may come after it)
and reads to the host later, beside the chosen tokens; rows that did not ask are never touched.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

MAX_TOP = 20            # the most alternatives a token may list (OpenAI's top_logprobs limit; vLLM's max_logprobs)


class TokenLogprob(NamedTuple):
    """One token's log-probability and the `top` most likely tokens at its position, (id, logprob) most likely
    first."""
    logprob: float
    top: tuple[tuple[int, float], ...]


def check_top(n, name: str) -> None:
    """A top-N ask: None (off) or 0..MAX_TOP (0: the chosen token's logprob alone)."""
    if n is not None and not (isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_TOP):
        raise ValueError(f"{name} is {n!r}; it must be an integer from 0 to {MAX_TOP}")


class LogprobTable:
    """log_softmax and top-N of the rows of logits [B, V] that asked: wants[b] is row b's N, or None (not asked;
    nothing is computed for it). Computed on the logits' device when made; read() takes the chosen tokens."""

    def __init__(self, logits: torch.Tensor, wants: list[int | None]):
        self.wants = wants
        self.rows = [i for i, n in enumerate(wants) if n is not None]
        self.x = self.top = None
        if not self.rows:
            return
        rows = logits if len(self.rows) == len(wants) else \
            logits.index_select(0, torch.tensor(self.rows, device=logits.device))
        self.x = torch.log_softmax(rows.float(), dim=-1)         # a new tensor: later steps cannot overwrite it
        k = min(max(wants[i] for i in self.rows), self.x.shape[-1])
        if k:
            self.top = torch.topk(self.x, k, dim=-1, sorted=True)

    @classmethod
    def of(cls, logits: torch.Tensor, wants: list[int | None]) -> "LogprobTable | None":
        """The table of the rows that asked, or None (at no cost) where none did."""
        return cls(logits, wants) if any(n is not None for n in wants) else None

    def read(self, tokens: list) -> list[TokenLogprob | None]:
        """Each row's TokenLogprob for its chosen token (None where the row did not ask, or its token is no int: a
        failed row's error)."""
        out: list[TokenLogprob | None] = [None] * len(self.wants)
        if not self.rows:
            return out
        ids = [tokens[i] if isinstance(tokens[i], int) else 0 for i in self.rows]
        chosen = self.x.gather(-1, torch.tensor(ids, device=self.x.device)[:, None])[:, 0].tolist()
        values, indices = (self.top.values.tolist(), self.top.indices.tolist()) if self.top is not None else ([], [])
        for j, i in enumerate(self.rows):
            if not isinstance(tokens[i], int):
                continue
            n = self.wants[i]
            top = tuple(zip(indices[j][:n], values[j][:n])) if n else ()
            out[i] = TokenLogprob(chosen[j], top)
        return out


def token_logprobs(logits: torch.Tensor, tokens: list, wants: list[int | None]) -> list[TokenLogprob | None]:
    """LogprobTable(logits, wants).read(tokens): made and read at once."""
    return LogprobTable(logits, wants).read(tokens)
