"""The engine's own CPU kernels (native_cpu.cpp beside this file): built once per machine with the system's g++
(-O3 -march=native -fopenmp) into a cache directory keyed by the source's hash, and called through ctypes.

ggml_matmul / ggml_ffn: matrices in any GGML type a GGUF file holds (engine.quant.ggml), blocks as the file has them.

Why: a one-token decode step on the CPU is GEMVs over 4-bit and 8-bit weights, and torch has no fast CPU
kernel for the 8-bit one (the tied vocabulary) and a slower one than this for the 4-bit one at one token
(bench/results/native_cpu_kernels.json). The .so links libgomp.so.1, which resolves to the libgomp torch has
already loaded, so these kernels share torch's OpenMP threads instead of starting a second team.

`lib()` is None where no compiler or no x86-64 is found or the build fails (logged once): callers then keep
torch's kernels. Whether a model uses them is one switch, EngineConfig.native_kernels (`--no-native-kernels`);
KILN_NATIVE_CACHE names the cache directory (default $CACHE_DIRECTORY/native under systemd, else
$XDG_CACHE_HOME/kiln/native or ~/.cache/kiln/native, else a temp one).
"""
from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from engine.quant import ggml
from engine.quant.records import int4pack_operands, to_int4pack

log = logging.getLogger("engine.kernels")

SOURCE = Path(__file__).with_name("native_cpu.cpp")
# -ffp-contract=off: the elementwise parts round as torch's eager ops do (the GEMVs' FMAs are written out).
FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC", "-std=c++17"]
ARCH = ["-march=native"]         # the instruction set; tests build the other paths with e.g. -mno-avx512f
_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "int4pack_gemv": [_P, _I, _P, _P, _I, _I, _P, _I],
    "int4_ffn": [_P, _I, _I, _P, _P, _P, _P, _I, _P, _P, _P, _I, _F],
    "q8_gemv": [_P, _I, _P, _P, _I, _P, _I],
    "add_rms_norm": [_P, _P, _P, _F, _I, _P],
    "attn_decode": [_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _P, _P, _I],
    "attn_block": [_P, _P, _I, _P, _P, _I, _P, _P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _P, _P, _F, _P,
                   _P, _P, _P, _I],
    "router_topk": [_P, _I, _P, _I, _I, _I, _P, _P],
    "ggml_supported": [_I],
    "ggml_matmul": [_I, _P, _I, _I, _P, _I, _P, _I],
    "ggml_ffn": [_P, _I, _I, _P, _I, _P, _I, _P, _I, _P, _P, _I, _F],
    "ggml_gemv_stack": [_P, _I, _I, _P, _P, _P, _P, _I],
    "moe_tail": [_P, _I, _P, _P, _P, _I, _I, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, _I, _P,
                 _P, _P, _F, _P, _I, _F],
    "ggml_moe_tail": [_P, _I, _P, _P, _P, _I, _I, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, _P, _P, _P, _F, _P,
                      _I, _F],
    "ggml_attn_block": [_P, _P, _I, _P, _P, _P, _I, _P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _P, _P, _F,
                        _P, _P, _P, _P, _I],
    # exact prefill rows (issue 32): many rows, each as the one-row kernel computes it
    "q8_gemv_rows": [_P, _I, _I, _P, _P, _I, _P, _I],
    "attn_rows": [_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F, _P, _I],
    "add_rms_norm_rows": [_P, _P, _P, _F, _I, _I, _P],
    "attn_block_rows": [_P, _P, _I, _I, _P, _P, _I, _P, _P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _P, _F,
                        _P, _I],
    "router_topk_rows": [_P, _I, _I, _P, _I, _I, _I, _P, _P],
    "int4_ffn_rows": [_P, _I, _I, _I, _P, _P, _P, _P, _I, _P, _I, _F],
    "moe_sum_rows": [_P, _I, _I, _P, _P, _I, _P, _P, _F, _P],
    "decode_layers": [_P, _P, _P, _I, _I, _P, _P, _I, _I, _P, _P, _P, _P, _P, _P, _I],
    "moe_rows": [_P, _I, _I, _P, _P, _P, _I, _I, _I, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                 _I, _P, _P, _F, _P, _I, _F],
    "exact_attend_fast": [_I],
    "attn_decode_direct_ok": [_I],
    "attn_decode_direct": [_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _P, _P, _I],
    "exact_expf_mismatches": [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32],
    "set_int8_activations": [_I],
    "int8_activations": [],
    "q8_quantize": [_P, _I, _I, _P, _P, _P],
}
ROWS = ("q8_gemv_rows", "attn_rows", "add_rms_norm_rows", "attn_block_rows", "router_topk_rows", "int4_ffn_rows",
        "moe_sum_rows", "moe_rows")
MAX_TOP_K = 64        # experts a moe_tail call computes (its bookkeeping array)


MAX_K = 8192          # inputs an int4 GEMV takes (native_cpu.cpp's stack buffers): wider ones stay on torch's kernel


# How a model's EngineConfig.native_kernels reaches the one-token int4 GEMVs (engine.kernels.quant_cpu) it calls
# through its dense weights and its expert provider: the model sets it around its own forward passes, so a model
# loaded with the knob off runs torch's kernels only. Not a switch of its own: nothing else sets it.
_allowed = contextvars.ContextVar("kiln_native_allowed", default=True)


def allowed() -> bool:
    return _allowed.get()


@contextlib.contextmanager
def allow(on: bool, int8_activations: bool = False):
    """A model's passes: native kernels on or off, and whether its GGUF GEMVs round x to 8 bits
    (EngineConfig.cpu_activations "int8"; the library's process-wide mode, set here for the pass and put back
    after it: one engine process serves one model, and a float model's passes run with it off)."""
    token = _allowed.set(on)
    so = lib() if on else None
    before = so.int8_activations() if so is not None else 0
    if so is not None and before != int(int8_activations):
        so.set_int8_activations(int(int8_activations))
    try:
        yield
    finally:
        _allowed.reset(token)
        if so is not None and so.int8_activations() != before:
            so.set_int8_activations(before)


def cache_dir() -> Path:
    """$KILN_NATIVE_CACHE, else systemd's $CACHE_DIRECTORY (the serve units' CacheDirectory=: their home is
    protected), else the user's cache directory, else one under the system's temp directory."""
    if d := os.environ.get("KILN_NATIVE_CACHE"):
        return Path(d)
    if d := os.environ.get("CACHE_DIRECTORY"):
        return Path(d.split(":")[0]) / "native"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    d = Path(base) / "kiln" / "native"
    try:
        d.mkdir(parents=True, exist_ok=True)
        if os.access(d, os.W_OK):
            return d
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"kiln-native-{os.getuid()}"


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def build(cxx: str, arch: list[str] = ARCH) -> Path:
    """The .so for this source, compiler and flags (built into a temp file, renamed into place)."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    flags = [*FLAGS, *arch]
    key = hashlib.sha256(SOURCE.read_bytes() + repr((version, flags, platform.node())).encode()).hexdigest()[:16]
    out = cache_dir() / f"native_cpu-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cxx, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{cxx} failed: {r.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def lib() -> ctypes.CDLL | None:
    """The loaded kernels, or None (see the module docstring)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    cxx = compiler()
    if cxx is None:
        log.warning("native CPU kernels: no C++ compiler (g++) found; using torch's kernels")
        return None
    try:
        return load(build(cxx))
    except (OSError, RuntimeError) as e:
        log.warning("native CPU kernels unavailable, using torch's: %s", e)
        return None


def load(path: Path) -> ctypes.CDLL:
    """A built .so with its functions' signatures. PyDLL: a call keeps the GIL (no Python runs inside), so the
    server's other threads do not take it at each of a step's ~100 calls and make the step wait for it back."""
    so = ctypes.PyDLL(str(path))
    for name, args in SIGNATURES.items():
        fn = getattr(so, name)
        fn.argtypes, fn.restype = args, None
    so.ggml_supported.restype = _I
    so.decode_layers.restype = _I
    so.exact_attend_fast.restype = _I
    so.attn_decode_direct_ok.restype = _I
    so.exact_expf_mismatches.restype = ctypes.c_int64
    so.int8_activations.restype = _I
    # The exact prefill's rows calls are few and long (a layer's rows each): they let the GIL go, so the server's
    # other threads (streaming, HTTP) run meanwhile.
    so.released = ctypes.CDLL(str(path))
    for name in ROWS:
        fn = getattr(so.released, name)
        fn.argtypes, fn.restype = SIGNATURES[name], None
    return so


@functools.cache
def int4_ok() -> bool:
    """The kernels are built and int4pack_gemv agrees with torch's int4 kernel on a random operand (to a bf16
    rounding: another summation order), so the tiling it reads is the one torch packs on this CPU."""
    if lib() is None:
        return False
    gen = torch.Generator().manual_seed(0)
    out, inp = 128, 256
    buf = to_int4pack(torch.randint(0, 16, (out, inp), generator=gen), torch.randn(out, inp // 32, 2, generator=gen))
    packed, sz = int4pack_operands(buf, out, inp, 32)
    x = torch.randn(inp, generator=gen)
    want = torch.ops.aten._weight_int4pack_mm_for_cpu(x.view(1, -1).to(torch.bfloat16), packed, 32, sz).float()
    if torch.allclose(int4pack_gemv(x, packed, sz, 32), want.view(-1), rtol=2 ** -7, atol=2 ** -7 * float(want.abs().max())):
        return True
    log.warning("native int4 GEMV disagrees with torch's int4 kernel here (another int4pack tiling?); using torch's")
    return False


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def int4pack_gemv(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, group: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """x fp32 [K] (contiguous) · W^T → fp32 [N]; W torch's int4pack operand (packed uint8 [N, K/2], sz bf16
    [K/g, N, 2], both contiguous): _weight_int4pack_mm_for_cpu's function for one row (bf16-rounded x and y)."""
    n, k = packed.shape[0], x.shape[-1]
    y = torch.empty(n, dtype=torch.float32) if out is None else out
    lib().int4pack_gemv(_ptr(x), k, _ptr(packed), _ptr(sz), n, group, _ptr(y), torch.get_num_threads())
    return y


def _limit(limit: float | None) -> float:
    """A swiglu limit as the kernels take it: 0.0 for none (None), which costs nothing there."""
    return float(limit) if limit else 0.0


def int4_ffn(x: torch.Tensor, rec: torch.Tensor, regions: dict, group: int, limit: float | None = None) -> torch.Tensor:
    """One expert on one token (engine.kernels.quant_cpu.quant_ffn's function): x fp32 [H] contiguous, rec a
    cols-order 4-bit record (uint8, contiguous), regions its QuantLayout.regions → y fp32 [H]. limit: gate/up
    clamped at it (engine.experts.reference.swiglu; None: none)."""
    h, i = regions["down"][2:]
    base = rec.data_ptr()
    gu, hid, y = torch.empty(2 * i), torch.empty(i), torch.empty(h)
    lib().int4_ffn(x.data_ptr(), h, i, *(base + off for off in ffn_offsets(regions)), group, gu.data_ptr(),
                   hid.data_ptr(), y.data_ptr(), torch.get_num_threads(), _limit(limit))
    return y


def ffn_offsets(regions: dict) -> tuple[int, int, int, int]:
    """A cols-order 4-bit record's byte offsets (QuantLayout.regions): gate|up codes, their scales, down codes,
    their scales — the int4pack operands int4_ffn and moe_tail read."""
    (gu_off, _, two_i, h), (d_off, _, _, i) = regions["gate_up"], regions["down"]
    return gu_off, gu_off + two_i * h // 2, d_off, d_off + h * i // 2


class MoETail:
    """The MoE half of a one-token native decode step after routing, for one layer's quantized records (cols
    order, 4-bit: QuantLayout.cpu_int4): the picked experts' int4_ffn in ascending expert order, their
    weighted sum as engine.tiers.waves.moe_forward sums one token, then add_rms_norm into the next norm — one call
    where the torch forms take an FFN call per expert, a multiply, an add and a norm call. Its buffers are
    its own (one decode step at a time, as the model's)."""

    rows = True            # exact prefill's rows (int4_ffn_rows) read this tail's records too

    def __init__(self, regions: dict, hidden: int, intermediate: int, group: int, top_k: int,
                 limit: float | None = None):
        assert top_k <= MAX_TOP_K and max(hidden, intermediate) <= MAX_K
        self.limit = _limit(limit)             # the experts' swiglu limit (0.0: none)
        self.offsets = ffn_offsets(regions)
        self.hidden, self.intermediate, self.group, self.top_k = hidden, intermediate, group, top_k
        self.ids = torch.empty(top_k, dtype=torch.int64)              # route()'s outputs, read by __call__
        self.weights = torch.empty(top_k)
        self.records = (ctypes.c_uint64 * top_k)()
        self.scratch = torch.empty(3 * intermediate + 2 * hidden)

    def route(self, h: torch.Tensor, gate: torch.Tensor, renormalize: bool) -> list[int]:
        """router_topk of h fp32 [H] (contiguous) into self.ids / self.weights → the picked experts."""
        lib().router_topk(h.data_ptr(), self.hidden, gate.data_ptr(), gate.shape[0], self.top_k, int(renormalize),
                          self.ids.data_ptr(), self.weights.data_ptr())
        return self.ids.tolist()

    def __call__(self, h: torch.Tensor, addresses: list[int], x: torch.Tensor, next_w: torch.Tensor,
                 eps: float) -> torch.Tensor:
        """h fp32 [H] (the experts' input), addresses the records of self.ids' experts (in their order),
        x the residual stream (x += the experts' sum, in place) → rms_norm(x)·next_w, a new tensor."""
        for j, a in enumerate(addresses):
            self.records[j] = a
        out = torch.empty_like(x)
        lib().moe_tail(h.data_ptr(), len(addresses), self.ids.data_ptr(), ctypes.addressof(self.records),
                       self.weights.data_ptr(), self.hidden, self.intermediate, *self.offsets, self.group,
                       self.scratch.data_ptr(), x.data_ptr(), next_w.data_ptr(), eps, out.data_ptr(),
                       torch.get_num_threads(), self.limit)
        return out


class GgmlTail(MoETail):
    """MoETail for a layer's ggml: records (a GGUF's experts, each matrix in its own GGML type, which the record's
    header names): the picked experts' ggml_ffn in ascending expert order, summed and normed as MoETail does, in
    one call. One token only: exact prefill's rows stay with the int4 tails (rows = False)."""

    rows = False

    def __init__(self, regions: dict, hidden: int, intermediate: int, top_k: int, limit: float | None = None):
        assert top_k <= MAX_TOP_K
        self.limit = _limit(limit)
        self.offsets = tuple(r[0] for r in regions.values())          # gate, up, down
        self.hidden, self.intermediate, self.top_k = hidden, intermediate, top_k
        self.ids = torch.empty(top_k, dtype=torch.int64)
        self.weights = torch.empty(top_k)
        self.records = (ctypes.c_uint64 * top_k)()
        self.scratch = torch.empty(3 * intermediate + 2 * hidden)

    def __call__(self, h: torch.Tensor, addresses: list[int], x: torch.Tensor, next_w: torch.Tensor,
                 eps: float) -> torch.Tensor:
        for j, a in enumerate(addresses):
            self.records[j] = a
        out = torch.empty_like(x)
        lib().ggml_moe_tail(h.data_ptr(), len(addresses), self.ids.data_ptr(), ctypes.addressof(self.records),
                            self.weights.data_ptr(), self.hidden, self.intermediate, *self.offsets,
                            self.scratch.data_ptr(), x.data_ptr(), next_w.data_ptr(), eps, out.data_ptr(),
                            torch.get_num_threads(), self.limit)
        return out


def add_rms_norm(x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x += r (in place; r None: no add), then rms_norm(x)·w as a new tensor; all fp32, contiguous, one row."""
    h = torch.empty_like(x)
    r = None if r is None else r.contiguous()
    lib().add_rms_norm(x.data_ptr(), None if r is None else r.data_ptr(), w.data_ptr(), eps, x.numel(), h.data_ptr())
    return h


def attn_decode(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, p: int,
                window: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                scores: torch.Tensor) -> torch.Tensor:
    """One token's attention (rotary, KV write at row p, attention over rows ..p): qkv fp32 [(nh + 2·nkv)·hd]
    (rotated in place), cos/sin [rot] of position p, kc/vc [max_len, nkv, hd] of this layer and slot, scores
    scratch of at least nh·(p + 1) floats → o fp32 [nh·hd]. Contiguous fp32 throughout."""
    o = torch.empty(num_heads * head_dim)
    lib().attn_decode(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), kc.data_ptr(), vc.data_ptr(), p, window,
                      num_heads, num_kv_heads, head_dim, cos.numel(), scale, scores.data_ptr(), o.data_ptr(),
                      torch.get_num_threads())
    return o


def attn_decode_direct(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                       p: int, window: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                       scores: torch.Tensor) -> torch.Tensor:
    """attn_decode's function and bits, its heads through attend_one_direct (AVX-512, head size 32/64/128, checked
    against attend_head at first use; else attn_decode itself): ~2x faster at 600-1000 keys. Not yet called by the
    decode step (AttnBlock, DecodeLayers): a candidate for it that changes no output."""
    o = torch.empty(num_heads * head_dim)
    lib().attn_decode_direct(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), kc.data_ptr(), vc.data_ptr(), p, window,
                             num_heads, num_kv_heads, head_dim, cos.numel(), scale, scores.data_ptr(), o.data_ptr(),
                             torch.get_num_threads())
    return o


class AttnBlock:
    """A decode layer's attention half on one token, in one call: qkv and o (engine.dense_weights.Int4Projection,
    one group size) around attn_decode, then x += o (in place) → rms_norm(x)·post_norm, a new tensor. What
    does not change from step to step (weights, shapes, scratch, each slot's KV rows) is resolved once: the
    call's Python is a decode step's glue 30 times over."""

    def __init__(self, qkv, o, k_cache: torch.Tensor, v_cache: torch.Tensor, *, window: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, scale: float, eps: float):
        self.hidden, nqkv, no = o.out_features, qkv.out_features, num_heads * head_dim
        self.nqkv = nqkv
        self.scratch = torch.empty(nqkv + no + self.hidden)
        buf = self.scratch.data_ptr()
        self.k_cache, self.v_cache = k_cache, v_cache             # [slots, max_len, nkv, hd] of this layer
        self.weights = (self.hidden, qkv.packed.data_ptr(), qkv.sz.data_ptr(), nqkv, o.packed.data_ptr(),
                        o.sz.data_ptr(), qkv.group)
        self.shape = (window, num_heads, num_kv_heads, head_dim)
        self.buffers = (buf, buf + 4 * nqkv, buf + 4 * (nqkv + no))
        self.scale, self.eps = scale, eps
        self._rows: dict[int, tuple[int, int]] = {}

    def __call__(self, x: torch.Tensor, h: torch.Tensor, slot: int, p: int, cos: torch.Tensor, sin: torch.Tensor,
                 scores: torch.Tensor, post_norm: torch.Tensor) -> torch.Tensor:
        """x, h fp32 [H] contiguous; the token at position p of KV slot `slot`, cos/sin its rotary rows; scores
        scratch of at least num_heads·(p + 1) floats."""
        rows = self._rows.get(slot)
        if rows is None:
            rows = self._rows[slot] = (self.k_cache[slot].data_ptr(), self.v_cache[slot].data_ptr())
        out = torch.empty_like(x)
        lib().attn_block(x.data_ptr(), h.data_ptr(), *self.weights, cos.data_ptr(), sin.data_ptr(), *rows, p,
                         *self.shape, cos.numel(), self.scale, scores.data_ptr(), post_norm.data_ptr(), self.eps,
                         *self.buffers, out.data_ptr(), torch.get_num_threads())
        return out


class GgmlAttnBlock(AttnBlock):
    """AttnBlock for a GGUF's own blocks of any types (engine.gguf_tensors.BlockProjection): q|k|v as one to three
    matrices of their own types (a Q4_K_M's Q5_0 q beside its Q8_0 k and v), o in its own, around attn_decode, in
    one call."""

    def __init__(self, parts: list, o, k_cache: torch.Tensor, v_cache: torch.Tensor, *, window: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, scale: float, eps: float):
        self.hidden, no = o.out_features, num_heads * head_dim
        nqkv = self.nqkv = sum(p.out_features for p in parts)
        self.scratch = torch.empty(nqkv + no + self.hidden)
        buf = self.scratch.data_ptr()
        self.k_cache, self.v_cache = k_cache, v_cache
        n = len(parts)
        assert n <= 3                           # q|k|v: at most three runs of one type (native StepGgmlAttn)
        self._ptrs = (ctypes.c_uint64 * n)(*(p.blocks.data_ptr() for p in parts))
        self._types = (ctypes.c_int * n)(*(p.type.code for p in parts))
        self._rows_n = (ctypes.c_int * n)(*(p.out_features for p in parts))
        self._keep = (parts, o)                 # the blocks the pointers read
        self.shape = (window, num_heads, num_kv_heads, head_dim)
        self.buffers = (buf, buf + 4 * nqkv, buf + 4 * (nqkv + no))
        self.scale, self.eps = scale, eps
        self._rows: dict[int, tuple[int, int]] = {}
        self.weights = (self.hidden, ctypes.addressof(self._ptrs), ctypes.addressof(self._types),
                        ctypes.addressof(self._rows_n), n, o.blocks.data_ptr(), o.type.code)

    def __call__(self, x: torch.Tensor, h: torch.Tensor, slot: int, p: int, cos: torch.Tensor, sin: torch.Tensor,
                 scores: torch.Tensor, post_norm: torch.Tensor) -> torch.Tensor:
        rows = self._rows.get(slot)
        if rows is None:
            rows = self._rows[slot] = (self.k_cache[slot].data_ptr(), self.v_cache[slot].data_ptr())
        out = torch.empty_like(x)
        lib().ggml_attn_block(x.data_ptr(), h.data_ptr(), *self.weights, cos.data_ptr(), sin.data_ptr(), *rows, p,
                              *self.shape, cos.numel(), self.scale, scores.data_ptr(), post_norm.data_ptr(), self.eps,
                              *self.buffers, out.data_ptr(), torch.get_num_threads())
        return out


class _Shape(ctypes.Structure):          # native_cpu.cpp's StepShape
    _fields_ = [(n, ctypes.c_int32) for n in ("L", "H", "nqkv", "g", "window", "nh", "nkv", "hd", "rot", "max_len",
                                              "E", "k", "renorm", "I", "fg")] + \
               [(n, ctypes.c_float) for n in ("scale", "eps", "limit")] + \
               [(n, ctypes.c_int64) for n in ("gu_off", "gu_sz_off", "d_off", "d_sz_off")] + \
               [("ggml_tail", ctypes.c_int32)] + [(n, ctypes.c_int64) for n in ("gate_off", "up_off", "down_off")]


class _GgmlAttn(ctypes.Structure):       # native_cpu.cpp's StepGgmlAttn: a GgmlAttnBlock's weights
    _fields_ = [("ptrs", ctypes.c_uint64 * 3), ("types", ctypes.c_int32 * 3), ("rows", ctypes.c_int32 * 3),
                ("nparts", ctypes.c_int32), ("o_type", ctypes.c_int32), ("o_w", ctypes.c_void_p)]


class _Layer(ctypes.Structure):          # native_cpu.cpp's StepLayer
    _fields_ = [(n, ctypes.c_void_p) for n in ("qkv_p", "qkv_sz", "o_p", "o_sz", "k_cache", "v_cache", "post_w",
                                               "gate", "next_w", "ggml")]


class DecodeLayers:
    """A one-token decode step's layers in one native call (decode_layers): per layer AttnBlock's call, the router
    and MoETail's call, the same kernels in the same order as the per-layer walk (MoEModel._run_native), so the
    same bits, without its ~100 Python calls a step. A GGUF served alone takes it too: a layer's GgmlAttnBlock
    (q|k|v and o in the file's own types) for its AttnBlock, GgmlTail (records of mixed types) for MoETail. The
    experts' records come from a table of host addresses [layers, experts] (0: not resident); a layer whose picks
    are not all there comes back to the caller, which makes them resident (the provider's host_records) and resumes.
    Buffers are its own (one step at a time)."""

    def __init__(self, blocks: list[AttnBlock], tails: list[MoETail], post_norms: list[torch.Tensor],
                 gates: list[torch.Tensor], next_norms: list[torch.Tensor], num_experts: int, renormalize: bool):
        b, t = blocks[0], tails[0]
        max_len = b.k_cache.shape[1]                  # k_cache: [slots, max_len, nkv, hd] of a layer
        window, nh, nkv, hd = b.shape
        nqkv = b.nqkv
        int4 = [blk for blk in blocks if not isinstance(blk, GgmlAttnBlock)]
        group = int4[0].weights[6] if int4 else 0     # the int4 attention blocks' group size (one for all)
        ggml_tail = isinstance(t, GgmlTail)
        assert all(isinstance(tl, GgmlTail) == ggml_tail and tl.offsets == t.offsets for tl in tails)
        self.layers = len(blocks)
        four = (0, 0, 0, 0) if ggml_tail else t.offsets
        three = t.offsets if ggml_tail else (0, 0, 0)
        self.shape = _Shape(L=self.layers, H=b.hidden, nqkv=nqkv, g=group, window=window, nh=nh, nkv=nkv,
                            hd=hd, rot=0, max_len=max_len, E=num_experts, k=t.top_k, renorm=int(renormalize),
                            I=t.intermediate, fg=0 if ggml_tail else t.group, scale=b.scale, eps=b.eps, limit=t.limit,
                            gu_off=four[0], gu_sz_off=four[1], d_off=four[2], d_sz_off=four[3],
                            ggml_tail=int(ggml_tail), gate_off=three[0], up_off=three[1], down_off=three[2])
        self.table = (_Layer * self.layers)()
        self._ggml = []                                     # the layers' _GgmlAttn structs the table points to
        self._keep = (post_norms, gates, next_norms, blocks)        # the pointers' owners
        for i, (blk, post, gate, nxt) in enumerate(zip(blocks, post_norms, gates, next_norms)):
            assert blk.shape == b.shape and blk.nqkv == nqkv
            assert gate.is_contiguous() and gate.dtype == torch.float32 and gate.shape[0] == num_experts
            assert blk.k_cache.is_contiguous() and blk.v_cache.is_contiguous() and blk.k_cache.shape[1] == max_len
            if isinstance(blk, GgmlAttnBlock):
                n = blk.weights[4]
                a = _GgmlAttn(nparts=n, o_type=blk.weights[6], o_w=blk.weights[5])
                a.ptrs[:n], a.types[:n], a.rows[:n] = blk._ptrs[:], blk._types[:], blk._rows_n[:]
                self._ggml.append(a)
                qp = qs = op = os_ = None
                ggml = ctypes.addressof(a)
            else:
                assert blk.weights[6] == group
                _, qp, qs, _, op, os_, _ = blk.weights
                ggml = None
            self.table[i] = _Layer(qp, qs, op, os_, blk.k_cache.data_ptr(), blk.v_cache.data_ptr(),
                                   post.data_ptr(), gate.data_ptr(), nxt.data_ptr(), ggml)
        self.scratch = torch.empty(nqkv + nh * hd + b.hidden + 3 * t.intermediate + 2 * b.hidden)
        self.ids = torch.empty(self.layers, t.top_k, dtype=torch.int64)
        self.weights = torch.empty(self.layers, t.top_k)
        self._shape_p, self._table_p = ctypes.addressof(self.shape), ctypes.addressof(self.table)

    def __call__(self, x: torch.Tensor, h: torch.Tensor, records: torch.Tensor, start: int, resume: bool, slot: int,
                 p: int, cos: torch.Tensor, sin: torch.Tensor, scores: torch.Tensor) -> int:
        """Layers start.. on one token at position p of KV slot `slot`: x [H] the residual stream and h [H] (the
        input norm of layer `start`, or with `resume` its post-attention norm, its routing in self.ids/weights),
        both updated in place; records int64 [layers, experts] host addresses → the layer count when done (h then
        the final norm's output), else the layer whose picks (self.ids[layer]) are not resident."""
        self.shape.rot = cos.numel()
        return lib().decode_layers(self._shape_p, self._table_p, records.data_ptr(), start, int(resume),
                                   x.data_ptr(), h.data_ptr(), slot, p, cos.data_ptr(), sin.data_ptr(),
                                   scores.data_ptr(), self.scratch.data_ptr(), self.ids.data_ptr(),
                                   self.weights.data_ptr(), torch.get_num_threads())


def router_topk(x: torch.Tensor, gate: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing of one token (engine.models.common.softmax_topk's function): x fp32 [H], gate fp32 [E, H]
    (E <= 1024), both contiguous → (ids int64 [1, k], weights fp32 [1, k])."""
    ids, w = torch.empty(1, top_k, dtype=torch.int64), torch.empty(1, top_k)
    lib().router_topk(x.data_ptr(), x.numel(), gate.data_ptr(), gate.shape[0], top_k, int(renormalize),
                      ids.data_ptr(), w.data_ptr())
    return ids, w


def q8_gemv(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x fp32 [K] · W^T → fp32 [N]; W = q int8 [N, K] · d fp32 [N, K/32] per 32 inputs, all contiguous."""
    n, k = q.shape
    y = torch.empty(n, dtype=torch.float32) if out is None else out
    lib().q8_gemv(_ptr(x), k, _ptr(q), _ptr(d), n, _ptr(y), torch.get_num_threads())
    return y


def ggml_supported(code: int) -> bool:
    """The native kernels are built and have a kernel for GGML type `code` (engine.quant.ggml)."""
    return lib() is not None and bool(lib().ggml_supported(code))


def ggml_matmul(code: int, x: torch.Tensor, w: torch.Tensor, out_features: int) -> torch.Tensor:
    """x fp32 [M, K] (contiguous) · Wᵀ → fp32 [M, N]; W [N, K] a GGUF matrix of GGML type `code`, its blocks as the
    file holds them (uint8, contiguous, N rows of K/block·size bytes): each block dequantized once, in fp32."""
    m, k = x.shape
    y = torch.empty(m, out_features, dtype=torch.float32)
    lib().ggml_matmul(code, _ptr(x), m, k, _ptr(w), out_features, _ptr(y), torch.get_num_threads())
    return y


def ggml_ffn(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, codes: tuple[int, int, int],
             intermediate: int, limit: float | None = None) -> torch.Tensor:
    """One expert on one token: x fp32 [H] contiguous; gate, up [I, H] and down [H, I] GGUF matrices (uint8 views
    of a record, contiguous) of GGML types `codes` → y fp32 [H] = down(silu(gate x)·(up x))."""
    h = x.numel()
    scratch, y = torch.empty(3 * intermediate), torch.empty(h)
    lib().ggml_ffn(_ptr(x), h, intermediate, _ptr(gate), codes[0], _ptr(up), codes[1], _ptr(down), codes[2],
                   _ptr(scratch), _ptr(y), torch.get_num_threads(), _limit(limit))
    return y


def ggml_gemv_stack(x: torch.Tensor, parts: list[tuple[int, torch.Tensor, int]]) -> torch.Tensor:
    """x fp32 [K] (contiguous) through up to 3 GGUF matrices of one input, parts (GGML type code, blocks uint8
    contiguous, rows), as one GEMV → their outputs concatenated, fp32 [Σ rows]: each ggml_matmul's bits (one OpenMP
    region for all, as a decode step's q|k|v and gate|up run)."""
    n = len(parts)
    assert 0 < n <= 3
    ptrs = (ctypes.c_uint64 * n)(*(_ptr(b) for _, b, _ in parts))
    types = (ctypes.c_int * n)(*(c for c, _, _ in parts))
    rows = (ctypes.c_int * n)(*(r for _, _, r in parts))
    y = torch.empty(sum(r for *_, r in parts))
    lib().ggml_gemv_stack(_ptr(x), x.numel(), n, ctypes.addressof(ptrs), ctypes.addressof(types),
                          ctypes.addressof(rows), _ptr(y), torch.get_num_threads())
    return y


# ---------------------------------------------------------------- exact prefill rows (issue 32)
# Many tokens of one sequence through the decode step's own kernels, row by row (native_cpu.cpp's "exact prefill
# rows"): a row's bits are what a one-token call gives for it, whatever the rows around it, so a position computed
# by a whole prefill, a chunk of another length or a decode step is the same and a reused prefix changes no output.

def q8_gemv_rows(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x fp32 [M, K] (contiguous) · Wᵀ → fp32 [M, N], each row as q8_gemv computes it."""
    m, k = x.shape
    y = torch.empty(m, q.shape[0])
    lib().released.q8_gemv_rows(_ptr(x), m, k, _ptr(q), _ptr(d), q.shape[0], _ptr(y), torch.get_num_threads())
    return y


def exact_attend_fast(head_dim: int) -> bool:
    """attn_rows attends with its keys-in-lanes kernel at this head size (AVX-512; checked once on this host to
    give attend_head's bits), else with attend_head row by row (the same bits, slower)."""
    return lib() is not None and bool(lib().exact_attend_fast(head_dim))


def add_rms_norm_rows(x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
    """add_rms_norm on each row of x fp32 [T, H] (updated in place; r [T, H] or None) → a new [T, H]."""
    h = torch.empty_like(x)
    r = None if r is None else r.contiguous()
    lib().released.add_rms_norm_rows(_ptr(x), None if r is None else _ptr(r), _ptr(w), eps, x.shape[1], x.shape[0], _ptr(h))
    return h


def attn_rows(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, start: int,
              window: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> torch.Tensor:
    """attn_decode on T tokens at positions start.. of one sequence: qkv fp32 [T, (nh + 2·nkv)·hd] (rotated in
    place), cos/sin [T, rot] their rows, kc/vc [max_len, nkv, hd] → o fp32 [T, nh·hd]. Contiguous fp32."""
    t = qkv.shape[0]
    o = torch.empty(t, num_heads * head_dim)
    lib().released.attn_rows(_ptr(qkv), _ptr(cos), _ptr(sin), _ptr(kc), _ptr(vc), start, t, window, num_heads, num_kv_heads,
                    head_dim, cos.shape[-1], scale, _ptr(o), torch.get_num_threads())
    return o


def attn_block_rows(block: "AttnBlock", x: torch.Tensor, h: torch.Tensor, slot: int, start: int, cos: torch.Tensor,
                    sin: torch.Tensor, post_norm: torch.Tensor) -> torch.Tensor:
    """AttnBlock's call on T tokens at positions start.. of `slot` (x, h fp32 [T, H]; cos/sin [T, rot]): x += the
    attention (in place) → rms_norm(x)·post_norm [T, H], each row as the one-token call computes it."""
    out = torch.empty_like(x)
    lib().released.attn_block_rows(_ptr(x), _ptr(h), x.shape[0], *block.weights, _ptr(cos), _ptr(sin),
                          block.k_cache[slot].data_ptr(), block.v_cache[slot].data_ptr(), start, *block.shape,
                          cos.shape[-1], block.scale, _ptr(post_norm), block.eps, _ptr(out), torch.get_num_threads())
    return out


def router_topk_rows(x: torch.Tensor, gate: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_topk on each row of x fp32 [T, H] → (ids int64 [T, k], weights fp32 [T, k])."""
    t, h = x.shape
    ids, w = torch.empty(t, top_k, dtype=torch.int64), torch.empty(t, top_k)
    lib().released.router_topk_rows(_ptr(x), t, h, _ptr(gate), gate.shape[0], top_k, int(renormalize), _ptr(ids), _ptr(w))
    return ids, w


def int4_ffn_rows(x: torch.Tensor, address: int, tail: MoETail) -> torch.Tensor:
    """int4_ffn on each row of x fp32 [M, H] (contiguous), the expert's record at host `address` (tail's layout)."""
    m = x.shape[0]
    y = torch.empty(m, tail.hidden)
    lib().released.int4_ffn_rows(_ptr(x), m, tail.hidden, tail.intermediate, *(address + off for off in tail.offsets), tail.group,
                        _ptr(y), torch.get_num_threads(), tail.limit)
    return y


def moe_sum_rows(y: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, x: torch.Tensor, next_w: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """moe_tail's weighted sum (ascending expert order) and norm on T rows: y fp32 [T, k, H] the picks' outputs,
    ids/w [T, k], x [T, H] += the sum (in place) → rms_norm(x)·next_w [T, H]."""
    t, k, h = y.shape
    out = torch.empty_like(x)
    lib().released.moe_sum_rows(_ptr(y), t, k, _ptr(ids), _ptr(w), h, _ptr(x), _ptr(next_w), eps, _ptr(out))
    return out


def moe_rows(h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, records: torch.Tensor, x: torch.Tensor,
             next_w: torch.Tensor, eps: float, tail: MoETail) -> torch.Tensor:
    """int4_ffn_rows for each picked expert's rows (ascending expert) and moe_sum_rows, in one call: h fp32 [T, H]
    the experts' input, ids/w [T, k], records int64 [E] host addresses (every picked expert's resident), x [T, H]
    += the sum (in place) → rms_norm(x)·next_w [T, H]. The same bits as those calls one by one."""
    t, k = ids.shape
    out = torch.empty_like(x)
    lib().released.moe_rows(_ptr(h), t, k, _ptr(ids), _ptr(w), _ptr(records), records.numel(), tail.hidden,
                            tail.intermediate, *tail.offsets, tail.group, _ptr(x), _ptr(next_w), eps, _ptr(out),
                            torch.get_num_threads(), tail.limit)
    return out


def q8_kind(t: str | int) -> str:
    """The rounding of x the int8 GEMVs use for a matrix of GGML type t: llama.cpp's vec_dot_type for it on a CPU,
    "q8_1" (q4_1, q5_1), "q8_k" (the K-quants and iq4_xs) or "q8_0" (the other 32-blocks)."""
    name = ggml.ggml_type(t).name
    return "q8_1" if name in ("q4_1", "q5_1") else "q8_k" if name.endswith("_k") or name == "iq4_xs" else "q8_0"


def q8_quantize(x: torch.Tensor, t: str | int = "q8_0") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x fp32 [K] as the int8 GEMVs round it for a matrix of type t: (codes int8 [K], scales fp32 [K/32] (Q8_K's
    one per 256 given once per 32), the sums a block's min multiplies fp32 [K/32])."""
    x = x.float().contiguous().view(-1)
    q, d, xs = torch.empty(x.numel(), dtype=torch.int8), torch.empty(x.numel() // 32), torch.empty(x.numel() // 32)
    lib().q8_quantize(x.data_ptr(), x.numel(), ggml.ggml_type(t).code, q.data_ptr(), d.data_ptr(), xs.data_ptr())
    return q, d, xs


def _q8_codes(x: torch.Tensor, t: str | int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, d, d32) per block of x [..., K] for t's kind, in fp32 as ggml-cpu computes them (see q8_reference)."""
    if q8_kind(t) == "q8_k":
        xb = x.float().reshape(*x.shape[:-1], -1, 256)
        m = xb.gather(-1, xb.abs().argmax(-1, keepdim=True))           # the first x of largest |x|
        # tensor / tensor: torch computes `scalar / tensor` as reciprocal·scalar, two roundings where C has one
        iscale = torch.where(m != 0, torch.full_like(m, -127.0) / m, torch.zeros_like(m))
        d = torch.where(m != 0, torch.ones_like(m) / iscale, torch.zeros_like(m))
        return torch.round(xb * iscale).clamp(max=127), d, d
    xb = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax != 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    d32 = amax / 127
    return torch.round(xb * inv), d32.half().float(), d32


def q8_reference(x: torch.Tensor, t: str | int = "q8_0") -> torch.Tensor:
    """x [..., K] rounded to 8 bits as the int8 GEMVs round it for a matrix of GGML type t (llama.cpp's CPU rounding
    for that type, q8_kind), in torch; returns x̂ = d·q (fp32), what those GEMVs multiply W by.
      q8_0, q8_1  per 32 inputs: a = max|x|, d = fp16(a/127), q = round-half-even(x·(127/a))
      q8_k        per 256 inputs: m = the first x of largest |x|, i = -127/m, q = min(127, round-half-even(x·i)),
                  d = 1/i (fp32)"""
    q, d, _ = _q8_codes(x, t)
    return (q * d).reshape(x.shape)


def q8_min_sums(x: torch.Tensor, t: str | int) -> torch.Tensor:
    """[..., K/32]: what a 32-weight block's min multiplies in the int8 GEMVs, Σx̂ over the block, except for Q8_1
    (q4_1, q5_1): its s = fp16((a/127)·Σq), llama.cpp's."""
    q, d, d32 = _q8_codes(x, t)                                 # [..., blocks, 32 or 256], scales [..., blocks, 1]
    sums = q.reshape(*x.shape[:-1], -1, 32).sum(-1)
    if q8_kind(t) == "q8_1":
        return (d32.squeeze(-1) * sums).half().float()
    return d.squeeze(-1).repeat_interleave(q.shape[-1] // 32, -1) * sums
