"""The CPU expert lane's native kernel (engine.kernels.lane: native_cpu.cpp's CPU EXPERT LANE region), on real records
packed here: the cols order bitwise equal to int4_ffn per pick summed in the pick order, the rows order (a CUDA
machine's RAM tier) within a bf16 rounding of the dequantized reference and the same bits on any thread count and
instruction set, the GIL released for the call, and the tiered provider's lane computing through it."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # the slot side of the provider test: the GPU kernels, interpreted

from engine.kernels import lane, native  # noqa: E402
from engine.kernels.quant_cpu import quant_ffn_reference  # noqa: E402
from engine.quant.records import QuantLayout  # noqa: E402

pytestmark = pytest.mark.skipif(lane.lib() is None, reason="native kernels not built here (no g++ or not x86-64)")

H, I = 256, 192                                       # I not a multiple of 64: the rows chunks' last one is partial


def records(order: str, n: int, seed: int = 0, scheme: str = "int4"):
    gen = torch.Generator().manual_seed(seed)
    q = QuantLayout(H, I, scheme, order)
    mk = lambda *s: torch.randn(*s, generator=gen) * 0.05   # noqa: E731
    return q, [q.pack(mk(I, H), mk(I, H), mk(H, I)) for _ in range(n)]


# a pick list: 7 picks over 3 tokens (odd), record 1 twice for token 0 and once for token 2 (repeats)
TOKENS = [0, 0, 1, 2, 2, 0, 1]
WHICH = [1, 3, 0, 1, 4, 1, 2]
WEIGHTS = [0.5, 0.125, 0.75, 0.3, 0.7, 0.25, 0.2]


def per_pick_sum(ffn, x, tokens, recs, weights):
    """Σ weights·ffn per token in the picks' order: y·w, then out + y'·w' (moe_forward's one-token sum)."""
    out = [None] * x.shape[0]
    for t, r, w in zip(tokens, recs, weights):
        yw = ffn(x[t], r) * torch.tensor(w, dtype=torch.float32)
        out[t] = yw if out[t] is None else out[t] + yw
    return torch.stack([o if o is not None else torch.zeros(H) for o in out])


@pytest.mark.parametrize("threads", [1, 2])
def test_cols_picks_are_int4_ffn_bitwise_summed_in_the_pick_order(threads):
    q, recs = records("cols", 5)
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(1))        # token 3: no pick, zeros
    picks = [recs[i] for i in WHICH]
    got = lane.moe(x, TOKENS, [r.data_ptr() for r in picks], WEIGHTS, q, lane.Team(threads))
    want = per_pick_sum(lambda xt, r: native.int4_ffn(xt.contiguous(), r, q.regions, 32), x, TOKENS, picks, WEIGHTS)
    assert torch.equal(got, want)
    assert torch.equal(got[3], torch.zeros(H))


def test_rows_picks_are_the_int4_function_on_any_thread_count():
    """Rows records (what a CUDA machine's RAM tier holds): within one bf16 rounding of the dequantized oracle
    (quant_ffn_reference), within the same of the cols kernel on the same codes, the same bits on 1, 2 and 3 threads."""
    q, recs = records("rows", 5)
    qc, recs_c = records("cols", 5)                   # the same weights (same seed) in the cols order
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(2))
    picks, picks_c = [recs[i] for i in WHICH], [recs_c[i] for i in WHICH]
    outs = [lane.moe(x, TOKENS, [r.data_ptr() for r in picks], WEIGHTS, q, lane.Team(n)) for n in (1, 2, 3)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    want = per_pick_sum(lambda xt, r: quant_ffn_reference(q, r, xt.view(1, -1)).view(-1), x, TOKENS, picks, WEIGHTS)
    tol = dict(rtol=2 ** -6, atol=2 ** -6 * float(want.abs().max()))
    torch.testing.assert_close(outs[0], want, **tol)
    cols = lane.moe(x, TOKENS, [r.data_ptr() for r in picks_c], WEIGHTS, qc, lane.Team(2))
    torch.testing.assert_close(outs[0], cols, **tol)
    assert not torch.equal(outs[0], want)             # the oracle is not what ran


@pytest.mark.parametrize("order", ["cols", "rows"])
def test_a_swiglu_limit_clamps_as_int4_ffn_and_the_reference_do(order):
    """glm5_next's swiglu_limit on the lane (it took moe_forward's slow path before): cols bitwise int4_ffn with the
    same limit, rows within a bf16 rounding of the reference with it; a limit that binds changes the output."""
    q, recs = records(order, 5)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(4)) * 40     # gate/up far past the limit
    picks = [recs[i] for i in WHICH]
    got = lane.moe(x, TOKENS, [r.data_ptr() for r in picks], WEIGHTS, q, lane.Team(2), limit=0.5)
    free = lane.moe(x, TOKENS, [r.data_ptr() for r in picks], WEIGHTS, q, lane.Team(2))
    if order == "cols":
        want = per_pick_sum(lambda xt, r: native.int4_ffn(xt.contiguous(), r, q.regions, 32, limit=0.5), x, TOKENS,
                            picks, WEIGHTS)
        assert torch.equal(got, want)
    else:
        want = per_pick_sum(lambda xt, r: quant_ffn_reference(q, r, xt.view(1, -1), limit=0.5).view(-1), x, TOKENS,
                            picks, WEIGHTS)
        # twice the unclamped test's atol: a gate a bf16 rounding either side of the limit is clamped on one side only
        torch.testing.assert_close(got, want, rtol=2 ** -6, atol=2 ** -5 * float(want.abs().max()))
    assert not torch.allclose(got, free)


def test_one_pick_and_a_bf16_input():
    """One pick (a layer's lone CPU pick) and a bf16 x (a CUDA model's hidden state), read as fp32."""
    q, recs = records("cols", 1)
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    got = lane.moe(x, [0], [recs[0].data_ptr()], [0.5], q, lane.Team(2))
    want = native.int4_ffn(x[0].float().contiguous(), recs[0], q.regions, 32) * torch.tensor(0.5)
    assert got.dtype == torch.float32 and torch.equal(got[0], want)


@pytest.mark.slow
def test_the_avx2_build_gives_the_avx512_bits():
    """The kernels built for AVX2 (native.py's flags, -mno-avx512f) and for AVX-512 without BF16 dot products
    (-mno-avx512bf16) give the same bits in either order; the BF16 build (another summation: pairs of (128 + q)·x)
    stays within a bf16 rounding of them. Slow: two more builds of the kernels (~20 s here)."""
    flags = open("/proc/cpuinfo").read()
    if " avx512f" not in flags or " avx2" not in flags:
        pytest.skip("needs a CPU with AVX-512 and AVX2")
    avx2 = lane.load(native.build(native.compiler(), [*native.ARCH, "-mno-avx512f"]))
    avx512 = lane.load(native.build(native.compiler(), [*native.ARCH, "-mno-avx512bf16"]))
    assert lane.isa(avx2) == "avx2+fma" and lane.isa(avx512) == "avx512f"
    for order in ("rows", "cols"):
        q, recs = records(order, 5)
        x = torch.randn(3, H, generator=torch.Generator().manual_seed(4))
        args = (x, TOKENS, [recs[i].data_ptr() for i in WHICH], WEIGHTS, q, lane.Team(2))
        want = lane.moe(*args, so=avx512)
        assert torch.equal(lane.moe(*args, so=avx2), want)
        torch.testing.assert_close(lane.moe(*args), want, rtol=2 ** -6, atol=2 ** -6 * float(want.abs().max()))


def test_a_long_call_releases_the_gil():
    """Another Python thread keeps running while a call computes (ctypes.CDLL drops the GIL; native.lib()'s PyDLL
    would hold it)."""
    q, recs = records("rows", 2)
    n = 4800        # two records read again and again from cache: ~20 ms per 1,200 on a fast host (a CI host's was 19)
    x = torch.randn(1, H)
    span = {}

    def call():
        span["start"] = time.perf_counter()
        lane.moe(x, [0] * n, [recs[i % 2].data_ptr() for i in range(n)], [1.0 / n] * n, q, lane.Team(1))
        span["end"] = time.perf_counter()

    th = threading.Thread(target=call)
    stamps = []
    th.start()
    while th.is_alive():
        stamps.append(time.perf_counter())
    th.join()
    inside = [s for s in stamps if span["start"] < s < span["end"]]
    # the loop here stamps millions a second while the GIL is free, none while a call holds it
    assert span["end"] - span["start"] > 0.005 and len(inside) > 1000


def test_refuses_shapes_it_was_not_written_for():
    q = QuantLayout(H, I, "int8", "rows")
    assert lane.offsets(q) is None and lane.offsets(QuantLayout(256, 256, "q4_k", "rows")) is None
    assert lane.offsets(QuantLayout(256, 256, "q4_k", "cols"))[0] == 1      # q4_k's cols form: int4pack, groups of 32
    assert lane.offsets(QuantLayout(H, I, "int4", "rows"))[0] == 0
    assert lane.offsets(QuantLayout(H, I, "int4", "cols"))[0] == 1


@pytest.fixture(scope="module")
def int4_store(tiny_checkpoint, tmp_path_factory):
    from engine.store.pack import pack_store
    ck = tiny_checkpoint("qwen3_moe", experts=16, top_k=4, layers=3)
    store = tmp_path_factory.mktemp("lane-int4") / "store"
    pack_store(ck, store, quant="int4")               # rows: what the slot kernels (and a CUDA RAM tier) hold
    return ck, store


@pytest.fixture(scope="module")
def ggml_store(tiny_checkpoint, tmp_path_factory):
    """The same model shape as a GGUF's own Q5_0 blocks, packed from the file alone: ggml: records."""
    from engine.store.pack import pack_store
    from tests.fixtures.tiny_gguf import write_gguf
    d = tmp_path_factory.mktemp("lane-ggml")
    ck = tiny_checkpoint("qwen3_moe", experts=16, top_k=4, layers=3)
    path = write_gguf(ck, d / "model.Q5_0.gguf", qtype="Q5_0")
    pack_store(path, d / "store", quant="gguf", gguf=path)
    return path, d / "store"


def _provider(store, mode, rates, cpus, device="cpu"):
    from engine.store import manifest as mf
    from engine.tiers.tiered import TieredExperts
    return TieredExperts(mf.load(store), store, device=device, gpu_slots=6, ram_slots=9, readers=2, cpu_experts=mode,
                         lane_rates=rates, lane_cpus=set(cpus))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
@pytest.mark.parametrize("limit", [None, 0.1])
@pytest.mark.parametrize("records", ["int4", "ggml"])
def test_the_tiered_lane_computes_a_layer_in_one_kernel_call(records, request, monkeypatch, device, limit):
    """The tiered provider's CPU lane on int4 records and on a GGUF's ggml: records: a decode layer's CPU picks go to
    lane.moe in ONE call on the lane's pinned team (a spy on the real function counts them), the CPU rate is measured
    with it, and the layer's output is the slot side's within a bf16 rounding (cuda: the GPU's kernels; cpu: the
    same, interpreted). With a SwiGLU limit (glm5_next's) too: the lane takes it rather than falling back to
    moe_forward."""
    ck, store = request.getfixturevalue(f"{records}_store")
    if records == "ggml":
        assert lane.offsets(_provider(store, "off", None, []).layout.quantized)[0] == lane.GGML
    calls = []
    real = lane.moe
    monkeypatch.setattr(lane, "moe", lambda *a, **kw: calls.append(len(a[1])) or real(*a, **kw))
    cpus = sorted(os.sched_getaffinity(0))[:2]
    ys = {}
    with torch.inference_mode():
        for mode, rates in (("off", None), ("on", "pcie=10,disk=5")):
            prov = _provider(store, mode, rates, cpus, device)
            prov.use_swiglu_limit(limit)
            try:
                layer = prov.manifest.moe_layers[1]
                x = torch.randn(1, prov.layout.hidden, generator=torch.Generator().manual_seed(5)).to(device)
                ids, w = torch.tensor([[2, 5, 9, 13]], device=device), torch.tensor([[0.4, 0.3, 0.2, 0.1]], device=device)
                ys[mode] = prov.forward(layer, x, ids, w).cpu()
                c = prov.counters()
                if mode == "on":
                    assert prov.lane.team.threads == len(cpus) and prov.lane.team.cpus == cpus
            finally:
                prov.close()
    assert c["lanes"]["cpu"]["picks"] == 4 and c["lane_rates"]["source"]["cpu"] == "measured"
    assert c["lane_rates"]["cpu_gbps"] > 0
    # the CPU rate: a warm-up and 5 timed calls over the RAM tier's records; then the layer's four picks in one call
    assert len(calls) == 1 + 5 + 1 and calls[-1] == 4
    want = ys["off"]
    torch.testing.assert_close(ys["on"], want, rtol=2 ** -6, atol=2 ** -6 * float(want.abs().max()))


@pytest.mark.slow
def test_greedy_tokens_are_the_same_with_the_int4_lane_on(int4_store):
    """Every non-slot pick on the CPU lane's kernel (on) against every pick on the slot side (off): the same greedy
    tokens over a decode with reads, evictions and promotions (~70 s here: the slot side is Triton's interpreter)."""
    from engine.loader import load_model
    from tests.engine.test_cpu_lane import PROMPT, _greedy
    ck, store = int4_store
    toks = {}
    cpus = sorted(os.sched_getaffinity(0))[:2]
    with torch.inference_mode():
        for mode in ("off", "on"):
            prov = _provider(store, mode, "pcie=10,cpu=10,disk=5", cpus)
            try:
                toks[mode] = _greedy(load_model(ck, provider=prov, device="cpu", max_context=64), PROMPT, 6)
                if mode == "on":
                    assert prov.counters()["lanes"]["cpu"]["picks"] > 0
            finally:
                prov.close()
    assert toks["on"] == toks["off"]


# ---- a GGUF's ggml: records (each matrix in its own type, named by the record's header)
def ggml_records(n: int, seed: int = 3):
    """A ggml: layout whose layers mix types as a Q4_K_M does (Q5_0 or Q4_K gate/up, Q5_1 or Q8_0 down; I = 192 is
    no multiple of 256, so no K-quant down, as llama-quantize falls back) and n
    records of random blocks (tests.engine.test_ggml_types.random_blocks: a zero scale, the extreme codes)."""
    from engine.gguf_tensors import expert_layout, expert_record
    from tests.engine.test_ggml_types import random_blocks
    gen = torch.Generator().manual_seed(seed)
    triples = [("q5_0", "q5_0", "q5_1"), ("q4_k", "q4_k", "q8_0"), ("q5_0", "iq4_nl", "q4_0")]
    layout = expert_layout(H, I, triples)
    recs = []
    for j in range(n):
        g, u, d = triples[j % len(triples)]
        recs.append(expert_record(layout, (g, random_blocks(g, I, H, gen)), (u, random_blocks(u, I, H, gen)),
                                  (d, random_blocks(d, H, I, gen))))
    return layout.quantized, recs


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_ggml_picks_are_ggml_ffn_bitwise_summed_in_the_pick_order(threads, int8):
    """ggml: records on the lane: each pick ggml_ffn's bits (the per-type row kernels; with int8 activations, x
    rounded to 8 bits as the one-token step rounds it), summed in the pick order, zeros for a token with no pick."""
    from engine.kernels.quant_cpu import ggml_ffn
    q, recs = ggml_records(5)
    assert lane.offsets(q)[0] == lane.GGML
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(1)) * 0.2
    picks = [recs[i] for i in WHICH]
    with native.allow(True, int8_activations=int8):
        got = lane.moe(x, TOKENS, [r.data_ptr() for r in picks], WEIGHTS, q, lane.Team(threads), limit=7.0)
        want = per_pick_sum(lambda xt, r: ggml_ffn(q, r, xt.view(1, -1), 7.0).view(-1), x, TOKENS, picks, WEIGHTS)
    assert torch.equal(got, want)
    assert torch.equal(got[3], torch.zeros(H))
    with native.allow(True, int8_activations=not int8):
        other = lane.moe(x, TOKENS, [r.data_ptr() for r in picks], WEIGHTS, q, lane.Team(threads), limit=7.0)
    assert not torch.equal(other, got)                      # the mode reaches the lane's rows
