"""How fast a GPU reads expert records in place from page-locked host memory (zero-copy decode's RAM-tier reads),
beside the copy engine and HBM, on one GPU: what bounds an offloaded decode step (issue 32).

  python -m bench.pcie_reads --out bench/results/<date>-pcie-reads.json

Records: int4, Qwen3-30B-A3B's expert shape (hidden 2048, FFN 768). A "token" is 8 layers x 8 picks of distinct
records, each layer one call of the int4 decode GEMV kernels (engine.kernels.quant_triton.quant_slot_moe) with a
record table pointing at the host memory, as zero-copy decode's is. Rows:
- memory: where the records lie: the engine's RAM arena (engine.tiers.ram.RamArena: an anonymous mapping
  registered with cudaHostRegister), the same mapping advised to huge pages before it is registered, torch's
  page-locked allocation (cudaHostAlloc), and GPU slots (HBM);
- tiles: (block_i, block_h, warps, max_span) of the GEMVs; the engine's are the first;
- plain read: a kernel that only copies the records' bytes (no arithmetic), and the copy engine (cudaMemcpyAsync of
  the same records into GPU slots).
GB/s = record bytes read / time, medians of --iters tokens (CUDA events).
"""
from __future__ import annotations

import argparse
import mmap
import statistics
import time
from pathlib import Path

import torch

from bench.harness import machine, table, write_result

H, I, K, LAYERS = 2048, 768, 8, 8
TILES = [(8, 32, 2, 64), (8, 32, 4, 64), (16, 64, 8, 64), (8, 32, 4, 16), (8, 32, 2, 16), (8, 32, 8, 16),
         (4, 16, 4, 16), (16, 64, 4, 16), (8, 32, 4, 8), (8, 64, 4, 16), (4, 32, 4, 16), (8, 32, 4, 32)]


def _timed(fn, iters: int) -> float:
    """Median seconds of fn(i) over `iters` calls (CUDA events: bench.quant_gpu_kernels.timed)."""
    from bench.quant_gpu_kernels import timed
    return statistics.median(timed(fn, iters)) * 1e-6


def _huge_arena(n: int, rec: int):
    """n records in an anonymous mapping advised to transparent huge pages, touched, then registered: → (the mapping,
    its bytes as a tensor, the device address of its start)."""
    from engine.tiers.ram import _device_pointer
    mm = mmap.mmap(-1, n * rec, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    t.fill_(0)
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), n * rec, 0)
    assert int(rc) == 0, f"cudaHostRegister failed ({int(rc)})"
    return mm, t, _device_pointer(t.data_ptr())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--records", type=int, default=512, help="records in each memory (more than the tokens' reads)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--all-memories", action="store_true", help="also huge pages and cudaHostAlloc (no faster on the "
                    "H200: 2026-12-06-h200-pcie-reads.json)")
    a = ap.parse_args(argv)
    from bench.quant_gpu_kernels import random_records
    from engine.kernels.quant_triton import quant_slot_moe
    from engine.kernels.triton_moe import read_record
    from engine.quant.records import QuantLayout
    from engine.tiers.ram import RamArena

    dev = torch.device("cuda")
    lay = QuantLayout(H, I, "int4", "rows")
    rec, n = lay.record_bytes, a.records
    src = random_records(lay, n, dev)                     # valid codes and scales: finite arithmetic
    slots = torch.empty(n, rec, dtype=torch.uint8, device=dev)
    slots.copy_(src)
    memories = {}
    arena = RamArena(n, rec, pin_cuda=True)
    arena.bytes.view(n, rec).copy_(src.cpu())
    memories["RamArena (mmap + cudaHostRegister)"] = (arena.bytes.view(n, rec), arena.device_address(0))
    mm = None
    if a.all_memories:
        mm, huge, huge_dev = _huge_arena(n, rec)
        huge.view(n, rec).copy_(src.cpu())
        memories["mmap, MADV_HUGEPAGE, registered"] = (huge.view(n, rec), huge_dev)
        pinned = torch.empty(n, rec, dtype=torch.uint8, pin_memory=True)
        pinned.copy_(src.cpu())
        memories["torch pin_memory (cudaHostAlloc)"] = (pinned, pinned.data_ptr())
    memories["GPU slots (HBM)"] = (slots, slots.data_ptr())

    g = torch.Generator().manual_seed(0)
    picks = [torch.randperm(n, generator=g)[:LAYERS * K].view(LAYERS, K) for _ in range(a.iters)]
    x = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    w = torch.softmax(torch.randn(1, K, device=dev), -1).to(torch.bfloat16)
    moved = LAYERS * K * rec
    rows = []
    base = slots.data_ptr()
    for name, (mem, addr) in memories.items():
        # The table: each record's byte offset from the GPU slots' start, where the kernels read it.
        table_t = torch.tensor([addr - base + j * rec for j in range(n)], dtype=torch.int64, device=dev)
        ids = [p.to(dev) for p in picks]
        ref = None
        for bi, bh, warps, span in TILES:
            def token(i, bi=bi, bh=bh, warps=warps, span=span):
                for l in range(LAYERS):
                    quant_slot_moe(x, slots, ids[i][l][None], w, lay, block_i=bi, block_h=bh, table=table_t,
                                   max_span=span, warps=warps)
            token(0)
            out = quant_slot_moe(x, slots, ids[0][0][None], w, lay, table=table_t).float()
            if ref is None:
                ref = out
            same = bool(torch.allclose(out, ref, rtol=1e-2, atol=1e-3))
            t = _timed(token, a.iters)
            rows.append({"memory": name, "reader": "int4 GEMVs", "tiles": f"{bi}/{bh}/{warps}w/{span}",
                         "us_per_token": round(t * 1e6, 1), "gbps": round(moved / t / 1e9, 1), "same_output": same})
        if addr != base:
            # The bytes alone, by a kernel: read_record's 1,024-byte programs; then the copy engine.
            def plain(i):
                for j in picks[i].reshape(-1).tolist():
                    read_record(slots, addr - base + j * rec, rec)
            plain(0)
            t = _timed(plain, a.iters)
            rows.append({"memory": name, "reader": "read kernel (bytes only)", "tiles": "1024 B a program",
                         "us_per_token": round(t * 1e6, 1), "gbps": round(moved / t / 1e9, 1)})
            dst = torch.empty(LAYERS * K, rec, dtype=torch.uint8, device=dev)

            def copies(i):
                for d, j in enumerate(picks[i].reshape(-1).tolist()):
                    dst[d].copy_(mem[j], non_blocking=True)
            copies(0)
            t = _timed(copies, a.iters)
            rows.append({"memory": name, "reader": "copy engine (cudaMemcpyAsync a record)", "tiles": "",
                         "us_per_token": round(t * 1e6, 1), "gbps": round(moved / t / 1e9, 1)})
        torch.cuda.synchronize()
    cols = ["memory", "reader", "tiles", "us_per_token", "gbps", "same_output"]
    text = table(rows, cols)
    write_result(a.out, {"bench": "pcie_reads", "what": __doc__.strip().splitlines()[0],
                         "device": torch.cuda.get_device_name(dev), "machine": machine(),
                         "shape": {"hidden": H, "intermediate": I, "picks_per_layer": K, "layers": LAYERS,
                                   "record_bytes": rec, "bytes_per_token": moved},
                         "iters": a.iters, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         "rows": rows, "table": text})
    del mm
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
