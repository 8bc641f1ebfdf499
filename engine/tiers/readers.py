"""Store readers: threads doing O_DIRECT preadv of whole records into RAM-tier slots.

A layer's misses are read as one batch, one record per task, so N readers keep N requests in
flight (NVMe needs queue depth to reach its bandwidth). Threads can be pinned to CPUs so they
do not compete with the compute threads (the seed pins 16 readers to CPUs 26-39).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from engine.errors import EngineError, Exit
from engine.store.odirect import open_direct, pread_full

log = logging.getLogger("engine.tiers")


class StoreReaders:
    def __init__(self, path: str | os.PathLike, threads: int, cpus: set[int] | None = None):
        self.path = path
        self.fd = open_direct(path)        # preadv takes the offset, so one fd serves every thread
        allowed = os.sched_getaffinity(0)
        self.cpus = (cpus & allowed) if cpus else None
        if cpus and not self.cpus:
            log.warning("store readers: CPUs %s are outside this process's set %s; not pinning",
                        sorted(cpus), sorted(allowed))
            self.cpus = None
        elif cpus and self.cpus != cpus:
            log.warning("store readers: pinning to %s (the rest of %s is outside this process's CPUs)",
                        sorted(self.cpus), sorted(cpus))
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="store-reader", initializer=self._pin)
        self.bytes_read = 0
        self.reads = 0
        self.seconds = 0.0
        self._lock = threading.Lock()

    def _pin(self) -> None:
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)     # pid 0 = the calling thread

    def read_batch(self, requests: list[tuple[int, memoryview]]) -> None:
        """Fill each buffer from its offset, all in flight at once; returns when every read is done."""
        if not requests:
            return
        t0 = time.perf_counter()
        futures = [self._pool.submit(pread_full, self.fd, buf, off) for off, buf in requests]
        try:
            n = sum(f.result() for f in futures)
        except EOFError as e:
            raise EngineError(f"{self.path}: {e} (truncated store? run `engine verify-store`)", Exit.INTEGRITY) from None
        except OSError as e:
            raise EngineError(f"{self.path}: read failed ({e.strerror or e})", Exit.IO) from None
        with self._lock:
            self.seconds += time.perf_counter() - t0
            self.bytes_read += n
            self.reads += len(requests)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
