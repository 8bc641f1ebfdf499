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
from engine.store.odirect import aligned_buffer, open_direct, pread_full, probe

CHUNK = 32 << 20


def default_readers() -> int:
    return max(2, min(8, len(os.sched_getaffinity(0))))


def hash_records(path: str | os.PathLike, offsets: list[int], record_bytes: int, *, readers: int | None = None,
                 on_bytes: Callable[[int], None] | None = None) -> list[str]:
    """sha256 hex of each record at `offsets` (sorted ascending, record_bytes apart where consecutive)."""
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
    digests = hash_records(store_dir / mf.DATA, [r.offset for r in m.records], m.record_bytes,
                           readers=readers, on_bytes=progress)
    dt = time.perf_counter() - t0
    bad = [BadRecord(r.layer, r.expert, r.offset) for r, d in zip(m.records, digests) if d != r.sha256]
    return VerifyResult(store_dir, len(m.records), m.total_bytes, dt, bad)
