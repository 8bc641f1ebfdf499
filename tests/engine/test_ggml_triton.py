"""The typed GGUF expert kernels (engine.kernels.quant_triton: _ggml_sub, each matrix's GGML type a constexpr, whole
sub-blocks a load) — the decode GEMVs and the prefill grouped GEMM — against the gguf package's dequantization then a
float64 matmul, for every GGML type Kiln reads, on random blocks holding the edge cases (tests.engine.test_ggml_types'
random_blocks: a zero scale, every code bit clear, every bit set) and rows that are not whole tiles (96 and 160 inputs
for the 32-weight types: the GEMM's 128-wide k tiles end part-way, the masks bite). Through Triton's interpreter on
CPU tensors here (TRITON_INTERPRET=1); on CUDA (the H200) on the device. Also: the providers name each layer's types;
dense matrices kept in their blocks on the GPU (engine.kernels.ggml_linear) per type the same way; and every kernel
compiles for an H200 (sm_90, no GPU touched) at Qwen3-30B-A3B's shapes in bf16.
"""
from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:            # before anything imports triton: the interpreter is chosen when kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.quant import ggml  # noqa: E402
from engine.quant.records import QuantLayout, mixed_scheme  # noqa: E402
from tests.engine.test_ggml_types import ffn64, mixed_record  # noqa: E402

pytest.importorskip("gguf")
pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch carry it)")

DEV = torch.device("cuda" if CUDA else "cpu")
QUANTIZED = [n for n in ggml.TYPES if n not in ggml.FLOAT_TYPES]
# Each type in every position once (gate, up, down differ: three constexprs), the float types together.
TRIPLES = [(t, t, t) for t in QUANTIZED] + [("f16", "bf16", "f32"), ("q4_k", "q4_k", "q6_k"), ("q5_0", "q5_0", "q8_0")]


def _kernels():
    from functools import partial

    from engine.kernels.quant_triton import available, quant_grouped_moe, quant_slot_moe
    if not available(DEV):
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1")
    if CUDA:
        return quant_slot_moe, quant_grouped_moe
    # The interpreter runs each program in numpy: fewer, larger programs (the masks still bite).
    return partial(quant_slot_moe, block_i=64, block_h=128), partial(quant_grouped_moe, block_n=128, block_k=128)


def _want(x, made, slots, w):
    t, k = slots.shape
    want = torch.zeros(t, x.shape[1], dtype=torch.float64)
    for a in range(t):
        for b in range(k):
            want[a] += float(w[a, b]) * ffn64(x[a:a + 1], *made[int(slots[a, b])][2])[0]
    return want


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")     # silu of a large negative gate: 0, as on a GPU
@pytest.mark.parametrize("types", TRIPLES, ids=["/".join(m) for m in TRIPLES])
def test_typed_kernels_compute_each_type_as_gguf_dequantizes_it(types):
    gemv, gemm = _kernels()
    gen = torch.Generator().manual_seed(50)
    sup = any(ggml.ggml_type(t).block == 256 for t in types)
    h, i = (256, 256) if sup else (96, 160)
    lay = QuantLayout(h, i, mixed_scheme(types))
    made = [mixed_record(types, h, i, gen, layout=lay) for _ in range(3)]
    arena = torch.stack([rec for _, rec, _ in made]).to(DEV)
    x = torch.randn(3, h, generator=gen)
    slots = torch.tensor([[0, 1], [2, 0], [1, 2]])
    w = torch.rand(3, 2, generator=gen)
    want = _want(x, made, slots, w)
    for name, fn in [("gemv", gemv), ("grouped gemm", gemm)]:
        got = fn(x.to(DEV), arena, slots.to(DEV), w.to(DEV), lay, types=types).double().cpu()
        assert float((got - want).norm() / want.norm()) < 1e-5, name


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
def test_typed_kernels_read_one_type_gguf_records_and_a_record_table():
    """A one-type GGUF store's records (q4_k: no header) by the typed GEMVs, through a record table and a routing log
    as the zero-copy provider launches them, and a 16-bit model dtype (to its rounding)."""
    gemv, gemm = _kernels()
    gen = torch.Generator().manual_seed(51)
    mixed = QuantLayout(256, 256, mixed_scheme(("q4_k",) * 3))
    made = [mixed_record(("q4_k",) * 3, 256, 256, gen, layout=mixed) for _ in range(2)]
    lay = QuantLayout(256, 256, "q4_k")
    recs = [lay.pack_blocks(*[mixed.region(rec, n)[:mixed.regions[n][1]].reshape(o, -1)
                              for n, (_, _, o, _) in mixed.regions.items()]) for _, rec, _ in made]
    arena = torch.stack(recs).to(DEV)
    x = torch.randn(1, 256, generator=gen)
    slots, w = torch.tensor([[1, 0]]), torch.tensor([[0.5, 0.5]])
    want = _want(x, made, slots, w)
    table = torch.tensor([lay.record_bytes, 0], dtype=torch.int64, device=DEV)     # id 0 -> record 1, id 1 -> 0
    log = torch.full((4,), -1, dtype=torch.int32, device=DEV)
    got = gemv(x.to(DEV), arena, torch.tensor([[0, 1]]).to(DEV), w.to(DEV), lay, table=table, log=log,
               types=("q4_k",) * 3).double().cpu()
    assert float((got - want).norm() / want.norm()) < 1e-5
    assert log[:2].tolist() == [0, 1]
    # The model dtype: bf16 on the H200; fp16 here (the interpreter's tl.dot of bf16 is wrong, the old kernels' too),
    # x scaled so that fp16 holds every intermediate.
    xb = (x / 100).to(torch.bfloat16 if CUDA else torch.float16)
    want_b = _want(xb.float(), made, slots, w)
    for fn in (gemv, gemm):
        got = fn(xb.to(DEV), arena, slots.to(DEV), w.to(DEV), lay, types=("q4_k",) * 3).double().cpu()
        assert float((got - want_b).norm() / want_b.norm()) < 2e-2


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
def test_a_gguf_resident_names_each_layers_types(tiny_checkpoint, tmp_path):
    """ResidentExperts.from_checkpoint of a GGUF keeps each MoE layer's (gate, up, down) types, and its forward (the
    typed kernels) equals the CPU's in-memory provider of the same file."""
    from engine.gguf_model import GgufModel
    from engine.tiers import in_memory
    from engine.tiers.resident import ResidentExperts
    from tests.fixtures.tiny_gguf import write_gguf
    _kernels()
    ck = GgufModel(write_gguf(tiny_checkpoint("qwen3_moe"), tmp_path / "q8.gguf", qtype="Q8_0"))
    res = ResidentExperts.from_checkpoint(ck, DEV, torch.float32)
    assert res.types == {layer: ("q8_0",) * 3 for layer in ck.moe_layers}
    ref = in_memory(ck, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(52)
    layer = ck.moe_layers[0]
    for t in (1, 70):                     # the GEMVs, then (past GEMV_MAX_PAIRS picks) the grouped GEMM
        x = torch.randn(t, ck.hidden, generator=gen)
        ids = torch.stack([torch.randperm(ck.n_experts, generator=gen)[:2] for _ in range(t)])
        w = torch.rand(t, 2, generator=gen)
        want = ref.forward(layer, x, ids, w).double()
        got = res.forward(layer, x.to(DEV), ids.to(DEV), w.to(DEV)).double().cpu()
        assert float((got - want).norm() / want.norm()) < 1e-4, t


# ------------------------------------------------------------------ dense matrices kept in their blocks

@pytest.mark.parametrize("name", list(ggml.TYPES))
def test_dense_blocks_on_the_device_compute_as_gguf_dequantizes_them(name):
    """engine.gguf_tensors.DeviceBlockProjection (engine.kernels.ggml_linear): the GEMV for decode's few rows and the
    GEMM for prefill's many, against gguf's dequantization then a float64 matmul; 20 outputs (not whole 8- or
    128-row blocks) of inputs not whole chunks or k tiles where the type allows (96, 160)."""
    from engine.gguf_tensors import DeviceBlockProjection
    from engine.kernels.ggml_linear import GEMV_ROWS
    from tests.engine.test_ggml_types import gguf_dense, inputs_for, random_blocks
    _kernels()
    gen = torch.Generator().manual_seed(53)
    for inp in inputs_for(name):
        out = 20
        blocks = random_blocks(name, out, inp, gen)
        if name in ggml.FLOAT_TYPES:
            want_w = blocks.view({"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[name]).float()
            want_w = want_w.reshape(out, inp).double()
        else:
            want_w = gguf_dense(name, blocks, out, inp)
        proj = DeviceBlockProjection(name, blocks.to(DEV), out, inp)
        for rows in (1, GEMV_ROWS + 9):
            x = torch.randn(rows, inp, generator=gen)
            want = x.double() @ want_w.t()
            got = proj(x.to(DEV)).double().cpu()
            assert got.shape == (rows, out)
            assert float((got - want).norm() / want.norm()) < 1e-5, (rows, inp)
        got = proj(x[0].to(DEV)).double().cpu()          # one row without a batch dimension (the head's h[-1])
        assert got.shape == (out,)


@pytest.mark.skipif(not CUDA, reason="the GPU's projections: a CUDA device")
def test_a_gguf_projection_on_the_gpu_keeps_each_types_blocks():
    """engine.gguf_tensors.projection on CUDA: q|k|v of two types as one StackedProjection of DeviceBlockProjections
    (no bf16 copy), computing as gguf dequantizes them."""
    from engine.gguf_tensors import DeviceBlockProjection, StackedProjection, projection
    from tests.engine.test_ggml_types import gguf_dense, random_blocks
    gen = torch.Generator().manual_seed(54)
    parts = [("q", "q4_k", random_blocks("q4_k", 64, 256, gen)), ("k", "q4_k", random_blocks("q4_k", 16, 256, gen)),
             ("v", "q6_k", random_blocks("q6_k", 16, 256, gen))]
    p = projection(parts, device="cuda", dtype=torch.bfloat16)
    assert isinstance(p, StackedProjection) and all(isinstance(q, DeviceBlockProjection) for q in p.parts)
    assert [q.out_features for q in p.parts] == [80, 16]
    w = torch.cat([gguf_dense(t, b, b.shape[0], 256) for _, t, b in parts])
    x = torch.randn(3, 256, generator=gen)
    got = p(x.cuda()).double().cpu()
    assert float((got - x.double() @ w.t()).norm() / (x.double() @ w.t()).norm()) < 1e-5


@pytest.mark.skipif(not CUDA, reason="the GPU's projections: a CUDA device")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0"])
def test_a_gguf_model_on_cuda_keeps_its_dense_blocks_and_computes_as_on_the_cpu(qtype, tiny_checkpoint, tmp_path):
    """`engine serve --model FILE.gguf --device cuda`'s model: attention's q|k|v and o (and an untied output) are the
    file's blocks on the GPU, and the logits are the CPU's (its native kernels on the same blocks) to fp32 order."""
    from engine.dense_weights import Projection
    from engine.gguf_model import GgufModel
    from engine.gguf_tensors import DeviceBlockProjection, StackedProjection
    from engine.loader import load_model
    from tests.fixtures.tiny_gguf import write_gguf
    path = write_gguf(tiny_checkpoint("qwen3_moe"), tmp_path / f"{qtype}.gguf", qtype=qtype)
    gpu = load_model(path, max_context=64, device="cuda", dtype="float32")
    attn = gpu.layers[0].attn
    for p in (attn.qkv, attn.o):
        assert isinstance(p, (DeviceBlockProjection, StackedProjection)) and not isinstance(p, Projection)
    if "output.weight" in GgufModel(path).tensors:
        assert isinstance(gpu.head, DeviceBlockProjection)
    seq = torch.tensor([5, 17, 200, 42, 99, 7, 311, 64, 128, 3, 250, 19])

    def logits(model):
        with torch.inference_mode():
            got = [model.prefill(seq[:6], slot=0, all_logits=True)]
            got += [model.decode_step([int(seq[i])], [0], [i]) for i in range(6, len(seq))]
        return torch.cat(got).float().cpu()
    want = logits(load_model(path, max_context=64))
    torch.testing.assert_close(logits(gpu), want, rtol=0, atol=2e-3 * float(want.abs().max()))


# The typed kernels compiled for an H200 (sm_90: Triton's passes and ptxas, no device touched) at Qwen3-30B-A3B's
# expert shapes (hidden 2048, intermediate 768) in bf16 with the launch options the wrappers use, for Q4_K_M's
# layers (Q6_K downs or Q4_K) and the 32-weight fallbacks: what the interpreter cannot check (layouts, tl.dot's
# tiles, registers). Run in a subprocess: this module's kernels are the interpreter's.
AOT = r"""
import json, torch
torch.version.cuda = "12.4"          # engine.kernels imports Triton for a CUDA build of torch only
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.kernels import quant_triton as qt
from engine.quant import ggml
from engine.quant.records import QuantLayout, mixed_scheme

def compile(fn, args, **options):
    sig = {n: args[n] if isinstance(args[n], str) else "constexpr" for n in fn.arg_names}
    const = {n: v for n, v in args.items() if not isinstance(v, str)}
    k = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32), options=options)
    return k.metadata.shared

H, I = 2048, 768
b, f, u8, i64, i32 = "*bf16", "*fp32", "*u8", "*i64", "*i32"
out = {}
for types in (("q4_k", "q4_k", "q6_k"), ("q4_k", "q4_k", "q4_k"), ("q5_0", "q5_0", "q8_0"), ("iq4_xs",) * 3):
    lay = QuantLayout(H, I, mixed_scheme(types))
    (tg, sg), (tu, su), (td, sd) = qt._typed(lay, types)
    reg = lay.regions
    name = "/".join(types)
    out[name + " gate_up_gemv"] = compile(qt._gate_up_gemv_ggml, dict(x_ptr=b, arena_ptr=u8, slot_ptr=i64, h_ptr=b,
        SLOT_OFF="i32", table_ptr=i64, log_ptr=i32, K=8, H=H, I=I, REC=lay.record_bytes, TABLE=False, LOG=False,
        GATE=reg["gate"][0], UP=reg["up"][0], TG=tg, TU=tu, SG=sg, SU=su, BLOCK_I=8, CHUNK=qt.chunk(H), LIMIT=0.0),
        num_warps=4)
    out[name + " down_gemv"] = compile(qt._down_gemv_ggml, dict(h_ptr=b, arena_ptr=u8, slot_ptr=i64, w_ptr=b, y_ptr=f,
        SLOT_OFF="i32", table_ptr=i64, H=H, I=I, REC=lay.record_bytes, TABLE=False, DOWN=reg["down"][0], TD=td, SD=sd,
        BLOCK_H=32, CHUNK=qt.chunk(I)), num_warps=4)
    for bm, (bn, bk, warps) in qt.GEMM_TILES.items():
        if bm > qt.GEMM_DEFAULTS["most_m"]:
            continue
        launch = dict(IEEE=False, VEC=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, FMT=qt.TYPED_FMT, G=1)
        out[f"{name} gate_up_gemm {bm}"] = compile(qt._gate_up_gemm, dict(x_ptr=b, arena_ptr=u8, block_slot_ptr=i32,
            pair_ptr=i32, h_ptr=b, K=8, H=H, I=I, REC=lay.record_bytes, GATE=reg["gate"][0], UP=reg["up"][0],
            LIMIT=0.0, TG=tg, TU=tu, SG=sg, SU=su, **launch), num_warps=warps, num_stages=3)
        out[f"{name} down_gemm {bm}"] = compile(qt._down_gemm, dict(h_ptr=b, arena_ptr=u8, block_slot_ptr=i32,
            pair_ptr=i32, w_ptr=b, y_ptr=f, H=H, I=I, REC=lay.record_bytes, DOWN=reg["down"][0], TD=td, SD=sd,
            **launch), num_warps=warps, num_stages=3)
from engine.kernels import ggml_linear as gl
for ty, (o, n) in (("q4_k", (4096 + 1024, 2048)), ("q6_k", (2048, 4096)), ("q8_0", (512, 2048)), ("q5_0", (4096, 2048)),
                   ("q6_k", (151936, 2048))):
    code, s = ggml.ggml_type(ty).code, qt.SUB[ty]
    out[f"dense {ty} {o}x{n} gemv"] = compile(gl._gemv, dict(x_ptr=b, w_ptr=u8, y_ptr=b, OUT=o, IN=n, T=code, S=s,
                                              BLOCK_R=8, CHUNK=qt.chunk(n)), num_warps=4)
    for rows, (bm, bn, bk, warps) in gl.GEMM_TILES.items():
        out[f"dense {ty} {o}x{n} gemm {rows}"] = compile(gl._gemm, dict(x_ptr=b, w_ptr=u8, y_ptr=b, N="i32", OUT=o,
            IN=n, T=code, S=s, IEEE=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk), num_warps=warps, num_stages=3)
print(json.dumps(out))
"""


@pytest.mark.skipif(CUDA, reason="on a GPU the kernels compile and run for real")
def test_the_typed_kernels_compile_for_an_h200_at_qwen3_30b_a3b_shapes():
    import json
    import subprocess
    import sys
    from pathlib import Path
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", AOT], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(run.stdout.splitlines()[-1])
    assert len(got) == 4 * (2 + 2 * 3) + 5 * 3, sorted(got)
    assert max(got.values()) <= 232448, got        # an H200 block's shared memory (227 KiB)
