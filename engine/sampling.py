"""Next-token choice for a batch of sequences, computed where the logits are: on the GPU, nothing goes to the host
but the chosen ids.

One sampler for every device and every row: penalties (repetition over the prompt and output, presence and
frequency over the output), temperature, top-k, top-p, min-p, then a draw. The draw inverts the kept tokens'
cumulative distribution at one uniform number from a counter-based hash of (the request's seed, the index of the
token being drawn): an exact draw from softmax(z) restricted to the kept tokens, whose randomness depends on
nothing but the request's own seed and position, so a seeded request draws the same tokens alone or in any batch,
and no generator state has to travel with it (a step launched ahead draws from the ids still on the GPU,
engine.decode_ahead). Every op is a fixed-shape tensor op: no host read inside. (Per-token noise, as
Gumbel-max needs, cost 12 ms a draw over SmolLM2's 49,152 logits on the CPU; one number a row costs nothing.)
On a GPU the plain draw (temperature alone, the common case; also every non-truncating row of a truncating batch)
is two fused launches (engine.kernels.triton_sampling) instead of ~15 torch ops, and truncation the sorted torch
form; on the CPU each row is drawn with numpy, truncation ranking only the candidates it needs (no sort of the
vocabulary). The same function everywhere, its sums in other orders, so a device's ids equal themselves in any
batch but may differ from another device's on a token within rounding of the draw's boundary.

Numerically safe at every value the API lets through: a temperature too small to divide by is greedy, top-p and
min-p always keep the most likely token, NaN logits never win and +inf ones share the draw. A row that has no
finite logit at all is that request's failure (SamplingError), never its neighbours'.
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import numpy as np
import torch

from engine.kernels import triton_sampling

# Below this a softmax(logits / T) is one-hot up to fp32 rounding (a logit gap of 1e-3 is e^-100 apart),
# and dividing by a subnormal T overflows: such requests are greedy, as T -> 0+ is in the limit.
GREEDY_BELOW = 1e-5
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1          # int64, as vLLM takes it
MAX_PENALTY = 100.0                              # repetition penalty's limit; presence/frequency: ±2, as OpenAI's


class SamplingError(ValueError):
    """This row cannot be sampled (the model's logits are all NaN/-inf): its request fails alone."""


def check_params(temperature: float, top_p: float, seed: int | None, *, top_k: int = 0, min_p: float = 0.0,
                 repetition_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0) -> None:
    """ValueError naming the field and its limit for anything the sampler cannot use."""
    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not (number(temperature) and temperature >= 0.0):
        raise ValueError(f"temperature is {temperature}; it must be a finite number >= 0")
    if not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p is {top_p}; it must be in (0, 1]")
    if seed is not None and not (isinstance(seed, int) and SEED_MIN <= seed <= SEED_MAX):
        raise ValueError(f"seed is {seed}; it must be an integer in {SEED_MIN}..{SEED_MAX} (64 bits)")
    if not (isinstance(top_k, int) and not isinstance(top_k, bool) and 0 <= top_k < 2**31):
        raise ValueError(f"top_k is {top_k}; it must be an integer >= 0 (0: off)")
    if not (number(min_p) and 0.0 <= min_p <= 1.0):
        raise ValueError(f"min_p is {min_p}; it must be in [0, 1]")
    if not (number(repetition_penalty) and 0.0 < repetition_penalty <= MAX_PENALTY):
        raise ValueError(f"repetition_penalty is {repetition_penalty}; it must be in (0, {MAX_PENALTY:g}] (1: off)")
    for name, v in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not (number(v) and -2.0 <= v <= 2.0):
            raise ValueError(f"{name} is {v}; it must be in [-2, 2]")


def is_greedy(temperature: float) -> bool:
    return temperature < GREEDY_BELOW


def draw_seed(seed: int | None) -> int:
    """A request's seed: its own, or a fresh random one (the draws are then still the request's alone)."""
    return seed if seed is not None else secrets.randbits(63)


@dataclass(frozen=True)
class RowSpec:
    """One row's sampling: the request's settings, its seed, and which of its tokens this draw makes."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    index: int = 0                       # the request's token index being drawn (0: its first)

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature) and not self.penalised

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def truncates(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0


class Penalties:
    """Per KV slot, on the logits' device: which tokens its sequence holds (prompt and output: repetition
    penalty) and how often each was generated (presence and frequency penalties). Made at the first request that
    asks for a penalty; reset when a slot takes a new request."""

    def __init__(self, slots: int, vocab: int, device):
        self.seen = torch.zeros(slots, vocab, dtype=torch.bool, device=device)
        self.counts = torch.zeros(slots, vocab, dtype=torch.int32, device=device)

    def clone(self) -> Penalties:
        """A copy of the counts (a capture's eager warm-up records into it, not into the requests')."""
        out = Penalties.__new__(Penalties)
        out.seen, out.counts = self.seen.clone(), self.counts.clone()
        return out

    def reset(self, slot: int, prompt: list[int]) -> None:
        self.seen[slot].zero_()
        self.counts[slot].zero_()
        self.seen[slot, torch.tensor(prompt, device=self.seen.device)] = True

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Tokens [B] generated into slots [B] (device tensors: no host read, no host value: CUDA-graph capturable)."""
        self.seen.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.bool))
        self.counts.index_put_((slots, tokens), self.counts[slots, tokens] + 1)


# splitmix64's constants as int64 (torch's integer ops wrap modulo 2^64 on every device)
_GOLDEN, _MIX1, _MIX2 = -7046029254386353131, -4658895280553007687, -7723592293110705685
_STEP = 0x632BE59BD9B4E019


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _MIX1        # logical shifts: arithmetic ones, masked
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _MIX2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def uniform(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """One number in (0, 1) per row [B] (fp64, 53 bits), a pure function of the row's (seed, draw index) [B]."""
    key = _mix(_mix(seed * _GOLDEN + index * _STEP))
    return (((key >> 11) & ((1 << 53) - 1)).double() + 0.5) * (1.0 / (1 << 53))


def uniform_one(seed: int, index: int) -> float:
    """uniform()'s number for one row, in Python's integers (the CPU's draw: ~1 µs where the tensor form's dozen ops
    take ~40), bit for bit the same: the same wrap modulo 2^64, its masked shifts the logical ones here."""
    m = (1 << 64) - 1
    z = (seed * _GOLDEN + index * _STEP) & m
    for _ in range(2):
        z = ((z ^ (z >> 30)) * _MIX1) & m
        z = ((z ^ (z >> 27)) * _MIX2) & m
        z = z ^ (z >> 31)
    return (float(z >> 11) + 0.5) * (1.0 / (1 << 53))


def _invert(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative weight reaches u × the row's total: weights [B, N] >= 0 (a zero
    weight is never chosen), u [B]."""
    c = torch.cumsum(p.double(), -1)
    return torch.searchsorted(c, (u * c[:, -1])[:, None]).clamp_(max=p.shape[-1] - 1)[:, 0]


def _clean(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 logits with NaN as -inf, and in a row with some +inf those alone at 0, the rest -inf; whether each row
    has a finite logit)."""
    x = logits.float()
    posinf = x == float("inf")
    x = torch.where(posinf.any(-1, keepdim=True), torch.where(posinf, 0.0, float("-inf")),
                    torch.nan_to_num(x, nan=float("-inf"), posinf=0.0, neginf=float("-inf")))
    return x, torch.isfinite(x.amax(-1))


# draw()'s modes, which ops a batch's draw needs: GREEDY the plain argmax; ARGMAX the argmax of the cleaned (and
# penalised) logits; PLAIN the draw from the whole softmax; TRUNCATE the sorted path (top-k, top-p, min-p).
GREEDY, ARGMAX, PLAIN, TRUNCATE = "greedy", "argmax", "plain", "truncate"


def mode(rows: list[RowSpec], penalties: bool = True) -> str | None:
    """Which ops draw() runs for these rows (sample() runs the same for them); None where a row is penalised and
    `penalties` says the caller has no Penalties to hand draw() (the captured sampler without them)."""
    if all(r.greedy for r in rows):
        return GREEDY
    if not penalties and any(r.penalised for r in rows):
        return None
    if all(is_greedy(r.temperature) for r in rows):         # greedy rows, some with a penalty
        return ARGMAX
    return TRUNCATE if any(r.truncates for r in rows) else PLAIN


def pack(rows: list[RowSpec], pin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' settings as two host tensors, as draw() and sample() read them: floats [B, 6] fp32 (temperature,
    top_p, min_p, repetition, presence and frequency penalties), ints [B, 4] int64 (seed, the draw's index, top_k,
    whether the row is greedy by its temperature)."""
    floats = torch.tensor([[r.temperature, r.top_p, r.min_p, r.repetition_penalty, r.presence_penalty,
                            r.frequency_penalty] for r in rows], dtype=torch.float32, pin_memory=pin)
    ints = torch.tensor([[r.seed, r.index, r.top_k, is_greedy(r.temperature)] for r in rows], dtype=torch.int64,
                        pin_memory=pin)
    return floats, ints


def _argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An all-greedy batch: the argmax, and whether each row's largest logit is finite (three launches)."""
    best = logits.argmax(-1)
    return best, torch.isfinite(logits.gather(-1, best[:, None]))[:, 0]


def _plain(x: torch.Tensor, best: torch.Tensor | None, floats: torch.Tensor, ints: torch.Tensor) -> torch.Tensor:
    """Every row's plain draw from logits x [B, V] (its whole softmax at temperature T), greedy rows' `best`. On a
    GPU the fused kernels (engine.kernels.triton_sampling: two launches, which clean x and find the argmax
    themselves, so `best` may be None there); elsewhere the torch form on clean x."""
    seed, index, _, greedy = ints.T
    if triton_sampling.available(x.device):
        return triton_sampling.plain_draw(x, floats[:, 0], seed, index, greedy)[0]
    temperature = floats[:, :1]
    z = x / torch.where(temperature < GREEDY_BELOW, 1.0, temperature)
    return torch.where(greedy.bool(), best, _invert(torch.softmax(z, dim=-1), uniform(seed, index)))


def _pick(x: torch.Tensor, best: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor, truncate: bool) -> torch.Tensor:
    """The draw from clean (penalised) logits x [B, V]: greedy rows take `best`, the others invert the kept
    tokens' CDF at their (seed, index)'s number. A row that keeps every token draws by the plain path in any batch
    (the sorted path sums in another order: its ids could differ in the last bit), so its id does not depend on its
    neighbours' settings. Fixed-shape tensor ops only: CUDA-graph capturable."""
    drawn = _plain(x, best, floats, ints)
    if not truncate:
        return drawn
    temperature, top_p, min_p = floats.T[:3, :, None]
    seed, index, top_k, greedy = ints.T
    z = x / torch.where(temperature < GREEDY_BELOW, 1.0, temperature)
    u = uniform(seed, index)
    # the sorted path for the rows that truncate; the others keep the plain draw, as alone
    z, order = torch.sort(z, dim=-1, descending=True)
    pos = torch.arange(z.shape[-1], device=z.device)
    z = torch.where((top_k[:, None] > 0) & (pos >= top_k[:, None]), float("-inf"), z)
    p = torch.softmax(z, dim=-1)
    # top_p 1 keeps every token, whatever float32's sum of the ones before it rounds to
    keep = (((torch.cumsum(p, -1) - p) < top_p) | (top_p >= 1.0)) & (p >= min_p * p[:, :1])
    keep[:, 0] = True                               # the most likely token always stays
    kept = order.gather(-1, _invert(torch.where(keep, p, 0.0), u)[:, None])[:, 0]
    truncating = (top_k > 0) | (top_p[:, 0] < 1.0) | (min_p[:, 0] > 0.0)
    return torch.where(truncating & ~greedy.bool(), kept, drawn)


CANDIDATES = 256        # the CPU's truncating draw: tokens ranked first, then 8x more until the kept set is inside


def _cpu_pick(x: np.ndarray, best: np.ndarray, floats: torch.Tensor, ints: torch.Tensor) -> torch.Tensor:
    """_pick's function on the CPU for clean (penalised) logits x [B, V] float32: a row at a time with numpy and
    without sorting the vocabulary (the sorted torch form took ~4 ms a token over SmolLM2's 49,152 logits here, more
    than the CPU demo's whole decode step). Each row's id depends on its own logits, settings and number alone."""
    fl, it = floats.numpy(), ints.numpy()
    out = np.array(best, dtype=np.int64)
    for r in range(x.shape[0]):
        if not it[r, 3]:
            u = uniform_one(int(it[r, 0]), int(it[r, 1]))
            out[r] = _cpu_row(x[r], float(fl[r, 0]), float(fl[r, 1]), float(fl[r, 2]), int(it[r, 2]), u)
    return torch.from_numpy(out)


def _cpu_row(x: np.ndarray, temperature: float, top_p: float, min_p: float, top_k: int, u: float) -> int:
    """One row's draw from clean logits x [V]: softmax(x / T) restricted as _pick restricts it (the top_k largest,
    then the most likely tokens while the mass before each is below top_p and each is at least min_p times the
    first; the first always), its CDF inverted at u. Ranked by logit, ties by the lower id."""
    z = x / np.float32(temperature if temperature >= GREEDY_BELOW else 1.0)
    top = z.max()
    if not np.isfinite(top):                # no finite logit: the row's failure is reported by `ok`
        return 0
    e = np.exp(z - top)                     # float32 weights; -inf logits weigh 0
    v = len(z)
    if top_k <= 0 and top_p >= 1.0 and min_p <= 0.0:
        c = torch.cumsum(torch.from_numpy(e), 0, dtype=torch.float64).numpy()     # numpy's widening sum: 5x slower
        return min(int(np.searchsorted(c, u * c[-1])), v - 1)
    k = min(top_k, v) if top_k > 0 else min(CANDIDATES, v)
    total = None if top_k > 0 else e.sum(dtype=np.float64)          # top-k renormalises over its own tokens
    while True:
        ids = np.argpartition(-z, k - 1)[:k] if k < v else np.arange(v)
        ids = ids[np.lexsort((ids, -z[ids]))]            # by logit, descending; ties by id
        w = e[ids].astype(np.float64)
        p = w / (w.sum() if total is None else total)
        before = np.cumsum(p) - p
        keep = ((before < top_p) | (top_p >= 1.0)) & (p >= min_p * p[0])
        keep[0] = True
        # the kept tokens are a prefix of the ranking: done once one of these ranked tokens falls outside it (or
        # every candidate there is has been ranked)
        if top_k > 0 or k == v or not keep[-1]:
            break
        k = min(8 * k, v)
    c = np.cumsum(np.where(keep, p, 0.0))
    return int(ids[min(int(np.searchsorted(c, u * c[-1])), len(ids) - 1)])


def _penalise(x: torch.Tensor, floats: torch.Tensor, penalties: Penalties, slots: torch.Tensor) -> torch.Tensor:
    """Repetition over the slot's prompt and output, presence and frequency over its output (a row without a
    penalty: 1, 0, 0, leaves its logits as they are)."""
    rep, presence, frequency = floats.T[3:6, :, None]
    seen, counts = penalties.seen[slots], penalties.counts[slots].float()
    return torch.where(seen, torch.where(x > 0, x / rep, x * rep), x) - presence * (counts > 0) - frequency * counts


def draw(logits: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor, how: str, penalties: Penalties | None = None,
         slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """sample() for rows that mode() gives `how` (not None), from their pack()ed settings already on the logits'
    device: (ids [B], whether each is final [B]); with `penalties`, the rows' slots' counts [B] penalise the logits
    first and record the ids after. Off the CPU no host read and no branch on the tensors' values, so it can be
    captured in a CUDA graph whose static inputs are floats, ints and slots (engine.gpu.sampler_graph); on the CPU
    (no graph there) the rows are read and drawn on the host (_cpu_pick). Its ids equal sample()'s bit for bit
    (sample() runs it)."""
    if how == GREEDY:
        return _argmax(logits)
    if how != ARGMAX and penalties is None and logits.device.type == "cpu" and logits.dtype == torch.float32:
        xs = logits.detach().numpy()
        if np.isfinite(xs).all():               # nothing for _clean to do: numpy's argmax, the rows drawn in numpy
            return _cpu_pick(xs, xs.argmax(-1), floats, ints), torch.ones(len(xs), dtype=torch.bool)
    if how == PLAIN and penalties is None and triton_sampling.available(logits.device):
        ids, ok, _ = triton_sampling.plain_draw(logits, floats[:, 0], ints[:, 0], ints[:, 1], ints[:, 3])
        return ids, ok.bool()             # the kernels clean the logits and take greedy rows' argmax themselves
    x, ok = _clean(logits)
    if penalties is not None:
        x = _penalise(x, floats, penalties, slots)
    best = x.argmax(-1)
    if how == ARGMAX:
        tokens = best
    elif x.device.type == "cpu":
        tokens = _cpu_pick(x.numpy(), best.numpy(), floats, ints)
    else:
        tokens = _pick(x, best, floats, ints, how == TRUNCATE)
    if penalties is not None:
        penalties.record(slots, tokens)
    return tokens, ok


def sample(logits: torch.Tensor, rows: list[RowSpec], *, penalties: Penalties | None = None,
           slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [B], whether each row's id is final [B]) for logits [B, V], on the logits' device, without
    reading anything back. A row that is not final: a sampled one had no finite logit; in an all-greedy batch
    (the plain argmax, three launches) a row whose largest logit is not finite (NaN or +inf: greedy_row decides it
    on the host). Penalised rows need `penalties` and their `slots` [B]."""
    how = mode(rows)
    if how == GREEDY:
        return _argmax(logits)
    floats, ints = pack(rows, pin=logits.device.type == "cuda")   # pinned: a pageable copy would wait for the stream
    floats, ints = floats.to(logits.device, non_blocking=True), ints.to(logits.device, non_blocking=True)
    if not any(r.penalised for r in rows):
        penalties = None
    return draw(logits, floats, ints, how, penalties, slots)


def greedy_row(logits: torch.Tensor) -> int:
    x, ok = _clean(logits[None])
    if not bool(ok[0]):
        raise SamplingError("the model produced no finite logit for this sequence (all NaN or -inf)")
    return int(x[0].argmax())


def _fast_greedy(logits: torch.Tensor) -> list[int] | None:
    """The CPU's all-greedy batch by numpy's argmax (~8 µs over SmolLM2's 49 152 logits where torch's took ~0.3 ms,
    a tenth of the CPU demo's step), where every row's largest logit is finite (then it has no NaN, which argmax
    would pick, and no +inf); else None."""
    x = logits.detach().numpy()
    best = x.argmax(-1)
    return best.tolist() if bool(np.isfinite(x[np.arange(len(best)), best]).all()) else None


class Picks:
    """sample()'s answer with the host read deferred: the ids (`best`) stay on the logits' device, where they can
    feed the next decode step before the host has seen them (engine.decode_ahead), and travel to the host
    beside each row's finiteness without a wait."""

    def __init__(self, logits: torch.Tensor, rows: list[RowSpec], *, penalties: Penalties | None = None,
                 slots: torch.Tensor | None = None, drawn: torch.Tensor | None = None):
        """`drawn`: [2, B] int64 already on the device for these rows, the ids and 1 where final (the sampler
        captured after a decode graph: engine.gpu.sampler_graph); else sample() draws them now."""
        self.logits, self.rows = logits, rows
        if drawn is None:
            best, ok = sample(logits, rows, penalties=penalties, slots=slots)
            drawn = torch.stack([best, ok.long()])      # one copy to the host, not two
        self.best = drawn[0]
        if logits.device.type == "cuda":
            self._host = torch.empty(2, len(self.best), dtype=torch.long, pin_memory=True)
            self._host.copy_(drawn, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = drawn, None

    def tokens(self) -> tuple[list[int | SamplingError], bool]:
        """(each row's token, or the SamplingError of a row with no finite logit; whether every row's id on the
        device was final: else a step launched from them fed a row a token it did not get)."""
        if self._ready is not None:
            self._ready.synchronize()
        out, ok = self._host.tolist()
        for i in (i for i, fine in enumerate(ok) if not fine):
            try:
                if not self.rows[i].greedy:
                    raise SamplingError("the model produced no finite logit for this sequence (all NaN or -inf)")
                out[i] = greedy_row(self.logits[i])
            except SamplingError as e:
                out[i] = e
        return out, all(ok)


def choose(logits: torch.Tensor, rows: list[RowSpec], *, penalties: Penalties | None = None,
           slots: torch.Tensor | None = None) -> list[int | SamplingError]:
    """Token ids for logits [B, V] now (one host read), a failing row's SamplingError in its place."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and all(r.greedy for r in rows):
        if (fast := _fast_greedy(logits)) is not None:
            return fast
    return Picks(logits, rows, penalties=penalties, slots=slots).tokens()[0]
