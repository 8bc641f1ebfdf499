"""The RAM tier arena: N record-sized slots in one page-aligned anonymous mapping.

Page alignment lets readers preadv (O_DIRECT) straight into a slot. On CUDA machines the arena
is page-locked with cudaHostRegister in chunks (a single multi-GiB registration is slow and
some drivers cap it), never with Tensor.pin_memory(), which would copy into the caching host
allocator and double the footprint.
"""
from __future__ import annotations

import ctypes
import logging
import os
import weakref
from pathlib import Path

import torch

from engine.errors import EngineError, Exit
from engine.store import manifest as mf
from engine.store.odirect import aligned_buffer
from engine.tiers.cache import ExpertCache, ExpertKey, make_policy
from engine.tiers.readers import StoreReaders

log = logging.getLogger("engine.tiers")

REGISTER_CHUNK = 1 << 30
GIB = 1 << 30


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" else int(text)


def _cgroup_mounts() -> dict[str, Path]:
    """'cgroup2' and 'memory' (v1) -> mount point."""
    out: dict[str, Path] = {}
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fs, _, opts = right.split()[:3]
                mnt = Path(left.split()[4])
                if fs == "cgroup2":
                    out.setdefault("cgroup2", mnt)
                elif fs == "cgroup" and "memory" in opts.split(","):
                    out.setdefault("memory", mnt)
    except OSError:
        pass
    return out


def cgroup_memory() -> tuple[int, int, str] | None:
    """(limit, current usage, source) of this process's memory cgroup, or None when uncapped."""
    mounts = _cgroup_mounts()
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hid, ctrls, path = line.split(":", 2)
        rel = path.lstrip("/")
        if hid == "0" and "cgroup2" in mounts:
            for d in (mounts["cgroup2"] / rel, mounts["cgroup2"]):   # inside a cgroup namespace the path is '/'
                limit, cur = _read_int(d / "memory.max"), _read_int(d / "memory.current")
                if limit is not None and cur is not None:
                    return limit, cur, f"cgroup v2 {d}/memory.max"
        if "memory" in ctrls.split(",") and "memory" in mounts:
            for d in (mounts["memory"] / rel, mounts["memory"]):
                limit, cur = _read_int(d / "memory.limit_in_bytes"), _read_int(d / "memory.usage_in_bytes")
                if limit is not None and cur is not None and limit < (1 << 60):   # v1 "unlimited" is ~2^63
                    return limit, cur, f"cgroup v1 {d}/memory.limit_in_bytes"
    return None


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def ram_budget(margin_fraction: float = 0.15, min_margin: int = 2 * GIB, avail_fraction: float = 0.5) -> tuple[int, str]:
    """Bytes the RAM tier may take, and why: the cgroup cap minus usage minus a margin (the KV
    cache, activations and the page cache of non-expert weights live there too), else a fraction
    of MemAvailable."""
    cg = cgroup_memory()
    if cg:
        limit, cur, src = cg
        margin = max(min_margin, int(limit * margin_fraction))
        return max(0, limit - cur - margin), f"{src}: {limit / GIB:.1f} GiB cap - {cur / GIB:.1f} GiB used - {margin / GIB:.1f} GiB margin"
    avail = mem_available()
    return int(avail * avail_fraction), f"no memory cgroup cap: {avail_fraction:.0%} of MemAvailable {avail / GIB:.1f} GiB"


class RamArena:
    """`slots` slots of `record_bytes`, each a 4 KiB-aligned buffer usable for O_DIRECT reads."""

    def __init__(self, slots: int, record_bytes: int, *, pin_cuda: bool = False):
        assert slots >= 1 and record_bytes % 4096 == 0
        self.slots, self.record_bytes = slots, record_bytes
        try:
            self._mm = aligned_buffer(slots * record_bytes)
        except (OSError, ValueError) as e:
            raise EngineError(f"RAM tier: cannot map {slots} x {record_bytes} bytes ({e})", Exit.IO) from None
        self.bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._view = memoryview(self._mm)
        self._registered: list[int] = []
        self._device_bases: list[int] | None = None     # each registered chunk's address in the GPU's space
        # Unregistered when the arena goes, closed or not: CUDA keeps a registration past the munmap, and the
        # next mapping at that address then fails to register ("already mapped", error 712).
        self._unregister = weakref.finalize(self, _unregister, self._registered)
        if pin_cuda:
            self._register()

    def _register(self) -> None:
        cudart = torch.cuda.cudart()
        base, total = self.bytes.data_ptr(), self.slots * self.record_bytes
        # Chunks hold whole slots: one copy must not straddle two registrations (cudaMemcpyAsync
        # then fails with "invalid argument").
        chunk = max(1, REGISTER_CHUNK // self.record_bytes) * self.record_bytes
        for off in range(0, total, chunk):
            n = min(chunk, total - off)
            rc = cudart.cudaHostRegister(base + off, n, 0)
            if int(rc) != 0:
                self.close()
                raise EngineError(f"RAM tier: cudaHostRegister of {n} bytes at +{off} failed (error {int(rc)}; "
                                  f"is `ulimit -l` / LimitMEMLOCK too low?)", Exit.IO)
            self._registered.append(base + off)
        self._chunk = chunk
        log.info("RAM tier: %d slots (%.2f GiB) page-locked with cudaHostRegister in %d chunks",
                 self.slots, total / GIB, len(self._registered))

    def device_address(self, slot: int) -> int | None:
        """Where a GPU kernel reads this slot in place (over PCIe), or None where it cannot: an arena not
        page-locked for CUDA, or a CUDA runtime whose cudaHostGetDevicePointer cannot be reached. Registered
        memory is mapped into the device's address space (cudaHostRegisterDefault under unified addressing);
        its device address is asked for rather than assumed equal to the host's. (On a CPU "device", the
        tests' GPU stand-in, kernels read host_address.)"""
        host = self.host_address(slot)
        if not self._registered:
            return None
        if self._device_bases is None:
            self._device_bases = [_device_pointer(p) for p in self._registered] or []
        i = slot * self.record_bytes // self._chunk
        base = self._device_bases[i]
        return None if base is None else base + (host - self._registered[i])

    def host_address(self, slot: int) -> int:
        return self.bytes.data_ptr() + slot * self.record_bytes

    @property
    def pinned(self) -> bool:
        return bool(self._registered)

    def buffer(self, slot: int) -> memoryview:
        """Writable, 4 KiB-aligned view of one slot, for preadv."""
        return self._view[slot * self.record_bytes:(slot + 1) * self.record_bytes]

    def tensor(self, slot: int, dtype: torch.dtype) -> torch.Tensor:
        """The slot as a flat tensor of `dtype` (no copy)."""
        return self.bytes[slot * self.record_bytes:(slot + 1) * self.record_bytes].view(dtype)

    def close(self) -> None:
        self._unregister()


def _cudart():
    """The CUDA runtime torch loaded (dlopen by soname finds the loaded copy), or None."""
    names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"]
    try:
        with open("/proc/self/maps") as f:       # a runtime loaded from a wheel's own folder, by its path
            names += sorted({line.split()[-1] for line in f if "libcudart.so" in line})
    except OSError:
        pass
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            lib.cudaHostGetDevicePointer.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_uint]
            return lib
        except (OSError, AttributeError):
            continue
    return None


def _device_pointer(host: int) -> int | None:
    """cudaHostGetDevicePointer of registered host memory, or None (no runtime reachable, or it refused)."""
    lib = _cudart()
    if lib is None:
        return None
    out = ctypes.c_void_p()
    rc = lib.cudaHostGetDevicePointer(ctypes.byref(out), ctypes.c_void_p(host), 0)
    return out.value if rc == 0 and out.value else None


def _unregister(registered: list[int]) -> None:
    """The arena's cudaHostUnregister calls (weakref.finalize: it must not hold the arena, only its list)."""
    if registered:
        cudart = torch.cuda.cudart()
        for p in registered:
            cudart.cudaHostUnregister(p)
        registered.clear()


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the kernel (glibc's malloc_trim(0), every arena): a model's load frees
    its transients (the float vocabulary it reads to hold as 8-bit blocks, safetensors reads, per-tensor casts) into
    the loading thread's malloc arena, which keeps them resident, 35-40 MB of the CPU demo server's RSS, and the
    RAM tier's records then come on top. → whether it ran (False without glibc's malloc_trim)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def default_ram_slots(record_bytes: int, records: int) -> int:
    budget, why = ram_budget()
    slots = max(1, min(records, budget // record_bytes))
    log.info("RAM tier: %d of %d expert records (%.2f GiB); %s", slots, records, slots * record_bytes / GIB, why)
    return slots


class RamTier:
    """The RAM tier as a whole: which experts sit in which RamArena slot (an ExpertCache), and the store
    readers that fill a slot on a miss. `before_refill` is called before slots are overwritten: a GPU
    tier whose copies may still be reading them waits there. Keys in `held` (the experts a CPU-lane job
    is computing from) are never evicted until the job is collected."""

    def __init__(self, manifest, store_dir, *, slots: int, readers: int, reader_cpus: set[int] | None,
                 policy: str, pin_cuda: bool):
        self.manifest = manifest
        self.cache = ExpertCache("ram", slots, make_policy(policy))
        self.arena = RamArena(slots, manifest.record_bytes, pin_cuda=pin_cuda)
        self.readers = StoreReaders(Path(store_dir) / mf.DATA, readers, reader_cpus)
        self.before_refill = lambda: None
        self.held: set = set()

    def room(self, keys) -> int:
        """How many more experts a fetch may admit besides `keys` without evicting a held key."""
        return self.cache.capacity - len(self.held | set(keys))

    def release(self, key) -> None:
        """`key` went up into a GPU slot: its RAM slot is free (the tiers are exclusive: engine.tiers.gpu),
        unless a CPU-lane job holds it until collected."""
        if key not in self.held:
            self.cache.discard(key)

    def slot_for(self, key, keep) -> int | None:
        """A RAM slot for `key`, a GPU slot's evicted record about to be written back (evicting RAM's own
        victim, never a key in `keep` or held) → None when RAM has it already or no slot can be spared."""
        if key in self.cache:
            return None
        keep = self.held | keep
        if len(keep) >= self.cache.capacity:
            return None
        return self.cache.admit(key, keep)[0]

    def fetch(self, layer: int, experts: list[int], pinned) -> tuple[dict[int, int], set[int]]:
        """Make every expert of `experts` (at most `cache.capacity` of them) resident in RAM, reading the
        misses from the store all at once → ({expert: RAM slot}, the experts that came from the store).
        Keys in `pinned` (and these experts) are never evicted."""
        keys = {e: ExpertKey(layer, e) for e in experts}
        keep = set(pinned) | set(keys.values()) | self.held
        slots: dict[int, int] = {}
        for e in experts:
            r = self.cache.lookup(keys[e])
            if r is not None:
                slots[e] = r
        missing = [e for e in experts if e not in slots]
        if missing:
            self.before_refill()
            reads = []
            for e in missing:
                slots[e], _ = self.cache.admit(keys[e], keep)
                reads.append((self.manifest.record(layer, e).offset, self.arena.buffer(slots[e])))
            self.readers.read_batch(reads)
        return slots, set(missing)

    def close(self) -> None:
        self.readers.close()
        self.arena.close()
