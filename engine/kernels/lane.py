"""The CPU expert lane's native kernel (native_cpu.cpp's CPU EXPERT LANE region), called through ctypes.CDLL so the
GIL is released for the whole call: the serving thread launches the GPU's kernels while the lane computes.

moe(): all of one MoE layer's CPU-lane picks for a step's tokens in ONE call — the picks' experts, and each
expert's rows, split over a team of threads pinned to the lane's CPUs — for 4-bit records of either order:
  cols (QuantLayout.cpu_int4, the CPU's stores): each pick bitwise engine.kernels.native.int4_ffn;
  rows (scheme int4, the GPU kernels' form a CUDA machine's RAM tier holds): the same function (x and the GEMV
      outputs rounded to bf16, fp32 accumulation), computed from the rows form, the same bits on any thread count;
and for a GGUF's ggml: records (each matrix in its own type, QuantLayout.mixed): each pick bitwise
engine.kernels.native.ggml_ffn (x in fp32, or rounded to 8 bits in the --cpu-activations int8 mode).
The picks' sum per token is moe_forward's one-token sum (y·w, then + y'·w' ...) in the order given, in fp32.

Why: the lane used to compute a CUDA machine's int4 records by dequantizing each to fp32 and multiplying in torch
(quant_ffn's fallback for the rows order), one expert at a time: 0.29 GB/s on the H200's host (issue 32).
bench/cpu_lane.py measures this kernel beside the host's DRAM read rate (read_bandwidth, the same team).

supports() says which layouts it takes; None from lib() (no compiler, not x86-64) keeps the caller on moe_forward.
"""
from __future__ import annotations

import ctypes
import functools
import os
import time

import torch

from engine.kernels import native
from engine.quant import ggml
from engine.quant.records import FOUR_BIT, group_size

_P, _I = ctypes.c_void_p, ctypes.c_int
SIGNATURES = {
    "lane_int4_moe": ([_P, _I, _I, _I, _I, _I, _P, _I, _P, _P, _P, _P, _I, _P, _I, ctypes.c_float], _I),
    "lane_ggml_moe": ([_P, _I, _I, _I, _P, _I, _P, _P, _P, _P, _I, _P, _I, ctypes.c_float], _I),
    "lane_read": ([_P, ctypes.c_int64, _I, _P, _I], ctypes.c_uint64),
    "lane_isa": ([], _I),
}
ISA = {0: "scalar", 1: "avx2+fma", 2: "avx512f", 3: "avx512f+bf16"}
GGML = 2              # offsets()' order code for ggml: records (lane_ggml_moe); 0 rows, 1 cols (lane_int4_moe)


@functools.cache
def lib() -> ctypes.CDLL | None:
    """The native kernels' .so (engine.kernels.native builds it) opened with ctypes.CDLL, whose calls release the
    GIL; None where native.lib() is None."""
    if native.lib() is None:
        return None
    return load(native.build(native.compiler()))


def load(path) -> ctypes.CDLL:
    so = ctypes.CDLL(str(path))
    for name, (args, res) in SIGNATURES.items():
        fn = getattr(so, name)
        fn.argtypes, fn.restype = args, res
    return so


def isa(so: ctypes.CDLL | None = None) -> str | None:
    """The instruction set the lane's kernels were built for (native.py's -march=native: what /proc/cpuinfo has)."""
    so = so or lib()
    return ISA[so.lane_isa()] if so is not None else None


def offsets(quant) -> tuple[int, int] | None:
    """(order code, byte offsets) of a QuantLayout's records the kernel reads, or None where it takes none of them:
    cols 4-bit (gate|up codes, scales, down codes, scales), rows int4 (gate, up, down: codes, scales each), or
    GGML (order GGML: gate, up, down, whose types the records' headers name; every type one the kernels have)."""
    if quant is not None and quant.mixed:
        if not all(native.ggml_supported(ggml.ggml_type(t).code) for t in quant.capacity):
            return None
        return GGML, tuple(r[0] for r in quant.regions.values())
    if quant is None or group_size(quant.hidden, quant.scheme) != 32 \
            or group_size(quant.intermediate, quant.scheme) != 32:
        return None
    regs = quant.regions
    if quant.cpu_int4 and quant.scheme in FOUR_BIT:
        return 1, tuple(native.ffn_offsets(regs))
    if quant.order == "rows" and quant.scheme == "int4":
        out = []
        for name in ("gate", "up", "down"):
            off, _, o, k = regs[name]
            out += [off, off + o * k // 2]
        return 0, tuple(out)
    return None


def supports(layout) -> bool:
    """The lane kernel computes this ExpertLayout's records (and is built here)."""
    return offsets(layout.quantized) is not None and lib() is not None


class Team:
    """The lane's threads: how many, and the CPUs each is pinned to (thread i on cpus[i % len]; none: unpinned)."""

    def __init__(self, threads: int, cpus: list[int] | None = None):
        self.threads = max(1, threads)
        self.cpus = sorted(cpus) if cpus else []
        self._cpus = (ctypes.c_int * max(1, len(self.cpus)))(*self.cpus)

    @classmethod
    def for_cpus(cls, cpus: set[int] | None) -> "Team":
        """One thread per lane CPU where the lane is pinned; else torch's thread count, unpinned."""
        return cls(len(cpus), sorted(cpus)) if cpus else cls(torch.get_num_threads())


def moe(x: torch.Tensor, tokens: list[int], records: list[int], weights: list[float], quant, team: Team,
        so: ctypes.CDLL | None = None, limit: float | None = None) -> torch.Tensor:
    """x [T, H] (any float dtype; read as fp32) and n picks — tokens[p], the host address of its record records[p],
    its router weight weights[p] — → fp32 [T, H]: Σ_p weights[p]·FFN(records[p], x[tokens[p]]) per token, in the
    picks' order (moe_forward's order: experts ascending). The caller keeps the records resident for the call.
    limit: the SwiGLU limit (glm5_next's swiglu_limit; None: none), as int4_ffn and moe_forward take it."""
    so = so or lib()
    order, offs = offsets(quant)
    xf = x.float().contiguous()
    t, h = xf.shape
    n = len(tokens)
    out = torch.empty(t, h)
    tok = (ctypes.c_int32 * max(1, n))(*tokens)
    recs = (ctypes.c_uint64 * max(1, n))(*records)
    w = (ctypes.c_float * max(1, n))(*weights)
    off = (ctypes.c_int64 * 6)(*offs, *([0] * (6 - len(offs))))
    if order == GGML:
        rc = so.lane_ggml_moe(xf.data_ptr(), t, h, quant.intermediate, off, n, tok, recs, w, out.data_ptr(),
                              team.threads, team._cpus, len(team.cpus), native._limit(limit))
        if rc:
            raise ValueError(f"lane_ggml_moe refused the records (hidden {h}, intermediate {quant.intermediate}, "
                             f"types {quant.capacity})")
        return out
    rc = so.lane_int4_moe(xf.data_ptr(), t, h, quant.intermediate, 32, order, off, n, tok, recs, w, out.data_ptr(),
                          team.threads, team._cpus, len(team.cpus), native._limit(limit))
    if rc:
        raise ValueError(f"lane_int4_moe refused the shapes (hidden {h}, intermediate {quant.intermediate}, "
                         f"{quant.scheme} {quant.order})")
    return out


def read_bandwidth(nbytes: int, team: Team, reps: int = 5, so: ctypes.CDLL | None = None) -> dict:
    """The host's DRAM read rate on `team`: a buffer of nbytes (≫ the last-level cache) written once, then
    streamed `reps` times → {"gbps": the median rep's rate, "reps": each rep's GB/s}."""
    so = so or lib()
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(1)                       # touch every page: the reads then measure DRAM, not page faults
    so.lane_read(buf.data_ptr(), nbytes, team.threads, team._cpus, len(team.cpus))
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        so.lane_read(buf.data_ptr(), nbytes, team.threads, team._cpus, len(team.cpus))
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return {"gbps": sorted(rates)[len(rates) // 2], "reps": [round(r, 3) for r in rates]}


def llc_bytes() -> int | None:
    """The largest CPU cache's size (sysfs), or None where it cannot be read."""
    best = None
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for d in os.listdir(base):
            try:
                s = open(f"{base}/{d}/size").read().strip()
            except OSError:
                continue
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
            v = int(s.rstrip("KMG")) * mult
            best = max(best or 0, v)
    except OSError:
        return None
    return best
