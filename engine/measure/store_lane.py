"""The store lane's rate: whole expert records read with O_DIRECT at random offsets, as the tiers' readers read them,
on 1 and N threads, and on N threads a second pass over the same records (a reader re-reads records the tiers
evicted; a device's own cache may serve those faster than a cold pass, and a bound must not assume the slower)."""
from __future__ import annotations

import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine.store.odirect import aligned_buffer, open_direct, pread_full


def record_read_rates(store_file: Path, record_bytes: int, n_records: int, threads: int = 16,
                      picks: int = 96) -> dict[str, float]:
    """GB/s: disk_odirect_random_1t_gbps (24 records), disk_odirect_random_{threads}t_gbps (`picks` records) and
    disk_odirect_reread_{threads}t_gbps (the same records again)."""
    out: dict[str, float] = {}
    fd = open_direct(store_file)
    try:
        for n_threads in (1, threads):
            bufs = [aligned_buffer(record_bytes) for _ in range(n_threads)]
            chosen = random.Random(n_threads).sample(range(n_records), min(n_records, picks if n_threads > 1 else 24))

            def one_pass() -> float:
                t0 = time.perf_counter()
                with ThreadPoolExecutor(n_threads) as ex:
                    list(ex.map(lambda i: pread_full(fd, bufs[i % n_threads], chosen[i] * record_bytes),
                                range(len(chosen))))
                return len(chosen) * record_bytes / (time.perf_counter() - t0) / 1e9

            out[f"disk_odirect_random_{n_threads}t_gbps"] = one_pass()
            if n_threads > 1:
                out[f"disk_odirect_reread_{n_threads}t_gbps"] = one_pass()
    finally:
        os.close(fd)
    return out
