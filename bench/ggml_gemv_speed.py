"""Per-type speed of the one-token GEMVs a GGUF served on the CPU runs (issue 29's CPU target): the engine's two
modes side by side, and optionally an earlier tree's float kernel.

  float  x kept in fp32 (native_cpu.cpp's gemv512_row: gguf's dequantization then a float matmul, another
         summation order): the default, `--cpu-activations float`
  int8   x rounded to 8 bits as llama.cpp rounds it for the type (Q8_0/Q8_1 per 32, Q8_K per 256 for the K-quants),
         integer dot products (the "int8 activations" region, llama.cpp's way):
         `--cpu-activations int8`; its relative difference from the float result is reported beside it
  before --before REV: REV's native_cpu.cpp built with the engine's flags, its float kernel (what a change bought),
         and before_int8, REV's int8 mode

The types (--types demo, the default) are those a Q4_K_M of the demo holds (hidden 576 is no multiple of 256, so
the K-quants fall back), each at the row length it has there. Each figure: GB/s of weight bytes read, the best of `reps` calls in each of 5 rounds
that alternate the sides (robust to a loaded host; the host load is recorded), on 1 and 2 threads, a matrix that
stays in L2 and one of ~96 MB (DRAM). --types all: every quantized type Kiln reads, rows of 2,048 inputs. --rows M:
a prefill's GEMM of M rows of x instead, in G multiply-adds a second (the *_gbps columns then hold GMAC/s).

    python -m bench.ggml_gemv_speed --before 62c78c0 --out bench/results/<date>-ggml-gemv-speed.json
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

# The types a Q4_K_M of the demo holds, with the row length each has there: q|k|v, o and the experts' gate|up read
# 576 inputs, the experts' downs 1,536; Q4_1 is the demo's own file.
TYPES = [("q4_1", 576), ("q5_0", 576), ("q5_1", 576), ("q8_0", 576), ("q4_k", 1536), ("q6_k", 1536)]
# --types all: every quantized type Kiln reads, at a row of 2,048 inputs (Qwen3-30B-A3B's hidden size)
ALL_TYPES = [(name, 2048) for name in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
                                       "iq4_nl", "iq4_xs")]
SIZES = {"L2": 384 << 10, "DRAM": 96 << 20}
ROUNDS = 5


def best(fn, reps: int) -> float:
    out = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def build_before(rev: str, where: Path) -> ctypes.CDLL:
    """REV's native_cpu.cpp, built as engine.kernels.native builds this tree's."""
    from engine.kernels import native
    src, so = where / "before.cpp", where / "before.so"
    src.write_bytes(subprocess.run(["git", "show", f"{rev}:engine/kernels/native_cpu.cpp"], cwd=harness.REPO,
                                   check=True, capture_output=True).stdout)
    subprocess.run([native.compiler(), *native.FLAGS, *native.ARCH, str(src), "-o", str(so)], check=True)
    lib = ctypes.PyDLL(str(so))
    lib.ggml_matmul.argtypes = native.SIGNATURES["ggml_matmul"]
    return lib


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--before", default=None, help="a git revision whose kernels (both modes) are timed beside this tree's")
    ap.add_argument("--types", choices=("demo", "all"), default="demo",
                    help="demo: the types a Q4_K_M of the demo holds, at its row lengths; all: every quantized type")
    ap.add_argument("--rows", type=int, default=1,
                    help="rows of x a call multiplies: 1, the one-token GEMV (GB/s of weights); more, a prefill's "
                         "GEMM (G multiply-adds a second)")
    ap.add_argument("--where", choices=("both", *SIZES), default="both",
                    help="the matrix sizes timed (L2: ~384 KB, DRAM: ~96 MB); a GEMM of many rows on DRAM's takes long")
    ap.add_argument("--reps-l2", type=int, default=60)
    ap.add_argument("--reps-dram", type=int, default=4)
    args = ap.parse_args(argv)
    from engine.kernels import native
    from engine.quant import ggml
    from tests.engine.test_ggml_types import random_blocks        # random blocks with the types' edge cases
    lib = native.lib()
    gen = torch.Generator().manual_seed(0)
    rows, load_before = [], harness.host_load()
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"float": (lib, 0), "int8": (lib, 1)}
        if args.before:
            old = build_before(args.before, Path(tmp))
            sides = {"before": (old, 0), "before_int8": (old, 1), **sides}
        for threads in (1, 2):
            for name, k in (ALL_TYPES if args.types == "all" else TYPES):
                t = ggml.ggml_type(name)
                for where, target in SIZES.items():
                    if args.where not in ("both", where):
                        continue
                    n = max(64, target // (k // t.block * t.size) // 64 * 64)
                    w = random_blocks(name, 64, k, gen).repeat(n // 64, 1).contiguous()
                    x, y = torch.randn(args.rows, k, generator=gen), torch.empty(args.rows, n)
                    reps = args.reps_l2 if where == "L2" else args.reps_dram
                    got: dict[str, float] = {}
                    for _ in range(ROUNDS):
                        for side, (so, q8) in sides.items():
                            so.set_int8_activations(q8)
                            s = best(lambda: so.ggml_matmul(t.code, x.data_ptr(), args.rows, k, w.data_ptr(), n,
                                                            y.data_ptr(), threads), reps)
                            got[side] = min(got.get(side, s), s)
                    outs = {}
                    for q8 in (0, 1):
                        lib.set_int8_activations(q8)
                        outs[q8] = native.ggml_matmul(t.code, x, w, n).view(-1)
                    lib.set_int8_activations(0)
                    # GB/s of weights (one row), or G multiply-adds a second (a GEMM's rows)
                    work = w.numel() if args.rows == 1 else args.rows * n * k
                    gbps = {side: round(work / s / 1e9, 2) for side, s in got.items()}
                    row = {"type": name, "in": k, "rows": n, "x_rows": args.rows, "unit": "GB/s" if args.rows == 1 else "GMAC/s",
                           "where": where, "MB": round(w.numel() / 2 ** 20, 2),
                           "threads": threads, **{f"{side}_gbps": v for side, v in gbps.items()},
                           "int8_over_float": round(gbps["int8"] / gbps["float"], 2),
                           "int8_rel_diff": float((outs[1] - outs[0]).norm() / outs[0].norm())}
                    if args.before:
                        row["float_over_before"] = round(gbps["float"] / gbps["before"], 2)
                        row["int8_over_before_int8"] = round(gbps["int8"] / gbps["before_int8"], 2)
                    harness.log(row)
                    rows.append(row)
    cols = ["type", "where", "threads", *(f"{s}_gbps" for s in sides), "int8_over_float",
            *(["float_over_before", "int8_over_before_int8"] if args.before else []), "int8_rel_diff"]
    table = harness.table(rows, cols)
    print(table)
    harness.write_result(Path(args.out), {"what": __doc__.splitlines()[0], "before": args.before,
                                          "host_before": load_before, "host_after": harness.host_load(),
                                          "rows": rows, "table": table})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
