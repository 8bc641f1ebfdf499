"""Per-type speed of the one-token GEMVs a GGUF served on the CPU runs (issue 29's CPU target), against llama.cpp's
way of computing them.

Kiln computes a GGUF's blocks with x kept in fp32 (engine.kernels.native.ggml_matmul, one row: native_cpu.cpp's
gemv512_row; the vocabulary's Q8_0 as int8 codes and fp32 scales: q8_gemv), so its outputs are gguf's dequantization
then a float matmul, another summation order apart. llama.cpp quantizes x once to Q8_0/Q8_K and takes integer dot
products (VNNI where the CPU has it). bench/ggml_gemv_int8.cpp is a prototype of that for Q5_0, Q8_0 and Q4_K (x as
Q8_0 per 32, vpdpbusd): what an integer path would buy per type, and what it costs in exactness (its outputs' relative
error against Kiln's). Each figure: GB/s of weight bytes read, one thread, the best of `reps` calls (robust to a loaded
host; the host load is recorded), a matrix that stays in L2 (compute) and one of ~96 MB (DRAM).

    python -m bench.ggml_gemv_speed --out bench/results/<date>-ggml-gemv-speed.json
"""
from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench import harness

HERE = Path(__file__).parent
# The types a Q4_K_M of the demo holds (hidden 576 is no multiple of 256: the K-quants fall back), with the row
# length each has there: q|k|v, o and the experts' gate|up read 576 inputs, the experts' downs 1,536.
TYPES = [("q5_0", 576), ("q5_1", 576), ("q8_0", 576), ("q4_k", 1536), ("q6_k", 1536)]
PROTOTYPED = {"q5_0", "q8_0", "q4_k"}
SIZES = {"L2": 384 << 10, "DRAM": 96 << 20}


def best(fn, reps: int) -> float:
    out = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def build_prototype(where: Path) -> ctypes.CDLL:
    so = where / "ggml_gemv_int8.so"
    subprocess.run(["g++", "-O3", "-march=native", "-shared", "-fPIC", "-std=c++17", str(HERE / "ggml_gemv_int8.cpp"),
                    "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.quant_x.argtypes = [p, i, p, p, p, p]
    lib.int_gemv.argtypes = [i, p, i, i, p, p, p, p, p]
    return lib


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps-l2", type=int, default=300)
    ap.add_argument("--reps-dram", type=int, default=10)
    args = ap.parse_args(argv)
    from engine.kernels import native
    from engine.quant import ggml
    from tests.engine.test_ggml_types import random_blocks        # random blocks with the types' edge cases
    torch.set_num_threads(1)
    lib = native.lib()
    gen = torch.Generator().manual_seed(0)
    rows, load_before = [], harness.host_load()
    with tempfile.TemporaryDirectory() as tmp:
        proto = build_prototype(Path(tmp))
        for name, k in TYPES:
            t = ggml.ggml_type(name)
            row_bytes = k // t.block * t.size
            for where, target in SIZES.items():
                n = max(64, target // row_bytes // 64 * 64)
                w = random_blocks(name, 64, k, gen).repeat(n // 64, 1).contiguous()
                x, y = torch.randn(k, generator=gen), torch.empty(n)
                reps = args.reps_l2 if where == "L2" else args.reps_dram
                s = best(lambda: lib.ggml_matmul(t.code, x.data_ptr(), 1, k, w.data_ptr(), n, y.data_ptr(), 1), reps)
                row = {"type": name, "in": k, "rows": n, "where": where, "MB": round(w.numel() / 2 ** 20, 2),
                       "kiln_float_gbps": round(w.numel() / s / 1e9, 2)}
                if name == "q8_0":            # the vocabulary's form (Q8Projection): int8 codes, fp32 scales
                    q8 = w.view(-1, 34)
                    q = q8[:, 2:].contiguous().view(torch.int8).view(n, k)
                    d = q8[:, :2].contiguous().view(torch.float16).float().view(n, k // 32)
                    s8 = best(lambda: lib.q8_gemv(x.data_ptr(), k, q.data_ptr(), d.data_ptr(), n, y.data_ptr(), 1), reps)
                    row["kiln_q8_gemv_gbps"] = round((q.numel() + 4 * d.numel()) / s8 / 1e9, 2)
                if name in PROTOTYPED:
                    qx, dx = torch.empty(k, dtype=torch.int8), torch.empty(k // 32)
                    sq, sx, y2 = torch.empty(k // 32, dtype=torch.int32), torch.empty(k // 32), torch.empty(n)

                    def integer():
                        proto.quant_x(x.data_ptr(), k, qx.data_ptr(), dx.data_ptr(), sq.data_ptr(), sx.data_ptr())
                        proto.int_gemv(t.code, w.data_ptr(), n, k, qx.data_ptr(), dx.data_ptr(), sq.data_ptr(),
                                       sx.data_ptr(), y2.data_ptr())
                    si = best(integer, reps)
                    lib.ggml_matmul(t.code, x.data_ptr(), 1, k, w.data_ptr(), n, y.data_ptr(), 1)
                    row.update(int8_dot_gbps=round(w.numel() / si / 1e9, 2), int8_over_float=round(s / si, 2),
                               int8_rel_err=float((y2 - y).norm() / y.norm()))
                harness.log(row)
                rows.append(row)
    harness.write_result(Path(args.out), {"threads": 1, "host_before": load_before, "host_after": harness.host_load(),
                                          "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
