"""Decode ahead: where a decode step launches asynchronously (CUDA, every expert resident: the model's
decode_ahead_ok), the step after it is launched from the tokens sampled on the GPU (engine.sampling: greedy or
sampled, seeded by the request and the token's index, so a step launched ahead draws what the step-by-step path
would) before the host reads this step's tokens, so the GPU computes while the host reads, emits and checks stops.

A sequence that ends at that read, or one that joins, leaves the launched step unused: it is run again, from the
host's tokens, at the same positions (its KV writes are simply redone), so the tokens are the step-by-step path's.
A cache with state beyond its positions (glm5_next's KDA states) would advance twice: it keeps that state at the
launch (SlotCaches.hold) and puts it back, for the sequences still running, when the step goes unused (undo).
DecodeAhead holds the one step on its way and counts what became of each (used, redone); the scheduler
(engine.scheduler) decides when to launch and feeds it.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from engine.kv_cache import SlotCaches
from engine.logprobs import LogprobTable
from engine.request import Request
from engine.sampling import Penalties, Picks, RowSpec


class Launched(NamedTuple):
    """A decode step on its way: its batch, logits, and (when it may chain) its tokens on the device (Picks) and the
    logprobs of its rows that asked (computed on the device before the next step launches; None where none did)."""
    batch: list
    logits: torch.Tensor
    picks: Picks | None
    table: LogprobTable | None = None


def decode_picks(model, tokens, slots: list[int], positions: list[int], rows: list[RowSpec],
                 penalties: Penalties | None = None) -> tuple[torch.Tensor, Picks]:
    """A decode step and its tokens on the device: the model's own decode_picks where it has one (MoEModel: the
    sampler captured after its decode graph), else its decode_step and the eager sampler. A penalised row needs
    its slot's counts (`penalties`)."""
    if (own := getattr(model, "decode_picks", None)) is not None:
        return own(tokens, slots, positions, rows, penalties)
    logits = model.decode_step(tokens, slots, positions)
    return logits, Picks(logits, rows, penalties=penalties,
                         slots=None if penalties is None else torch.tensor(slots, device=logits.device))


def may_chain(batch: list[Request], max_context: int) -> bool:
    """Whether the step after this batch's next one can be launched from its tokens on the device: no sequence is
    penalised (its counts follow the tokens read) and none ends by length (its tokens or the context) at this step."""
    return all(not r.spec().penalised and r.generated + 1 < r.params.max_tokens
               and r.length + 2 < max_context for r in batch)


class DecodeAhead:
    """The step launched ahead, its tokens not yet read; used: steps the next turn ran as launched, redone: steps
    launched but run again from the host's tokens (a stream joined or left, or a token differed)."""

    def __init__(self, caches: SlotCaches):
        self.caches = caches
        self.step: Launched | None = None
        self.used = 0
        self.redone = 0

    def take(self, batch: list[Request]) -> Launched | None:
        """The step launched ahead, if it is this batch's; else None (and the one launched counts as redone)."""
        step, self.step = self.step, None
        if step is not None and step.batch == batch:
            self.used += 1
            return step
        if step is not None:
            self.redone += 1        # a stream joined or left: run from the host's tokens, same positions
            self._undo(step.batch, still=batch)
        return None

    def _undo(self, launched: list[Request], still: list[Request] | None = None) -> None:
        """The unused step's state put back for the sequences of it still running (in `still`, if given)."""
        self.caches.undo([r.slot for r in launched if r.slot >= 0 and not r.cancelled
                          and (still is None or r in still)])

    def drop(self) -> None:
        """Forget the step on its way (every request it served has ended)."""
        self.step = None

    def launch(self, model, step: Launched) -> Launched | None:
        """The step after `step`, launched from its tokens on the device; None where the launch failed (the next
        turn runs that step the ordinary way, and finds whose it was)."""
        batch = step.batch
        self.caches.hold([r.slot for r in batch])
        try:
            logits, picks = decode_picks(model, step.picks.best, [r.slot for r in batch],
                                         [r.length + 1 for r in batch], [r.spec(ahead=1) for r in batch])
        except Exception:
            self._undo(batch)
            return None
        return Launched(batch, logits, picks, LogprobTable.of(logits, [r.params.logprobs for r in batch]))

    def keep(self, ahead: Launched | None, all_final: bool) -> None:
        """After this step's tokens are read: keep `ahead` for the next turn where it fed the tokens the read gave
        and every sequence goes on; else it counts as redone."""
        if ahead is None:
            return
        if all_final and all(r.slot >= 0 and not r.cancelled for r in ahead.batch):
            self.step = ahead       # the next turn uses it, unless a stream joins or leaves first
        else:                       # it fed a token this read did not give, or a sequence ended
            self.redone += 1
            self._undo(ahead.batch)
