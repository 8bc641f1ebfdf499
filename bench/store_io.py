"""Store I/O on this machine: pack-store and verify-store GB/s against plain O_DIRECT sequential
write and read of the same byte count, plus one core's sha256 rate, all in one run.

A synthetic bf16 checkpoint shaped like Qwen3-30B-A3B's experts (hidden 2048, expert FFN 768,
9,437,184-byte records) is written first, sized to fit the free disk (--gb, default 4).

    .venv/bin/python -m bench.store_io [--gb 4] [--dir /tmp] [--readers N]

pack's write figure includes reading the checkpoint (from the page cache: it was just written),
packing and hashing each record; verify's includes hashing. The plain rows are the disk's bound.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import tempfile
import time
from datetime import date
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import save_file

from bench.harness import write_result
from engine.store.odirect import aligned_buffer, fstype, pread_full, pwrite_full
from engine.store.pack import pack_store
from engine.store.verify import default_readers, verify_store

HIDDEN, INTER = 2048, 768
RECORD = 3 * HIDDEN * INTER * 2
CHUNK = 32 << 20


def synth_checkpoint(out: Path, layers: int, experts: int) -> None:
    out.mkdir(parents=True)
    cfg = {"model_type": "qwen3_moe", "hidden_size": HIDDEN, "moe_intermediate_size": INTER, "num_experts": experts,
           "num_hidden_layers": layers, "num_experts_per_tok": 8, "torch_dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    for l in range(layers):
        t = {}
        for e in range(experts):
            for name, shape in (("gate_proj", (INTER, HIDDEN)), ("up_proj", (INTER, HIDDEN)), ("down_proj", (HIDDEN, INTER))):
                t[f"model.layers.{l}.mlp.experts.{e}.{name}.weight"] = (
                    torch.randint(-32768, 32767, shape, dtype=torch.int16, generator=g).view(torch.bfloat16))
        save_file(t, out / f"model-{l:05d}.safetensors")


def plain_write(path: Path, nbytes: int) -> float:
    buf = aligned_buffer(CHUNK)
    buf[:] = os.urandom(1 << 20) * (CHUNK >> 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        t0 = time.perf_counter()
        for off in range(0, nbytes, CHUNK):
            pwrite_full(fd, memoryview(buf)[:min(CHUNK, nbytes - off)], off)
        os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def plain_read(path: Path, nbytes: int) -> float:
    buf = aligned_buffer(CHUNK)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        t0 = time.perf_counter()
        for off in range(0, nbytes, CHUNK):
            pread_full(fd, memoryview(buf)[:min(CHUNK, nbytes - off)], off)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def sha256_rate(nbytes: int = 1 << 30) -> float:
    block = os.urandom(CHUNK)
    t0 = time.perf_counter()
    for _ in range(nbytes // CHUNK):
        hashlib.sha256(block).digest()
    return nbytes / (time.perf_counter() - t0) / 1e9


@click.command()
@click.option("--gb", default=4.0, show_default=True, help="Store size to aim for (GB); shrunk to fit the free disk.")
@click.option("--dir", "base", default="/tmp", show_default=True, type=click.Path(file_okay=False))
@click.option("--readers", default=None, type=int, help="Verify reader threads [default: CPUs, 2..8].")
@click.option("--out", default=None, type=click.Path(dir_okay=False), help="JSON path [bench/results/<date>-cpu-store.json].")
def bench(gb, base, readers, out):
    free = shutil.disk_usage(base).free
    gb = min(gb, free / 1e9 / 4)              # checkpoint + store + plain file, with room to spare
    experts = 64
    layers = max(1, round(gb * 1e9 / (experts * RECORD)))
    nbytes = layers * experts * RECORD
    con = Console(stderr=True)
    load0 = os.getloadavg()[0]        # the CPUs are shared: a busy machine lowers every hashing figure
    work = Path(tempfile.mkdtemp(dir=base, prefix="kiln-store-bench-"))
    try:
        con.print(f"synthetic checkpoint: {layers} layers x {experts} experts x {RECORD} B = {nbytes / 1e9:.2f} GB "
                  f"in {work} ({fstype(work)})")
        synth_checkpoint(work / "ckpt", layers, experts)
        os.sync()                     # its writeback must not compete with the timed I/O below
        rows = {}
        t = plain_write(work / "plain.bin", nbytes)
        rows["plain O_DIRECT sequential write (1 thread, 32 MiB)"] = nbytes / t / 1e9
        pack = pack_store(work / "ckpt", work / "store", readers=readers)
        rows["pack-store write (read ckpt + pack + sha256 + O_DIRECT write)"] = pack.write_gbps
        rows["pack-store verifying re-read (O_DIRECT + sha256)"] = pack.verify_gbps
        t = plain_read(work / "plain.bin", nbytes)
        rows["plain O_DIRECT sequential read (1 thread, 32 MiB)"] = nbytes / t / 1e9
        v = verify_store(work / "store", readers=readers)
        assert not v.bad
        rows["verify-store (O_DIRECT + sha256)"] = v.gbps
        rows["sha256 in memory, one core (CPU bound per reader)"] = sha256_rate()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    table = Table(title=f"store I/O, {nbytes / 1e9:.2f} GB, {fstype(base)} on {platform.node()}, "
                        f"{os.cpu_count()} CPUs (load {load0:.1f}), {readers or default_readers()} verify readers")
    table.add_column("what")
    table.add_column("GB/s", justify="right")
    for k, v in rows.items():
        table.add_row(k, f"{v:.2f}")
    Console().print(table)
    result = {"date": date.today().isoformat(), "bytes": nbytes, "record_bytes": RECORD, "records": layers * experts,
              "fstype": fstype(base), "cpus": os.cpu_count(), "kernel": platform.release(),
              "readers": readers or default_readers(), "gbps": rows,
              "loadavg_1m_before_after": [load0, os.getloadavg()[0]],
              "notes": "checkpoint read from the page cache during pack (just written); store and plain I/O are O_DIRECT"}
    path = Path(out or Path(__file__).parent / "results" / f"{date.today().isoformat()}-cpu-store.json")
    write_result(path, result)
    Console(stderr=True).print(f"wrote {path}")


if __name__ == "__main__":
    bench()
