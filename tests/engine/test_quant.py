"""Quantized expert records: layouts, packing (int8/int4 at pack time, GGUF blocks kept), the manifest's
scheme, and every kernel held to a plain torch dequantize-then-matmul of the same records.

The GGUF references are gguf's own quantize/dequantize (Q4_K has no quantizer in gguf-py, so its blocks
are random valid ones: any bytes are a valid Q4_K block once d and dmin are finite). The Triton kernels
run for real through Triton's interpreter on CPU tensors (TRITON_INTERPRET=1) in fp32 here; their bf16
path runs on a CUDA device only (the interpreter emulates bf16 with numpy, not as a GPU rounds it).
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:            # before anything imports triton: the interpreter is chosen when kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.cli import main  # noqa: E402
from engine.errors import EngineError  # noqa: E402
from engine.quant.records import (FOUR_BIT, GROUP, SCHEMES, QuantLayout, affine4, dequantize_matrix,  # noqa: E402
                                  group_size, matrix_bytes, quantize_int4, quantize_int8, to_int4pack, unpack_int4pack)

gguf = pytest.importorskip("gguf")
QT = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
      "q4_k": gguf.GGMLQuantizationType.Q4_K}


def q4_k_blocks(out: int, inp: int, gen: torch.Generator) -> torch.Tensor:
    """Random valid Q4_K blocks [out, row bytes]: random codes and 6-bit scales, small finite d and dmin."""
    nb = out * inp // 256
    b = torch.randint(0, 256, (nb, 144), dtype=torch.uint8, generator=gen)
    d = (torch.rand(nb, 2, generator=gen) * 0.004).to(torch.float16)
    b[:, 0:4] = d.view(torch.uint8).reshape(nb, 4)
    return b.reshape(out, -1)


def gguf_blocks(scheme: str, w: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    if scheme == "q4_k":
        return q4_k_blocks(*w.shape, gen)
    return torch.from_numpy(gguf.quantize(w.numpy(), QT[scheme]))


def expert(h: int, i: int, gen: torch.Generator, scale: float = 0.1):
    return (torch.randn(i, h, generator=gen) * scale, torch.randn(i, h, generator=gen) * scale,
            torch.randn(h, i, generator=gen) * scale)


def record(lay: QuantLayout, gen: torch.Generator) -> torch.Tensor:
    mats = expert(lay.hidden, lay.intermediate, gen)
    if lay.scheme in ("int8", "int4"):
        return lay.pack(*mats)
    return lay.pack_blocks(*[gguf_blocks(lay.scheme, m, gen) for m in mats])


def shape_for(scheme: str) -> tuple[int, int]:
    return (256, 512) if scheme == "q4_k" else (128, 192)


# ------------------------------------------------------------------ layouts and references

@pytest.mark.parametrize("scheme", ["q8_0", "q4_1", "q4_k"])
def test_gguf_blocks_dequantize_exactly_as_gguf_does(scheme):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 512, generator=gen)
    raw = gguf_blocks(scheme, w, gen)
    want = torch.from_numpy(gguf.dequantize(raw.numpy(), QT[scheme]))
    assert raw.numel() == matrix_bytes(scheme, 64, 512)
    assert torch.equal(dequantize_matrix(scheme, raw.reshape(-1), 64, 512), want)


@pytest.mark.parametrize("scheme,bound", [("int8", 0.01), ("int4", 0.12)])
def test_int8_int4_quantize_group_wise_and_deterministically(scheme, bound):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(96, 576, generator=gen)
    enc = quantize_int8 if scheme == "int8" else quantize_int4
    a, b = enc(w), enc(w.clone())
    assert torch.equal(a, b) and a.numel() == matrix_bytes(scheme, 96, 576)
    d = dequantize_matrix(scheme, a, 96, 576)
    assert float((d - w).norm() / w.norm()) < bound
    g = group_size(576, scheme)
    assert g == GROUP[scheme] == 32
    # group-wise: a group of huge weights does not coarsen its neighbours
    w2 = w.clone()
    w2[:, :g] *= 1000
    d2 = dequantize_matrix(scheme, enc(w2), 96, 576)
    assert torch.allclose(d2[:, g:], d[:, g:])
    # an all-zero group stays zero; a constant one comes back within the scale's fp16/bf16 rounding
    w3 = torch.zeros(96, 576)
    w3[:, g:2 * g] = 0.5
    d3 = dequantize_matrix(scheme, enc(w3), 96, 576)
    assert not d3[:, :g].any() and torch.allclose(d3[:, g:2 * g], w3[:, g:2 * g], rtol=2 ** -8, atol=0)


def q4_1_grid(out: int, inp: int, seed: int) -> torch.Tensor:
    """Weights as a checkpoint converted from a Q4_1 GGUF holds them: gguf's Q4_1 blocks dequantized."""
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)) * 0.2
    return torch.from_numpy(gguf.dequantize(gguf.quantize(w.numpy(), QT["q4_1"]), QT["q4_1"]))


def group_sq_err(d: torch.Tensor, w: torch.Tensor, g: int) -> torch.Tensor:
    return ((d - w) ** 2).reshape(w.shape[0], -1, g).sum(-1)


@pytest.mark.parametrize("grid", ["gaussian", "q4_1"])
def test_int8_scales_are_searched_never_worse_than_absmax(grid):
    """Each group's fp16 scale is the best of absmax/127 ... absmax/96: no group is further from its weights
    than absmax/127 leaves it, and a checkpoint converted from a 4-bit GGUF lands far closer."""
    w = q4_1_grid(64, 512, 7) if grid == "q4_1" else torch.randn(64, 512, generator=torch.Generator().manual_seed(7))
    searched = dequantize_matrix("int8", quantize_int8(w), 64, 512)
    plain = dequantize_matrix("int8", quantize_int8(w, divisors=(127,)), 64, 512)
    assert (group_sq_err(searched, w, 32) <= group_sq_err(plain, w, 32)).all()
    gain = float((plain - w).norm() / (searched - w).norm())
    assert gain > (1.6 if grid == "q4_1" else 1.05), gain
    assert float((searched - w).abs().max()) <= float(w.abs().max()) / 96 / 2 * 1.01     # half a step, at most


def test_int4_group_32_lands_on_a_q4_1_checkpoint_s_own_grid():
    """A checkpoint converted from a Q4_1 GGUF: 32-groups' min/max grid is the file's grid, so int4 keeps it
    but for its bf16 scale and zero; a 64-group one falls between two blocks' grids (bench/quant_accuracy.py
    measured what that costs SmolLM2)."""
    w = q4_1_grid(64, 512, 8)
    err = {g: float((dequantize_matrix("int4", quantize_int4(w, g), 64, 512, group=g) - w).norm() / w.norm())
           for g in (32, 64, 128)}
    assert err[32] < 0.01 < 0.05 < err[64] < err[128], err
    assert dequantize_matrix("int4", quantize_int4(w), 64, 512).equal(
        dequantize_matrix("int4", quantize_int4(w, 32), 64, 512, group=32))       # 32 is the default


def test_int4_is_asymmetric_with_the_codes_fitted_to_bf16_scales():
    gen = torch.Generator().manual_seed(3)
    w = torch.rand(64, 128, generator=gen) + 3.0          # all positive: a symmetric grid would waste half of it
    d = dequantize_matrix("int4", quantize_int4(w), 64, 128)
    step = (w.reshape(64, 1, 128).amax(-1) - w.reshape(64, 1, 128).amin(-1)) / 15
    assert float((d - w).abs().max()) <= float(step.max()) * 0.51 + 1e-2


def test_unpack_int4pack_undoes_torchs_tiling():
    """The cols layout relies on torch's int4pack tiling; if torch changes it, this fails, not the answers."""
    gen = torch.Generator().manual_seed(4)
    for out, inp in [(64, 32), (128, 64), (576, 1536), (3072, 576)]:
        q = torch.randint(0, 16, (out, inp), dtype=torch.int32, generator=gen)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        assert torch.equal(unpack_int4pack(packed, out, inp), q.to(torch.uint8))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_rows_and_cols_records_hold_the_same_expert(scheme):
    gen = torch.Generator().manual_seed(5)
    h, i = shape_for(scheme)
    mats = expert(h, i, gen)
    raws = None if scheme in ("int8", "int4") else [gguf_blocks(scheme, m, gen) for m in mats]
    rows, cols = QuantLayout(h, i, scheme, "rows"), QuantLayout(h, i, scheme, "cols")
    rec_r = rows.pack(*mats) if raws is None else rows.pack_blocks(*raws)
    rec_c = cols.pack(*mats) if raws is None else cols.pack_blocks(*raws)
    for lay, rec in ((rows, rec_r), (cols, rec_c)):
        assert rec.dtype == torch.uint8 and rec.numel() == lay.record_bytes and lay.record_bytes % 4096 == 0
        assert not rec[lay.payload_bytes:].any()                      # zero padding
        assert all(off % 64 == 0 for off, *_ in lay.regions.values())
    if raws is not None:                                            # rows keeps GGUF's bytes unchanged
        for name, raw in zip(("gate", "up", "down"), raws):
            assert torch.equal(rows.region(rec_r, name), raw.reshape(-1))
    a, b = rows.dequantize(rec_r), cols.dequantize(rec_c)
    for x, y in zip(a, b):
        if scheme in ("int4", "int8", "q8_0"):
            assert torch.equal(x, y)                                # the same values: lossless re-encoding
        else:                                                       # fp16-derived scales rounded to bf16
            assert float((x - y).abs().max()) <= 2 ** -8 * float(x.abs().max()) * 2


def test_a_record_is_about_a_quarter_of_bf16():
    h, i = 2048, 768                                                # Qwen3-30B-A3B's expert
    bf16 = 3 * h * i * 2
    for scheme, bits in [("int8", 8.5), ("int4", 5.0), ("q8_0", 8.5), ("q4_1", 5.0), ("q4_k", 4.5)]:
        lay = QuantLayout(h, i, scheme, "rows")
        assert abs(lay.payload_bytes * 8 / (3 * h * i) - bits) < 0.01, scheme
        assert lay.record_bytes < bf16 * bits / 16 + 4096


# ------------------------------------------------------------------ the CPU kernel

@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("order", ["rows", "cols"])
def test_cpu_kernel_equals_dequantize_then_matmul(scheme, order, threads):
    from engine.kernels.quant_cpu import quant_ffn, quant_ffn_reference
    gen = torch.Generator().manual_seed(6)
    lay = QuantLayout(*shape_for(scheme), scheme, order)
    rec = record(lay, gen)
    for m in (1, 3, 17):
        x = torch.randn(m, lay.hidden, generator=gen)
        got, want = quant_ffn(lay, rec, x), quant_ffn_reference(lay, rec, x)
        assert got.dtype == x.dtype and got.shape == x.shape
        if lay.cpu_int4:        # torch's int4 kernel: bf16 results, so within one bf16 rounding of the oracle
            torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -7 * float(want.abs().max()))
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_cpu_int4_kernel_gives_the_same_bits_on_any_thread_count():
    from engine.kernels.quant_cpu import quant_ffn
    gen = torch.Generator().manual_seed(7)
    lay = QuantLayout(576, 1536, "q4_1", "cols")                    # the demo's shape
    rec = record(lay, gen)
    x = torch.randn(1, 576, generator=gen)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(quant_ffn(lay, rec, x))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


# ------------------------------------------------------------------ the Triton kernels

DEV = torch.device("cuda" if CUDA else "cpu")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_triton_kernels_equal_dequantize_then_matmul(scheme):
    pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch carry it)")
    from functools import partial

    from engine.kernels.quant_triton import quant_grouped_moe, quant_moe_reference, quant_slot_moe
    if not CUDA:        # the interpreter runs each program in numpy: fewer, larger blocks (the masks still bite)
        quant_slot_moe = partial(quant_slot_moe, block_i=64, block_h=128)
        quant_grouped_moe = partial(quant_grouped_moe, block_n=128, block_k=128)
    gen = torch.Generator().manual_seed(8)
    h, i = (256, 256) if scheme == "q4_k" else (64, 96)          # tails: 96 is not a multiple of the blocks
    lay = QuantLayout(h, i, scheme, "rows")
    arena = torch.stack([record(lay, gen) for _ in range(5)]).to(DEV)
    dtypes = [(torch.float32, 1e-5)] + ([(torch.bfloat16, 2e-2)] if CUDA else [])
    for dtype, tol in dtypes:
        # 3 x 2 pairs: tiles of 16 rows, mostly padding; 80 x 2 over 5 slots: 32 a slot, tiles of 32
        for t, k in [(1, 2), (3, 2), (80, 2)]:
            x = torch.randn(t, h, generator=gen).to(dtype).to(DEV)
            slots = torch.randint(0, 5, (t, k), generator=gen).to(DEV)
            w = torch.rand(t, k, generator=gen).to(dtype).to(DEV)
            ref = quant_moe_reference(x, arena, slots, w, lay).float()
            kernels = [("gemv", quant_slot_moe)] if t < 80 else []
            # the grouped GEMM with the weights unpacked a tile at a time (vec) and element by element
            kernels += [(f"grouped gemm vec={v}", partial(quant_grouped_moe, vec=v)) for v in (True, False)]
            for name, fn in kernels:
                got = fn(x, arena, slots, w, lay).float()
                assert torch.isfinite(got).all()
                assert float((got - ref).norm() / ref.norm()) < tol, (name, dtype, t, k)


def test_the_gpu_resident_provider_serves_a_quantized_store(tiny_checkpoint, tmp_path, capsys):
    """The providers' hook: a rows-order int4 store in a slot arena, computed by the quantized kernels
    (moe_from_slots hands quantized layouts to them), equals the plain loop over the dequantized records."""
    pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch carry it)")
    from engine.experts.reference import moe_reference
    from engine.tiers.resident import ResidentExperts
    from engine.store import manifest as mf
    ck_dir = tiny_checkpoint("mixtral", hidden=64)
    s = tmp_path / "s"
    assert run(["pack-store", "-q", "--model", str(ck_dir), "--store", str(s), "--quant", "int4"], capsys)[0] == 0
    prov = ResidentExperts.from_store(s, DEV)
    lay = mf.load(s).layout
    gen = torch.Generator().manual_seed(12)
    for t in (1, 40):                                           # decode (GEMV) and prefill (grouped GEMM)
        x = torch.randn(t, 64, generator=gen).to(DEV)
        ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(t)]).to(DEV)
        w = torch.softmax(torch.randn(t, 2, generator=gen), -1).to(DEV)
        got = prov.forward(1, x, ids, w)
        recs = prov.arena[prov.bases[1]:prov.bases[1] + 8]
        want = moe_reference(x, ids, w, lambda e: lay.quantized.dequantize(recs[e]))
        assert float((got - want).norm() / want.norm()) < 1e-5


def test_the_grouped_gemm_pads_each_slots_pairs_to_its_blocks():
    pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch carry it)")
    from engine.kernels.quant_triton import _align_pairs
    slots = torch.tensor([3, 1, 3, 3, 0, 1])
    pairs, block_slot = _align_pairs(slots, 2)
    assert block_slot.tolist() == [0, 1, 3, 3]
    assert pairs.tolist() == [4, -1, 1, 5, 0, 2, 3, -1]


def test_the_grouped_gemm_tile_follows_the_pairs_a_slot_has():
    pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch carry it)")
    from engine.kernels.quant_triton import block_m_for
    assert block_m_for(1024, 128) == 16          # a 128-token chunk over 128 experts: 8 a slot
    assert block_m_for(4096, 128) == 32          # 512 tokens: 32 a slot
    assert block_m_for(65536, 128) == 64         # 8k tokens: capped
    assert block_m_for(65536, 128, most=128) == 128
    assert block_m_for(3, 0) == 16


# ------------------------------------------------------------------ stores: pack, manifest, serve

@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("mixtral", hidden=64)


def run(argv, capsys):
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("order", ["rows", "cols"])
def test_pack_store_quantizes_and_verify_store_checks_it(ckpt, tmp_path, capsys, quant, order):
    from engine.checkpoint import Checkpoint
    from engine.store import manifest as mf
    s = tmp_path / "s"
    rc, out, err = run(["pack-store", "-q", "--json", "--model", str(ckpt), "--store", str(s), "--quant", quant,
                        "--order", order], capsys)
    assert rc == 0, err
    assert json.loads(out)["quant"] == quant
    m, ck = mf.load(s), Checkpoint(ckpt)
    raw = json.loads((s / "manifest.json").read_text())
    assert (raw["quant"], raw["dtype"], m.order) == (quant, "uint8", order)
    lay = m.layout
    assert lay.quantized and m.record_bytes == lay.record_bytes and m.record_bytes % 4096 == 0
    data = (s / "experts.bin").read_bytes()
    for r in m.records:                             # every record is the quantization of the checkpoint's expert
        want = lay.pack(*ck.expert(r.layer, r.expert)).numpy().tobytes()
        assert data[r.offset:r.offset + m.record_bytes] == want
    rc, out, err = run(["verify-store", "-q", "--store", str(s)], capsys)
    assert rc == 0 and "24 ok, 0 bad" in out, err
    float_store = tmp_path / "f"
    run(["pack-store", "-q", "--model", str(ckpt), "--store", str(float_store)], capsys)
    assert m.total_bytes < mf.load(float_store).total_bytes / 2


def test_pack_store_quant_usage_errors_are_one_line(ckpt, tmp_path, capsys):
    rc, _, err = run(["pack-store", "--model", str(ckpt), "--store", str(tmp_path / "s"), "--quant", "gguf"], capsys)
    assert (rc, err.count("\n")) == (2, 1) and "--gguf FILE goes with --quant gguf" in err
    rc, _, err = run(["pack-store", "--model", str(ckpt), "--store", str(tmp_path / "s"), "--quant", "int4",
                      "--dtype", "bfloat16"], capsys)
    assert (rc, err.count("\n")) == (2, 1) and "--dtype bfloat16 is for float records" in err
    rc, _, err = run(["pack-store", "-q", "--model", str(ckpt), "--store", str(tmp_path / "b"), "--quant", "bf16"], capsys)
    from engine.store import manifest as mf
    assert rc == 0 and mf.load(tmp_path / "b").dtype == "bfloat16" and mf.load(tmp_path / "b").quant == "none"


def test_the_manifest_knows_the_scheme(ckpt, tmp_path, capsys):
    from engine.store import manifest as mf
    s = tmp_path / "s"
    run(["pack-store", "-q", "--model", str(ckpt), "--store", str(s), "--quant", "int4"], capsys)
    raw = json.loads((s / "manifest.json").read_text())
    from engine.store.manifest_file import write_with_sidecar
    # each edit with its sidecar rewritten to match, so the field checks (not the manifest's own sha256) find it
    for bad, why in [({"quant": "int3"}, "quant: 'int3' is not one of"),
                     ({"dtype": "float32"}, "dtype 'float32' does not go with quant 'int4'"),
                     ({"quant": "q8_0"}, "record_bytes")]:
        write_with_sidecar(s / "manifest.json", {**raw, **bad})
        with pytest.raises(EngineError, match=f"garbled .*{why}") as e:
            mf.load(s)
        assert e.value.exit_code == 8
    old = dict(raw)
    del old["quant"]
    old["dtype"] = "float32"
    write_with_sidecar(s / "manifest.json", old)
    with pytest.raises(EngineError, match="record_bytes"):     # a manifest without quant is a float store
        mf.load(s)


def write_moe_gguf(path, ck, scheme: str, gen, perturb: bool = False) -> None:
    """A GGUF holding `ck`'s experts as an MoE GGUF does: blk.L.ffn_{gate,up,down}_exps, [E, out, row bytes]."""
    w = gguf.GGUFWriter(str(path), "mixtral")
    for l in ck.moe_layers:
        for kind, which in (("ffn_gate", 0), ("ffn_up", 1), ("ffn_down", 2)):
            mats = [ck.expert(l, e)[which].float() for e in range(ck.n_experts)]
            if perturb:
                mats = [torch.randn(m.shape, generator=gen) * m.std() for m in mats]
            raw = np.stack([gguf.quantize(m.numpy(), QT[scheme]) for m in mats])
            w.add_tensor(f"blk.{l}.{kind}_exps.weight", raw, raw_dtype=QT[scheme])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("scheme", ["q8_0", "q4_1"])
def test_pack_store_keeps_a_gguf_s_own_blocks(ckpt, tmp_path, capsys, scheme):
    from engine.checkpoint import Checkpoint
    from engine.store import manifest as mf
    ck = Checkpoint(ckpt)
    gen = torch.Generator().manual_seed(9)
    g = tmp_path / "m.gguf"
    write_moe_gguf(g, ck, scheme, gen)
    s = tmp_path / "s"
    rc, out, err = run(["pack-store", "-q", "--model", str(ckpt), "--store", str(s), "--quant", "gguf", "--gguf", str(g)],
                       capsys)
    assert rc == 0, err
    m = mf.load(s)
    assert m.quant == scheme and m.order == "rows"
    reader = gguf.GGUFReader(str(g))
    tensors = {t.name: t for t in reader.tensors}
    data = (s / "experts.bin").read_bytes()
    lay = m.layout.quantized
    for r in m.records:
        rec = torch.frombuffer(bytearray(data[r.offset:r.offset + m.record_bytes]), dtype=torch.uint8)
        for name, kind in (("gate", "ffn_gate"), ("up", "ffn_up"), ("down", "ffn_down")):
            want = np.asarray(tensors[f"blk.{r.layer}.{kind}_exps.weight"].data[r.expert]).tobytes()
            assert lay.region(rec, name).numpy().tobytes() == want            # byte for byte
    # a GGUF of other weights is refused by name, before anything is written
    bad = tmp_path / "other.gguf"
    write_moe_gguf(bad, ck, scheme, gen, perturb=True)
    rc, _, err = run(["pack-store", "--model", str(ckpt), "--store", str(tmp_path / "t"), "--quant", "gguf",
                      "--gguf", str(bad)], capsys)
    assert (rc, err.count("\n")) == (3, 1) and "this GGUF is not that checkpoint's" in err
    assert not (tmp_path / "t").exists()


def test_a_quantized_store_serves_on_the_cpu_like_its_dequantized_experts(ckpt, tmp_path, capsys):
    """Tiers (a RAM tier smaller than the store), the all-in-memory provider and the plain reference over
    the dequantized records give the same logits; and int8 stays close to the float model."""
    from engine.checkpoint import Checkpoint
    from engine.experts.reference import moe_reference
    from engine.loader import load_model
    from engine.tiers import build_provider, in_memory
    ck = Checkpoint(ckpt)
    ids = torch.randint(0, 384, (9,), generator=torch.Generator().manual_seed(10))
    float_model = load_model(ckpt, device="cpu", dtype="float32", max_context=64, max_batch=1)
    for quant, close in [("int8", 0.02), ("int4", 0.15)]:
        s = tmp_path / quant
        assert run(["pack-store", "-q", "--model", str(ckpt), "--store", str(s), "--quant", quant, "--order", "cols"],
                   capsys)[0] == 0
        tiered = load_model(ckpt, provider=build_provider(ck, s, ram_slots=3, readers=1), device="cpu",
                            dtype="float32", max_context=64, max_batch=1)
        mem = in_memory(ck, order="cols", quant=quant)
        whole = load_model(ckpt, provider=mem, device="cpu", dtype="float32", max_context=64, max_batch=1)
        with torch.inference_mode():
            a, b, f = tiered.prefill(ids, 0), whole.prefill(ids, 0), float_model.prefill(ids, 0)
            assert torch.equal(a, b)
            assert float((a - f).norm() / f.norm()) < close
            tok = int(a.argmax())
            for step in range(3):
                da = tiered.decode_step([tok], [0], [9 + step])
                assert torch.equal(da, whole.decode_step([tok], [0], [9 + step]))
                tok = int(da.argmax())
        # the provider's arithmetic is the plain loop's over the dequantized records
        x = torch.randn(4, ck.hidden, generator=torch.Generator().manual_seed(11))
        topk = torch.tensor([[0, 3], [3, 5], [7, 0], [1, 2]])
        w = torch.softmax(torch.randn(4, 2), -1)
        recs = mem.records[ck.moe_layers[0]]
        want = moe_reference(x, topk, w, lambda e: mem.layout.quantized.dequantize(recs[e]))
        got = mem.forward(ck.moe_layers[0], x, topk, w)
        if mem.layout.quantized.cpu_int4:
            torch.testing.assert_close(got, want, rtol=0.02, atol=0.02 * float(want.abs().max()))
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        tiered.provider.close()


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantization_is_deterministic_and_knows_nothing_of_threads_or_tiers(ckpt, tmp_path, capsys, quant):
    """pack-store's bytes are a function of the checkpoint alone: the same on 1 thread and on 2, the same as
    the all-in-memory provider quantizes at load (tiers size only where records are kept), and a row
    quantizes the same alone as inside its matrix (the int8 scale search works on row chunks)."""
    from engine.checkpoint import Checkpoint
    from engine.tiers import in_memory
    before = torch.get_num_threads()
    stores = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            s = tmp_path / f"{quant}-{n}"
            assert run(["pack-store", "-q", "--model", str(ckpt), "--store", str(s), "--quant", quant,
                        "--order", "cols"], capsys)[0] == 0
            stores.append((s / "experts.bin").read_bytes())
    finally:
        torch.set_num_threads(before)
    assert stores[0] == stores[1]
    ck = Checkpoint(ckpt)
    mem = in_memory(ck, order="cols", quant=quant)
    rb = mem.layout.record_bytes
    for i, l in enumerate(ck.moe_layers):
        for e in range(ck.n_experts):
            off = (i * ck.n_experts + e) * rb
            assert stores[0][off:off + rb] == mem.records[l][e].numpy().tobytes()
    w = torch.randn(200, 96, generator=torch.Generator().manual_seed(12))
    enc = quantize_int8 if quant == "int8" else quantize_int4
    whole = dequantize_matrix(quant, enc(w), 200, 96)
    for r in (0, 63, 64, 199):
        assert torch.equal(dequantize_matrix(quant, enc(w[r:r + 1]), 1, 96)[0], whole[r])


def test_four_bit_schemes_are_what_the_cpu_kernel_reads():
    assert set(FOUR_BIT) == {"int4", "q4_1", "q4_k"}
    q, sz, g = affine4("int4", quantize_int4(torch.randn(64, 128)), 64, 128)
    blob = to_int4pack(q, sz)
    assert blob.numel() == 64 * 64 + 64 * (128 // g) * 4
