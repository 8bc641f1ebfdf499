"""A model's caches, allocated once and handed out one slot per sequence (SlotCaches: the interface the scheduler
uses, whatever the layers keep); KVCache, the standard one: [layers, slots, max_len, kv_heads, head_dim] for keys
and for values. (glm5_next declares its own: engine.models.glm5_next.Glm5Caches.)

A slot holds one sequence. Slots are handed out lowest-first so the active batch is usually a
contiguous range, which the attention reads as a view instead of a gather.

On the CPU the cache is anonymous mmap memory: zero-filled by the kernel page by page as it is first
written, so a cache sized for max_batch × context costs RSS only for the positions sequences reach
(torch.zeros would touch every page at load: 3 GB for the demo's 8 × 8192 fp32). Zeros, not
torch.empty's garbage: a batched decode reads (masked) keys past a short sequence's end, and a NaN there
would poison the attention's weighted sum even under a zero weight.
"""
from __future__ import annotations

import mmap

import torch


def untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)   # the tensor keeps buf alive


class SlotCaches:
    """What the scheduler (engine.scheduler) needs of a model's caches: `slots` sequences of up to `max_len`
    tokens, a slot allocated when a sequence starts and released (reset for the next) when it finishes or is
    cancelled."""

    # Whether a later sequence may start from a prefix a slot holds (engine.prefix_cache): at any position where the
    # slot's whole state is its positions' keys and values (KVCache); only at the positions it kept a snapshot of
    # its state at where it carries a recurrent state (glm5_next's Glm5Caches: see resumable).
    reusable_prefix = False

    def __init__(self, slots: int, max_len: int):
        assert slots > 0 and max_len > 0, "the caches need at least one slot and one position"
        self.slots = slots
        self.max_len = max_len
        self._free = list(range(slots))

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def reset(self, slot: int) -> None:
        """Forget what the slot's sequence left behind; a cache whose reads stop at the sequence's length
        (a KV cache) has nothing to do."""

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Positions 0..n of slot `src` into slot `dst`, and the state to go on from n (only where reusable_prefix;
        n: one resumable() gave)."""
        raise NotImplementedError(f"{type(self).__name__} holds state beyond its positions: no prefix to copy")

    # --- prefix reuse (engine.prefix_cache); a cache whose state is its positions has nothing to do but say yes ---
    def prepare_reuse(self, block: int) -> None:
        """The prefix cache is on and reuses whole blocks of `block` tokens: allocate what resuming needs."""

    def resumable(self, slot: int, n: int) -> int:
        """The longest prefix, at most n tokens of what `slot` holds, that a sequence may go on from: every one
        where the state is positional."""
        return n

    def resume(self, slot: int, n: int) -> None:
        """`slot`, just allocated, goes on from the first n positions it holds (n: one resumable() gave; 0: none)."""

    def keep_at(self, slot: int, positions: set[int]) -> None:
        """Positions of the sequence now in `slot` that later prompts may want to resume from (block boundaries its
        prefill passes): a cache that resumes only where it kept its state keeps it there."""

    # --- decode ahead (engine.decode_ahead): a step launched ahead and then not used is run again at the same
    # positions; a cache whose state is its positions has nothing to do (the redone writes are the same) ---
    def hold(self, slots: list[int]) -> None:
        """A step is about to be launched ahead for `slots`: keep what undo() needs to put their state back."""

    def undo(self, slots: list[int]) -> None:
        """The step launched ahead is not used: put back, for those of `slots` hold() was given, the state it
        advanced (the slots still running; an ended sequence's slot has been reset, and stays so)."""

    # --- slot allocation (the scheduler's thread only) ---
    def free_slots(self) -> int:
        return len(self._free)

    def free_list(self) -> list[int]:
        return list(self._free)

    def alloc(self, slot: int | None = None) -> int:
        """The lowest free slot, or `slot` (which must be free: engine.prefix_cache picks the one to reuse)."""
        if slot is None:
            self._free.sort()
            return self._free.pop(0)
        self._free.remove(slot)
        return slot

    def release(self, slot: int) -> None:
        assert slot not in self._free, f"slot {slot} released twice"
        self.reset(slot)
        self._free.append(slot)


class KVCache(SlotCaches):
    reusable_prefix = True

    def __init__(self, num_layers: int, slots: int, max_len: int, kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype, device: str | torch.device = "cpu"):
        super().__init__(slots, max_len)
        shape = (num_layers, slots, max_len, kv_heads, head_dim)
        self.k = untouched_zeros(shape, dtype, device)
        self.v = untouched_zeros(shape, dtype, device)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Positions 0..n of slot `src` into slot `dst`, every layer (a prefix computed once, reused)."""
        self.k[:, dst, :n] = self.k[:, src, :n]
        self.v[:, dst, :n] = self.v[:, src, :n]

    # --- per-layer access; `sel`/`idx` come from select(), made once per step, not per layer ---
    def write_prefill(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """One sequence's k, v [T, kv_heads, head_dim] at positions start..start+T."""
        self.k[layer, slot, start:start + k.shape[0]] = k
        self.v[layer, slot, start:start + v.shape[0]] = v

    def write_decode(self, layer: int, idx: torch.Tensor, positions: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor) -> None:
        """One token per sequence: k, v [B, kv_heads, head_dim] at (slot idx[b], positions[b])."""
        self.k[layer].index_put_((idx, positions), k)
        self.v[layer].index_put_((idx, positions), v)

    def read(self, layer: int, sel: slice | torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, length, kv_heads, head_dim] of the selected slots (a view when sel is a slice)."""
        return self.k[layer, sel, :length], self.v[layer, sel, :length]


def select(slots: list[int], device) -> tuple[slice | torch.Tensor, torch.Tensor]:
    """(sel, idx) for a batch of slots: sel reads them (a slice when they are contiguous, so no gather),
    idx [B] writes them."""
    idx = torch.tensor(slots, device=device)
    first = slots[0]
    if slots == list(range(first, first + len(slots))):
        return slice(first, first + len(slots)), idx
    return idx, idx


# ---------------------------------------------------------------- decode's key lengths
# The CUDA decode (eager, and each captured graph: engine.gpu.graphs) attends over a bucket of keys, not the exact
# count, so few shapes exist.

MIN_KV_BUCKET = 256


def kv_bucket(need: int, max_len: int) -> int:
    """Keys a CUDA decode step attends over when `need` are live: the next power of two (at least
    MIN_KV_BUCKET), capped at the KV cache's length. Few buckets, so few decode graphs (and few cuDNN
    plans in eager decode); the mask hides the keys past each sequence's position."""
    assert 0 < need <= max_len, f"{need} keys do not fit a KV cache of {max_len}"
    return min(max_len, max(MIN_KV_BUCKET, 1 << (need - 1).bit_length()))


def kv_buckets(max_len: int) -> list[int]:
    """Every bucket kv_bucket gives for a KV cache of max_len keys, shortest first."""
    out, n = [], 1
    while not out or out[-1] < max_len:
        out.append(kv_bucket(n, max_len))
        n = out[-1] + 1
    return out
