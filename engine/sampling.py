"""Next-token choice for a batch of sequences: greedy, or temperature + top-p with a torch.Generator
per request, so a seeded request draws the same tokens whether it runs alone or batched.

Numerically safe at every value the API lets through: a temperature too small to divide by is greedy,
top-p always keeps the most likely token, NaN logits never win and +inf ones share the draw. A row
that has no finite logit at all is that request's failure (SamplingError), never its neighbours'.
"""
from __future__ import annotations

import math
import secrets

import numpy as np
import torch

# Below this a softmax(logits / T) is one-hot up to fp32 rounding (a logit gap of 1e-3 is e^-100 apart),
# and dividing by a subnormal T overflows: such requests are greedy, as T -> 0+ is in the limit.
GREEDY_BELOW = 1e-5
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1          # int64, as vLLM takes it; torch's generator takes all of it


class SamplingError(ValueError):
    """This row cannot be sampled (the model's logits are all NaN/-inf): its request fails alone."""


def check_params(temperature: float, top_p: float, seed: int | None) -> None:
    """ValueError naming the field and its limit for anything the sampler cannot use."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0.0):
        raise ValueError(f"temperature is {temperature}; it must be a finite number >= 0")
    if not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p is {top_p}; it must be in (0, 1]")
    if seed is not None and not (isinstance(seed, int) and SEED_MIN <= seed <= SEED_MAX):
        raise ValueError(f"seed is {seed}; it must be an integer in {SEED_MIN}..{SEED_MAX} (64 bits)")


def is_greedy(temperature: float) -> bool:
    return temperature < GREEDY_BELOW


def make_generator(seed: int | None, device: str | torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed if seed is not None else secrets.randbits(63))


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """fp32 logits [V] with NaN as -inf; where some are +inf, those alone (equal) and the rest -inf."""
    x = logits.float()
    posinf = x == float("inf")
    if bool(posinf.any()):
        return torch.where(posinf, 0.0, float("-inf"))
    x = torch.nan_to_num(x, nan=float("-inf"), posinf=0.0, neginf=float("-inf"))
    if not bool(torch.isfinite(x).any()):
        raise SamplingError("the model produced no finite logit for this sequence (all NaN or -inf)")
    return x


def greedy_row(logits: torch.Tensor) -> int:
    return int(_finite(logits).argmax())


def sample_row(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """One token id from logits [V]: softmax(logits / T) truncated to the smallest set of tokens whose
    probability reaches top_p (always at least the most likely one)."""
    if is_greedy(temperature):
        return greedy_row(logits)
    x = _finite(logits)
    probs = torch.softmax((x - x.max()) / temperature, dim=-1)     # the best token's weight is exactly 1: never 0/0
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # Drop a token when the mass before it already reaches top_p; the first never goes (top_p may round to 0).
        drop = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= top_p
        drop[0] = False
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        return int(order[torch.multinomial(sorted_p, 1, generator=generator)[0]])
    return int(torch.multinomial(probs, 1, generator=generator)[0])


def choose(logits: torch.Tensor, temperatures: list[float], top_ps: list[float],
           generators: list[torch.Generator | None]) -> list[int | SamplingError]:
    """Token ids for logits [B, V]; a row with temperature ~0 is greedy. A row that cannot be sampled
    gives its SamplingError in its place, so the caller fails that request only. One host sync for a
    batch of greedy rows with finite logits (the common case)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        # numpy's argmax: ~8 µs over SmolLM2's 49 152 logits where torch's argmax and isfinite().all() took ~0.3 ms
        # (a tenth of the CPU demo's step). A row whose largest logit is finite has no NaN (argmax would pick it)
        # and no +inf, so its argmax is greedy_row's answer; any other row goes to greedy_row, as before.
        x = logits.detach().numpy()
        best = x.argmax(-1)
        out: list = best.tolist()
        ok = np.isfinite(x[np.arange(len(out)), best]).tolist()
    else:
        best, finite = logits.argmax(dim=-1), torch.isfinite(logits).all(dim=-1)
        out = best.tolist()
        ok = finite.tolist()
    for i, t in enumerate(temperatures):
        if ok[i] and is_greedy(t):
            continue
        try:
            out[i] = greedy_row(logits[i]) if is_greedy(t) else sample_row(logits[i], t, top_ps[i], generators[i])
        except SamplingError as e:
            out[i] = e
    return out


class GreedyPicks:
    """choose()'s answer for a batch whose rows are all greedy, with the host read deferred: the argmax
    (`best`) stays on the logits' device, where it can feed the next decode step before the host has seen it
    (engine.decode_ahead), and travels to the host beside each row's finiteness without a wait."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits
        self.best = logits.argmax(dim=-1)
        # A row whose largest logit is finite has no NaN (argmax would pick it) and no +inf: its argmax is greedy_row's.
        finite = torch.isfinite(logits.gather(-1, self.best[:, None]))[:, 0]
        if logits.device.type == "cuda":
            self._host = torch.empty(2, len(self.best), dtype=torch.long, pin_memory=True)
            self._host[0].copy_(self.best, non_blocking=True)
            self._host[1].copy_(finite, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = torch.stack([self.best, finite.long()]), None

    def tokens(self) -> tuple[list[int | SamplingError], bool]:
        """(choose()'s tokens for these logits at temperature 0, whether every row was `best`'s argmax:
        a row with a NaN or inf logit goes to greedy_row, as in choose(), and may differ or fail)."""
        if self._ready is not None:
            self._ready.synchronize()
        out, ok = self._host.tolist()
        for i in (i for i, fine in enumerate(ok) if not fine):
            try:
                out[i] = greedy_row(self.logits[i])
            except SamplingError as e:
                out[i] = e
        return out, all(ok)
