"""Every GGML type a standard GGUF uses (engine.quant.ggml): each kernel — the CPU native one
(engine.kernels.native.ggml_matmul / ggml_ffn) and the Triton one (engine.kernels.quant_triton, run by Triton's
interpreter on CPU tensors here, TRITON_INTERPRET=1; on CUDA the same tests run on the device: the integrator runs
them on the H200, they skip without CUDA) — against the gguf package's own dequantization followed by a matmul, on
random blocks holding the edge cases: a zero scale, the extreme codes (all bits clear, all set), and rows that are
not a multiple of 256 where the type allows it (32-weight blocks: 96 and 160 inputs). Expert records whose three
matrices each keep their own type, the manifest's per-layer types and verify-store's check of them are here too.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:            # before anything imports triton: the interpreter is chosen when kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.kernels import native  # noqa: E402
from engine.quant import ggml  # noqa: E402
from engine.quant.records import QuantLayout, mixed_scheme  # noqa: E402

gguf = pytest.importorskip("gguf")

QUANTIZED = [n for n in ggml.TYPES if n not in ggml.FLOAT_TYPES]
# Where each type keeps its fp16 scales (d, dmin, m): random bytes there could be inf or NaN.
FP16_AT = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,), "q2_k": (80, 82),
           "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "iq4_nl": (0,), "iq4_xs": (0,)}


def random_blocks(name: str, out: int, inp: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [out, row bytes] of type `name`: random codes and sub-scales, small finite fp16 scales; block 0 has a
    zero scale, block 1 every code bit clear, block 2 every code bit set (the extreme codes)."""
    t = ggml.ggml_type(name)
    if name in ggml.FLOAT_TYPES:
        w = torch.randn(out, inp, generator=gen)
        w[0, :3] = torch.tensor([0.0, 65504.0, -2.0 ** -20])
        dt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[name]
        return w.to(dt).contiguous().view(torch.uint8).reshape(out, -1)
    nb = out * inp // t.block
    b = torch.randint(0, 256, (nb, t.size), dtype=torch.uint8, generator=gen)
    b[1], b[2] = 0, 255
    for at in FP16_AT[name]:
        d = ((torch.rand(nb, generator=gen) * 0.02 + 0.001) * torch.where(torch.rand(nb, generator=gen) < 0.2, -1, 1))
        b[:, at:at + 2] = d.to(torch.float16).view(torch.uint8).reshape(nb, 2)
    b[0, FP16_AT[name][0]:FP16_AT[name][0] + 2] = 0
    return b.reshape(out, -1)


def gguf_dense(name: str, blocks: torch.Tensor, out: int, inp: int) -> torch.Tensor:
    """The oracle: gguf.quants.dequantize of the blocks, as float64 for the matmul."""
    raw = blocks.numpy().reshape(out, -1)
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ggml.ggml_type(name).code))
    return torch.from_numpy(np.asarray(w, dtype=np.float32).reshape(out, inp)).double()


def inputs_for(name: str) -> list[int]:
    """Row lengths: two super-blocks for the 256-weight types, rows not a multiple of 256 for the others."""
    return [512] if ggml.ggml_type(name).block == 256 else [96, 160]


def matmul_bound(x: torch.Tensor, w: torch.Tensor, rel: float = 1e-5):
    """(x·wᵀ in float64, the bound on fp32 summation error of each output: rel·(|x|·|w|ᵀ))."""
    return x.double() @ w.t(), rel * (x.double().abs() @ w.abs().t()) + 1e-30


def close(got: torch.Tensor, want_bound):
    want, bound = want_bound
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), f"off by {float((err / bound).max()):.1f}x the fp32 bound"


def test_every_type_is_known_and_sized_as_gguf_says():
    for name, t in ggml.TYPES.items():
        qt = gguf.GGMLQuantizationType(t.code)
        assert qt.name.lower() == name and gguf.GGML_QUANT_SIZES[qt] == (t.block, t.size)
    with pytest.raises(ggml.UnknownType, match="IQ2_XXS"):
        ggml.ggml_type("IQ2_XXS")


@pytest.mark.skipif(native.lib() is None, reason="no C++ compiler: the native kernels are not built")
@pytest.mark.parametrize("name", list(ggml.TYPES))
def test_native_matmul_is_gguf_dequantize_then_matmul(name):
    gen = torch.Generator().manual_seed(ggml.ggml_type(name).code)
    assert native.ggml_supported(ggml.ggml_type(name).code)
    for inp in inputs_for(name):
        out = 48
        blocks = random_blocks(name, out, inp, gen)
        want_w = gguf_dense(name, blocks, out, inp)
        for m in (1, 3):
            x = torch.randn(m, inp, generator=gen)
            got = native.ggml_matmul(ggml.ggml_type(name).code, x, blocks, out)
            close(got, matmul_bound(x, want_w))


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_prefill_row_has_the_bits_a_decode_step_gives_it(name):
    """Many rows of x (a prefill: 4 a pass over each weight row, then the rest one by one) give each row the bits
    the one-token GEMV gives it alone, so a prompt's last position and a decode step at it agree exactly."""
    t = ggml.ggml_type(name)
    gen = torch.Generator().manual_seed(t.code + 100)
    k = 512 if t.block == 256 else 160
    w = random_blocks(name, 40, k, gen)
    x = torch.randn(7, k, generator=gen) * torch.linspace(0.1, 3.0, k)
    many = native.ggml_matmul(t.code, x, w, 40)
    for m in range(7):
        assert torch.equal(native.ggml_matmul(t.code, x[m:m + 1], w, 40), many[m:m + 1]), (name, m)


@pytest.mark.skipif(native.lib() is None, reason="no C++ compiler: the native kernels are not built")
def test_the_plain_cpp_path_computes_every_type_too(tmp_path, monkeypatch):
    """The source built without AVX2 (-march=x86-64: the scalar loops a CPU without it runs) against gguf."""
    monkeypatch.setenv("KILN_NATIVE_CACHE", str(tmp_path))
    so = native.load(native.build(native.compiler(), ["-march=x86-64"]))
    gen = torch.Generator().manual_seed(41)
    for name in ggml.TYPES:
        inp = 256 if ggml.ggml_type(name).block == 256 else 96
        blocks, x = random_blocks(name, 16, inp, gen), torch.randn(2, inp, generator=gen)
        y = torch.empty(2, 16)
        so.ggml_matmul(ggml.ggml_type(name).code, x.data_ptr(), 2, inp, blocks.data_ptr(), 16, y.data_ptr(), 1)
        close(y, matmul_bound(x, gguf_dense(name, blocks, 16, inp)))


# A record per standard mix: llama-quantize's Q4_K_M (Q6_K down), a row not a multiple of 256 (Q5_0 / Q8_0
# fallbacks), the dynamic quants' IQ4_XS with Q5_K, and the rest of the types, so each type goes through an FFN.
MIXES = [("q4_k", "q4_k", "q6_k"), ("q2_k", "q3_k", "q5_k"), ("iq4_xs", "iq4_xs", "q5_k"), ("f16", "bf16", "f32"),
         ("q4_0", "q4_1", "q5_0"), ("q5_1", "q8_0", "iq4_nl")]


def mixed_record(types, hidden: int, inter: int, gen: torch.Generator, layout: QuantLayout | None = None):
    """(layout, record, gate, up, down as gguf dequantizes them) for an expert whose matrices have `types`."""
    lay = layout or QuantLayout(hidden, inter, mixed_scheme(types))
    blocks = [random_blocks(t, o, i, gen) for t, (o, i) in zip(types, ((inter, hidden), (inter, hidden), (hidden, inter)))]
    rec = lay.pack_blocks(*blocks, types=types)
    dense = [gguf_dense(t, b, o, i) for t, b, (o, i) in
             zip(types, blocks, ((inter, hidden), (inter, hidden), (hidden, inter)))]
    return lay, rec, dense


def ffn64(x: torch.Tensor, gate, up, down) -> torch.Tensor:
    x = x.double()
    return torch.nn.functional.silu(x @ gate.t()) * (x @ up.t()) @ down.t()


def shape_of(types) -> tuple[int, int]:
    """(hidden, intermediate): 256-weight types need whole super-blocks; the others get a 96-wide expert FFN."""
    sup = any(ggml.ggml_type(t).block == 256 for t in types)
    return (256, 512) if sup else (128, 96)


@pytest.mark.parametrize("types", MIXES, ids=["/".join(m) for m in MIXES])
def test_a_record_keeps_each_matrix_in_its_own_type(types):
    gen = torch.Generator().manual_seed(7)
    h, i = shape_of(types)
    lay, rec, dense = mixed_record(types, h, i, gen)
    assert rec.numel() == lay.record_bytes and lay.record_bytes % 4096 == 0
    assert lay.record_types(rec) == types
    for got, want in zip(lay.dequantize(rec), dense):
        assert torch.equal(got.double(), want)          # the plain path is gguf's dequantization itself


@pytest.mark.skipif(native.lib() is None, reason="no C++ compiler: the native kernels are not built")
@pytest.mark.parametrize("types", MIXES, ids=["/".join(m) for m in MIXES])
def test_native_expert_ffn_on_a_mixed_record(types):
    from engine.kernels.quant_cpu import quant_ffn
    gen = torch.Generator().manual_seed(8)
    h, i = shape_of(types)
    lay, rec, (g, u, d) = mixed_record(types, h, i, gen)
    for m in (1, 4):                                    # one token: ggml_ffn; more: three ggml_matmul calls
        x = torch.randn(m, h, generator=gen) * 0.5
        want = ffn64(x, g, u, d)
        got = quant_ffn(lay, rec, x)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


STACKS = [("q5_0", "q8_0"), ("q4_k", "q4_k", "q6_k"), ("q5_1", "q5_k", "q4_0"), ("q8_0", "iq4_nl"), ("q6_k",)]


@pytest.mark.skipif(native.lib() is None, reason="no C++ compiler: the native kernels are not built")
@pytest.mark.parametrize("types", STACKS, ids=["/".join(m) for m in STACKS])
def test_stacked_matrices_in_one_gemv_give_each_matmuls_bits(types, threads):
    """A decode step's q|k|v and gate|up: matrices of one input in their own types as one GEMV (one OpenMP region)
    give, bit for bit, what ggml_matmul gives each alone (the per-matrix GEMVs they replace), whatever the types
    (IQ4_NL: no one-region kernel, each its own call)."""
    gen = torch.Generator().manual_seed(9)
    k = 512
    parts = [(ggml.ggml_type(t).code, random_blocks(t, rows, k, gen), rows) for t, rows in zip(types, (96, 32, 64))]
    x = torch.randn(k, generator=gen)
    want = torch.cat([native.ggml_matmul(c, x.view(1, -1), b, r).view(-1) for c, b, r in parts])
    assert torch.equal(native.ggml_gemv_stack(x, parts), want)


def test_a_record_in_a_wider_layout_and_a_type_too_wide_for_it():
    """A layer whose down is Q4_K in a store sized for Q6_K downs: the record says so in its header."""
    gen = torch.Generator().manual_seed(9)
    wide = QuantLayout(256, 512, mixed_scheme(("q4_k", "q4_k", "q6_k")))
    lay, rec, dense = mixed_record(("q4_k", "q4_k", "q4_k"), 256, 512, gen, layout=wide)
    assert lay.record_types(rec) == ("q4_k", "q4_k", "q4_k")
    for got, want in zip(lay.dequantize(rec), dense):
        assert torch.equal(got.double(), want)
    narrow = QuantLayout(256, 512, mixed_scheme(("q4_k", "q4_k", "q4_k")))
    with pytest.raises(ValueError, match="down: a q6_k matrix .* does not fit"):
        mixed_record(("q4_k", "q4_k", "q6_k"), 256, 512, gen, layout=narrow)
    with pytest.raises(ValueError, match="not whole q4_k blocks"):
        QuantLayout(256, 96, mixed_scheme(("q4_k", "q4_k", "q4_k")))       # down's row of 96


def test_expert_layout_keeps_the_one_type_schemes_and_sizes_mixed_ones_for_the_widest():
    from engine.gguf_tensors import expert_layout
    assert expert_layout(256, 512, [("Q4_K",) * 3, ("q4_k",) * 3]).quant == "q4_k"
    lay = expert_layout(256, 512, [("q4_k", "q4_k", "q6_k"), ("q4_k", "q4_k", "q4_k")])
    assert lay.quant == "ggml:q4_k,q4_k,q6_k" and lay.record_bytes % 4096 == 0
    assert expert_layout(2048, 1408, [("q4_k", "q4_k", "q5_0")]).quant == "ggml:q4_k,q4_k,q5_0"   # GLM-4.5-Air's width
    with pytest.raises(ValueError, match="1408 weights is not whole q6_k blocks"):
        expert_layout(2048, 1408, [("q4_k", "q4_k", "q6_k")])


@pytest.mark.parametrize("name", list(ggml.TYPES))
def test_weight_keeps_blocks_on_the_cpu_and_computes_as_gguf(name, caplog):
    from engine.gguf_tensors import weight
    gen = torch.Generator().manual_seed(10)
    inp = 256 if ggml.ggml_type(name).block == 256 else 96
    blocks = random_blocks(name, 64, inp, gen)
    want = gguf_dense(name, blocks, 64, inp)
    p = weight(f"blk.0.attn_q.weight", name.upper(), [64, inp], blocks.numpy())
    x = torch.randn(2, inp, generator=gen)
    got = p(x)
    if name in ("q4_1", "q4_k"):            # torch's int4 operand: bf16 edges (engine.dense_weights.Int4Projection)
        torch.testing.assert_close(got.double(), x.double() @ want.t(), rtol=0.02, atol=0.02 * float(got.abs().max()))
    else:
        close(got, matmul_bound(x, want))
    if name not in ggml.FLOAT_TYPES:       # the vocabulary: its kept blocks also give the embedding's rows
        vocab = weight("token_embd.weight", name, [64, inp], blocks, rows=True)
        ids = torch.tensor([[0, 63, 2]])
        assert torch.equal(vocab.rows(ids).double(), want[ids])
        close(vocab(x), matmul_bound(x, want))
    t = weight("blk.0.attn_norm.weight", name, [64, inp], blocks, linear=False)
    assert t.dtype == torch.float32 and torch.equal(t.double(), want)
    with pytest.raises(ValueError, match="blk.0.x.weight: .* bytes, its type and shape need"):
        weight("blk.0.x.weight", name, [64, inp], blocks.reshape(-1)[:-1])


def test_weight_names_a_type_kiln_lacks():
    from engine.gguf_tensors import weight
    with pytest.raises(ValueError, match="output.weight: GGML type IQ2_XXS is not one Kiln reads"):
        weight("output.weight", "IQ2_XXS", [8, 256], np.zeros(8 * 66, np.uint8))


# ------------------------------------------------------------------ a GGUF whose experts mix types: pack, verify, serve

# Per MoE layer of the tiny Mixtral (hidden = intermediate = 256): a Q4_K_M layer (Q6_K down), a plain Q4_K one,
# and one of the 32-weight fallbacks.
LAYER_TYPES = [("q4_k", "q4_k", "q6_k"), ("q4_k", "q4_k", "q4_k"), ("q5_0", "q8_0", "iq4_nl")]


def write_mixed_gguf(path, ck, layer_types, gen) -> dict:
    """A GGUF with `ck`'s shape of experts in `layer_types` (random blocks) → {(layer, kind): dequantized [E, out, in]}."""
    w = gguf.GGUFWriter(str(path), "mixtral")
    dense = {}
    for l, types in zip(ck.moe_layers, layer_types):
        for kind, t, (o, i) in zip(("ffn_gate", "ffn_up", "ffn_down"), types,
                                   ((ck.moe_intermediate, ck.hidden),) * 2 + ((ck.hidden, ck.moe_intermediate),)):
            blocks = [random_blocks(t, o, i, gen) for _ in range(ck.n_experts)]
            raw = np.stack([b.numpy() for b in blocks])
            qt = gguf.GGMLQuantizationType(ggml.ggml_type(t).code)
            w.add_tensor(f"blk.{l}.{kind}_exps.weight", raw, raw_dtype=qt)
            dense[(l, kind)] = torch.stack([gguf_dense(t, b, o, i).float() for b in blocks])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dense


@pytest.fixture(scope="module")
def mixed(tiny_checkpoint, tmp_path_factory):
    """(checkpoint dir whose experts ARE the GGUF's dequantized ones, the GGUF, a store packed from it)."""
    import shutil
    from safetensors.torch import load_file, save_file
    from engine.checkpoint import Checkpoint
    from engine.cli import main
    src = tiny_checkpoint("mixtral", hidden=256, layers=3, experts=4)
    tmp = tmp_path_factory.mktemp("mixed")
    ck_dir = tmp / "ck"
    shutil.copytree(src, ck_dir)
    ck = Checkpoint(ck_dir)
    g = tmp / "mixed.gguf"
    dense = write_mixed_gguf(g, ck, LAYER_TYPES, torch.Generator().manual_seed(20))
    for f in ck_dir.glob("*.safetensors"):
        tensors = load_file(f)
        for l in ck.moe_layers:
            for which, kind in enumerate(("ffn_gate", "ffn_up", "ffn_down")):
                for e in range(ck.n_experts):
                    key = ck.expert_key(l, e, which)
                    if key in tensors:
                        tensors[key] = dense[(l, kind)][e].to(tensors[key].dtype).contiguous()
        save_file(tensors, f, metadata={"format": "pt"})
    store = tmp / "store"
    assert main(["pack-store", "-q", "--model", str(ck_dir), "--store", str(store), "--quant", "gguf",
                 "--gguf", str(g), "--order", "cols"]) == 0
    return ck_dir, g, store


def test_pack_store_keeps_a_mixed_ggufs_blocks_and_the_manifest_its_types(mixed):
    from engine.store import manifest as mf
    ck_dir, g, store = mixed
    m = mf.load(store)
    assert m.quant == "ggml:q5_0,q8_0,q6_k"            # each region sized for its matrix's widest type
    assert m.layer_types == [list(t) for t in LAYER_TYPES]
    tensors = {t.name: t for t in gguf.GGUFReader(str(g)).tensors}
    data = (store / "experts.bin").read_bytes()
    lay = m.layout.quantized
    for r in m.records:
        rec = torch.frombuffer(bytearray(data[r.offset:r.offset + m.record_bytes]), dtype=torch.uint8)
        assert lay.record_types(rec) == tuple(m.layer_types[m.moe_layers.index(r.layer)])
        for name, kind in (("gate", "ffn_gate"), ("up", "ffn_up"), ("down", "ffn_down")):
            want = np.asarray(tensors[f"blk.{r.layer}.{kind}_exps.weight"].data[r.expert]).tobytes()
            assert lay.region(rec, name).numpy().tobytes()[:len(want)] == want       # byte for byte


def test_verify_store_checks_each_records_types_against_the_manifest_and_the_gguf(mixed, tmp_path, capsys):
    import json
    import shutil
    from engine.checkpoint import Checkpoint
    from engine.cli import main
    from engine.store import manifest as mf
    from engine.store.manifest_file import write_with_sidecar
    ck_dir, g, store = mixed
    assert main(["verify-store", "-q", "--store", str(store), "--gguf", str(g), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bad"] == []
    # another quantization of the same model: layer 1's downs in Q6_K
    other = tmp_path / "other.gguf"
    write_mixed_gguf(other, Checkpoint(ck_dir),
                     [LAYER_TYPES[0], LAYER_TYPES[0], LAYER_TYPES[2]], torch.Generator().manual_seed(21))
    assert main(["verify-store", "-q", "--store", str(store), "--gguf", str(other)]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "layer 1's records are q4_k/q4_k/q4_k" in err and "q4_k/q4_k/q6_k" in err
    # a manifest (with its sidecar and the record's sha256 made to match) that lies about a record's types
    bad = tmp_path / "bad"
    shutil.copytree(store, bad)
    raw = json.loads((bad / "manifest.json").read_text())
    raw["layer_types"][1] = ["q4_k", "q4_k", "q6_k"]
    write_with_sidecar(bad / "manifest.json", raw)
    assert main(["verify-store", "-q", "--store", str(bad)]) == 8
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "layer 1 expert 0's record holds q4_k/q4_k/q4_k, the manifest says q4_k/q4_k/q6_k" in err
    raw["layer_types"] = raw["layer_types"][:2]
    write_with_sidecar(bad / "manifest.json", raw)
    with pytest.raises(Exception, match="2 layer_types for 3 moe_layers"):
        mf.load(bad)


def test_a_store_of_mixed_records_serves_as_its_float_checkpoint(mixed):
    """The records through the native per-type kernels (tiers: a RAM tier smaller than the store) against the
    checkpoint whose experts are the GGUF's dequantized blocks, run by the plain float path."""
    from engine.checkpoint import Checkpoint
    from engine.loader import load_model
    from engine.tiers import build_provider
    ck_dir, g, store = mixed
    ck = Checkpoint(ck_dir)
    ids = torch.randint(0, 300, (7,), generator=torch.Generator().manual_seed(22))
    ref = load_model(ck_dir, device="cpu", dtype="float32", max_context=32, max_batch=1)
    tiered = load_model(ck_dir, provider=build_provider(ck, store, ram_slots=3, readers=1), device="cpu",
                        dtype="float32", max_context=32, max_batch=1)
    try:
        with torch.inference_mode():
            a, f = tiered.prefill(ids, 0), ref.prefill(ids, 0)
            torch.testing.assert_close(a, f, rtol=1e-4, atol=1e-4 * float(f.abs().max()))
            tok = int(f.argmax())
            torch.testing.assert_close(tiered.decode_step([tok], [0], [7]), ref.decode_step([tok], [0], [7]),
                                       rtol=1e-4, atol=1e-4 * float(f.abs().max()))
    finally:
        tiered.provider.close()


# ------------------------------------------------------------------ the Triton kernels, per type

DEV = torch.device("cuda" if CUDA else "cpu")
# Each type through the kernels, arranged as records: a 32-weight-type expert 64 x 96 (96: rows not a multiple of
# the kernels' 128-wide tiles, so the masks bite), a 256-weight one 256 x 256.
TRITON_MIXES = MIXES + [("q6_k", "q2_k", "iq4_xs")]


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")     # silu of a large negative gate: 0, as on a GPU
@pytest.mark.parametrize("types", TRITON_MIXES, ids=["/".join(m) for m in TRITON_MIXES])
def test_triton_kernels_on_records_of_every_type(types):
    """The decode GEMVs and the prefill grouped GEMM (weights element by element, each matrix's type read from its
    record's header) against gguf's dequantization then a float64 matmul. On CUDA (the H200) this runs on the
    device; without CUDA through Triton's interpreter."""
    pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch carry it)")
    from functools import partial

    from engine.kernels.quant_triton import available, quant_grouped_moe, quant_slot_moe
    if not available(DEV):
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1")
    if not CUDA:        # the interpreter runs each program in numpy: fewer, larger blocks (the masks still bite)
        quant_slot_moe = partial(quant_slot_moe, block_i=64, block_h=128)
        quant_grouped_moe = partial(quant_grouped_moe, block_n=128, block_k=128)
    gen = torch.Generator().manual_seed(30)
    h, i = (256, 256) if any(ggml.ggml_type(t).block == 256 for t in types) else (64, 96)
    lay = QuantLayout(h, i, mixed_scheme(types))
    made = [mixed_record(types, h, i, gen, layout=lay) for _ in range(3)]
    arena = torch.stack([rec for _, rec, _ in made]).to(DEV)
    for t, k in [(1, 2), (3, 2)] if CUDA or h < 256 else [(2, 2)]:      # the interpreter is slow: one shape of 256s
        x = torch.randn(t, h, generator=gen)
        slots = torch.randint(0, 3, (t, k), generator=gen)
        w = torch.rand(t, k, generator=gen)
        want = torch.zeros(t, h, dtype=torch.float64)
        for a in range(t):
            for b in range(k):
                want[a] += float(w[a, b]) * ffn64(x[a:a + 1], *made[int(slots[a, b])][2])[0]
        for name, fn in [("gemv", quant_slot_moe), ("grouped gemm", quant_grouped_moe)]:
            got = fn(x.to(DEV), arena, slots.to(DEV), w.to(DEV), lay).double().cpu()
            assert float((got - want).norm() / want.norm()) < 1e-5, (name, t, k)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
def test_triton_reads_each_records_own_types():
    """A store sized for Q4_K_M layers (Q6_K downs) holding a layer whose downs are Q4_K: one launch over picks
    of both kinds of record computes each with its own types."""
    pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch carry it)")
    from functools import partial

    from engine.kernels.quant_triton import available, quant_slot_moe
    if not available(DEV):
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1")
    if not CUDA:
        quant_slot_moe = partial(quant_slot_moe, block_i=64, block_h=128)
    gen = torch.Generator().manual_seed(31)
    lay = QuantLayout(256, 256, mixed_scheme(("q4_k", "q4_k", "q6_k")))
    made = [mixed_record(t, 256, 256, gen, layout=lay) for t in (("q4_k", "q4_k", "q6_k"), ("q4_k", "q4_k", "q4_k"))]
    arena = torch.stack([rec for _, rec, _ in made]).to(DEV)
    x = torch.randn(1, 256, generator=gen)
    w = torch.tensor([[0.25, 0.75]])
    want = 0.25 * ffn64(x, *made[0][2]) + 0.75 * ffn64(x, *made[1][2])
    got = quant_slot_moe(x.to(DEV), arena, torch.tensor([[0, 1]]).to(DEV), w.to(DEV), lay).double().cpu()
    assert float((got - want).norm() / want.norm()) < 1e-5


def test_weight_off_the_cpu_is_dequantized_once_and_the_log_says_so(caplog):
    """No device but the CPU keeps dense blocks (the Triton kernels are the experts'): elsewhere a quantized weight
    is dequantized at load, in the model dtype, and logged by name. (The meta device stands in for CUDA here.)"""
    import logging
    from engine.gguf_tensors import weight
    blocks = random_blocks("q6_k", 8, 256, torch.Generator().manual_seed(40))
    with caplog.at_level(logging.INFO, logger="engine.quant"):
        p = weight("blk.3.attn_v.weight", "Q6_K", [8, 256], blocks, device="meta", dtype=torch.bfloat16)
    assert p.weight.device.type == "meta" and p.weight.dtype == torch.bfloat16 and p.weight.shape == (8, 256)
    assert "blk.3.attn_v.weight: no kernel keeps Q6_K blocks on meta here; dequantized at load" in caplog.text


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
def test_a_gguf_alone_resident_on_the_device_computes_its_experts_as_the_cpu(tiny_checkpoint, tmp_path):
    """The path `engine serve --model FILE.gguf --device cuda --experts resident` takes for the experts: the file's
    own records in the device arena (ResidentExperts.from_checkpoint), through the slot kernels (Triton), against
    the CPU's in-memory provider of the same file. On CUDA (the H200) for real; here through Triton's interpreter."""
    pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch carry it)")
    from engine.gguf_model import GgufModel
    from engine.kernels.quant_triton import available
    from engine.tiers import in_memory
    from engine.tiers.resident import ResidentExperts
    from tests.fixtures.tiny_gguf import write_gguf
    if not available(DEV):
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1")
    ck = GgufModel(write_gguf(tiny_checkpoint("qwen3_moe"), tmp_path / "q8.gguf", qtype="Q8_0"))
    res = ResidentExperts.from_checkpoint(ck, DEV, torch.float32)
    assert res.layout.quant == "q8_0"                    # the file's blocks, not floats dequantized at load
    ref = in_memory(ck, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(32)
    layer, k = ck.moe_layers[-1], 2
    for t in (1, 3):
        x = torch.randn(t, ck.hidden, generator=gen)
        ids = torch.stack([torch.randperm(ck.n_experts, generator=gen)[:k] for _ in range(t)])
        w = torch.rand(t, k, generator=gen)
        want = ref.forward(layer, x, ids, w).double()
        got = res.forward(layer, x.to(DEV), ids.to(DEV), w.to(DEV)).double().cpu()
        assert float((got - want).norm() / want.norm()) < 1e-4, t
