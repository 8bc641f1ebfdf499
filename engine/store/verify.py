"""Re-read records with O_DIRECT and hash them, with several reader threads.

Each thread owns an fd and one aligned buffer and takes runs of consecutive records (up to
CHUNK bytes) from a shared counter: big sequential reads keep the disk busy, and both
os.preadv and hashlib release the GIL, so N threads overlap reads with hashing.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.errors import EngineError, Exit
from engine.store import manifest as mf
from engine.quant.gguf import GgufExperts
from engine.quant.records import HEADER, read_header
from engine.store.odirect import aligned_buffer, open_direct, pread_full, probe

CHUNK = 32 << 20
HEAD = HEADER           # bytes of each record's start kept for the header check


def default_readers() -> int:
    return max(2, min(8, len(os.sched_getaffinity(0))))


def hash_records(path: str | os.PathLike, offsets: list[int], record_bytes: int, *, readers: int | None = None,
                 on_bytes: Callable[[int], None] | None = None, heads: list[bytes] | None = None) -> list[str]:
    """sha256 hex of each record at `offsets` (sorted ascending, record_bytes apart where consecutive). heads: a
    list as long as offsets that receives each record's first HEAD bytes (a ggml: record's header)."""
    per_chunk = max(1, CHUNK // record_bytes)
    runs: list[tuple[int, int]] = []      # (first record index, count) of physically consecutive records
    i = 0
    while i < len(offsets):
        j = i + 1
        while j < len(offsets) and j - i < per_chunk and offsets[j] == offsets[j - 1] + record_bytes:
            j += 1
        runs.append((i, j - i))
        i = j
    digests: list[str] = [""] * len(offsets)
    next_run = iter(range(len(runs)))
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work():
        fd = open_direct(path)
        buf = aligned_buffer(per_chunk * record_bytes)
        view = memoryview(buf)
        try:
            while not errors:
                with lock:
                    k = next(next_run, None)
                if k is None:
                    return
                first, count = runs[k]
                n = count * record_bytes
                pread_full(fd, view[:n], offsets[first])
                for r in range(count):
                    digests[first + r] = hashlib.sha256(view[r * record_bytes:(r + 1) * record_bytes]).hexdigest()
                    if heads is not None:
                        heads[first + r] = bytes(view[r * record_bytes:r * record_bytes + HEAD])
                if on_bytes:
                    on_bytes(n)
        except BaseException as e:  # surfaced in the caller's thread
            errors.append(e)
        finally:
            view.release()
            buf.close()
            os.close(fd)

    threads = [threading.Thread(target=work, name=f"store-verify-{t}", daemon=True)
               for t in range(max(1, min(readers or default_readers(), len(runs))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        e = errors[0]
        if isinstance(e, (EngineError, KeyboardInterrupt)):
            raise e
        if isinstance(e, EOFError):
            raise EngineError(f"{path}: {e}", Exit.INTEGRITY) from None
        if isinstance(e, OSError):
            raise EngineError(f"{path}: read failed ({e.strerror or e})", Exit.IO) from None
        raise e
    return digests


@dataclass(frozen=True)
class BadRecord:
    layer: int
    expert: int
    offset: int

    def __str__(self) -> str:
        return f"layer {self.layer} expert {self.expert} offset {self.offset} (0x{self.offset:x})"


@dataclass
class VerifyResult:
    store: Path
    records: int
    bytes: int
    seconds: float
    bad: list[BadRecord]

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


def verify_store(store_dir: str | os.PathLike, *, readers: int | None = None, progress=None) -> VerifyResult:
    """Check every record's sha256 against the manifest. `progress(n_bytes)` is called as bytes are hashed."""
    store_dir = Path(store_dir)
    m = mf.load(store_dir)
    probe(store_dir)
    t0 = time.perf_counter()
    heads = [b""] * len(m.records) if m.layer_types is not None else None
    digests = hash_records(store_dir / mf.DATA, [r.offset for r in m.records], m.record_bytes,
                           readers=readers, on_bytes=progress, heads=heads)
    dt = time.perf_counter() - t0
    if heads is not None:
        check_headers(store_dir, m, heads)
    bad = [BadRecord(r.layer, r.expert, r.offset) for r, d in zip(m.records, digests) if d != r.sha256]
    return VerifyResult(store_dir, len(m.records), m.total_bytes, dt, bad)


def check_headers(store_dir: Path, m: mf.Manifest, heads: list[bytes]) -> None:
    """Each ggml: record's header names the types the manifest gives its layer: the first that does not is one
    line (exit 8), since a kernel reads the types from the record and the manifest would lie about them."""
    for r, head in zip(m.records, heads):
        want = m.record_types(r.layer)
        try:
            got = read_header(head)
        except ValueError as e:
            got = None
            why = str(e)
        if got != want:
            said = "/".join(got) if got else why
            raise EngineError(f"{store_dir / mf.DATA}: layer {r.layer} expert {r.expert}'s record holds {said}, the "
                              f"manifest says {'/'.join(want)}; repack with `engine pack-store`", Exit.INTEGRITY)


def check_gguf_types(store_dir: Path, m: mf.Manifest, gguf_path) -> None:
    """The store's records have the types a GGUF's expert tensors have, layer by layer: a store packed from
    another quantization of the model is one line (exit 3), naming the layer and both types."""
    src = GgufExperts(gguf_path, layers=m.moe_layers, experts=m.experts_per_layer, hidden=m.hidden,
                      intermediate=m.intermediate)
    for l in m.moe_layers:
        want, got = src.layer_types[l], m.record_types(l)
        if got != want:
            have = "/".join(got) if got else f"{m.quant} records"
            raise EngineError(f"{store_dir}: layer {l}'s records are {have}, {gguf_path}'s experts are "
                              f"{'/'.join(want)}; repack from that file", Exit.BAD_MODEL)
