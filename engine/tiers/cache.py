"""The expert cache: which (layer, expert) sits in which slot of a tier, and what to evict.

Plain Python, no torch: the same classes drive the GPU and RAM tiers and the simulator. An
eviction policy only orders keys; the cache owns slots and counts hits, misses and evictions.
Keys the current computation still needs are `pinned` and never chosen as victims.
"""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Callable, Container, Hashable, Iterable, NamedTuple, Sequence


class ExpertKey(NamedTuple):
    """(layer, expert). A tuple, not a dataclass: a tiered decode step builds, hashes and compares ~70 of these
    per MoE layer in the host step the GPU waits for, and a tuple's hash and == run in C
    (bench/probes/host_step.py)."""
    layer: int
    expert: int


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}


class EvictionPolicy:
    """Orders resident keys for eviction. `access` is called on every lookup hit and every admission."""

    name = "base"

    def access(self, key: Hashable) -> None:
        raise NotImplementedError

    def remove(self, key: Hashable) -> None:
        raise NotImplementedError

    def victim(self, pinned: Container = ()) -> Hashable:
        raise NotImplementedError


class LRU(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self):
        self._order: OrderedDict = OrderedDict()

    def access(self, key):
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key):
        del self._order[key]

    def victim(self, pinned=()):
        for key in self._order:
            if key not in pinned:
                return key
        raise LookupError("every resident key is pinned")


def heap_victim(heap: list, live: Callable, key_of: Callable, pinned: Container) -> Hashable:
    """The first live, unpinned entry of a lazily-invalidated min-heap (LFU, Belady): stale entries
    are dropped on the way, pinned ones set aside and pushed back."""
    held = []
    try:
        while heap:
            entry = heap[0]
            if not live(entry):
                heapq.heappop(heap)
            elif key_of(entry) in pinned:
                held.append(heapq.heappop(heap))
            else:
                return key_of(entry)
        raise LookupError("every resident key is pinned")
    finally:
        for e in held:
            heapq.heappush(heap, e)


class LFU(EvictionPolicy):
    """Least frequently used first, ties to the least recently used.

    Counts survive eviction: an expert's popularity is a property of the model's routing, not of
    its stay in the cache, so a popular expert evicted once comes back with its history.
    """

    name = "lfu"

    def __init__(self):
        self._count: dict = {}
        self._stamp: dict = {}            # resident key -> (count, tick) of its live heap entry
        self._heap: list = []
        self._tick = itertools.count()

    def access(self, key):
        c = self._count.get(key, 0) + 1
        self._count[key] = c
        entry = (c, next(self._tick), key)
        self._stamp[key] = entry[:2]
        heapq.heappush(self._heap, entry)

    def remove(self, key):
        del self._stamp[key]              # its heap entries go stale and are skipped lazily

    def victim(self, pinned=()):
        return heap_victim(self._heap, lambda e: self._stamp.get(e[2]) == e[:2], lambda e: e[2], pinned)


class Belady(EvictionPolicy):
    """Belady's MIN: evict the key whose next use is farthest away. Needs the whole future, so
    it is an upper bound for the simulator, not a policy a server can run."""

    name = "belady"

    def __init__(self, accesses: Sequence[Hashable]):
        self._next: list[int] = [0] * len(accesses)
        last: dict = {}
        for i in range(len(accesses) - 1, -1, -1):
            self._next[i] = last.get(accesses[i], len(accesses))
            last[accesses[i]] = i
        self._pos = 0
        self._stamp: dict = {}
        self._heap: list = []

    def access(self, key):
        nxt = self._next[self._pos]
        self._pos += 1
        self._stamp[key] = nxt
        heapq.heappush(self._heap, (-nxt, key))

    def remove(self, key):
        del self._stamp[key]

    def victim(self, pinned=()):
        return heap_victim(self._heap, lambda e: self._stamp.get(e[1]) == -e[0], lambda e: e[1], pinned)


POLICIES = {"lru": LRU, "lfu": LFU}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r} (known: {', '.join(POLICIES)})") from None


@dataclass
class ExpertCache:
    """`capacity` slots (0..capacity-1) holding keys; a miss is admitted by the caller, evicting if full."""

    name: str
    capacity: int
    policy: EvictionPolicy = field(default_factory=LRU)
    stats: TierStats = field(default_factory=TierStats)

    def __post_init__(self):
        assert self.capacity >= 0, "capacity must be >= 0"
        self._slot: dict = {}
        self._free: list[int] = list(range(self.capacity - 1, -1, -1))
        # A set to collect the keys whose slot changes (admitted, evicted, discarded), for an owner that mirrors
        # the cache elsewhere (engine.tiers.zero_copy's device record table); None: not collected.
        self.changes: set | None = None

    @property
    def free(self) -> int:
        """Slots an admit can take without evicting."""
        return len(self._free)

    def __contains__(self, key) -> bool:
        return key in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def slot_of(self, key) -> int | None:
        """The key's slot, or None when it is not resident; a peek: no counter, no policy touch."""
        return self._slot.get(key)

    def lookup(self, key) -> int | None:
        """The key's slot (a hit, counted and touched) or None (a miss, counted)."""
        slot = self._slot.get(key)
        if slot is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.policy.access(key)
        return slot

    def admit(self, key, pinned: Container = ()) -> tuple[int, object | None]:
        """Give `key` a slot, evicting the policy's victim (never a pinned key) when full → (slot, evicted key)."""
        assert key not in self._slot, f"{key} is already resident"
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            if self.capacity == 0:
                raise LookupError(f"{self.name} tier has no slots")
            evicted = self.policy.victim(pinned)
            slot = self._slot.pop(evicted)
            self.policy.remove(evicted)
            self.stats.evictions += 1
        self._slot[key] = slot
        self.policy.access(key)
        if self.changes is not None:
            self.changes.add(key)
            if evicted is not None:
                self.changes.add(evicted)
        return slot, evicted

    def discard(self, key) -> None:
        """Let `key`'s slot go (free for the next admit), if it is resident; not an eviction."""
        slot = self._slot.pop(key, None)
        if slot is not None:
            self.policy.remove(key)
            self._free.append(slot)
            if self.changes is not None:
                self.changes.add(key)

    def resident(self) -> Iterable:
        return self._slot.keys()
