"""glm5_next's routed experts clamp their SwiGLU at swiglu_limit (gate from above, up both ways, as transformers'
Glm5NextTextExperts._apply_gate), on every path that computes a routed expert: the model hands the limit to its
provider (ExpertProvider.use_swiglu_limit) and the provider carries it into the reference loop, the CPU waves and
their pair/single kernels, the quantized records' kernels (torch, the native int4/ggml kernels, the native MoE tail)
and the Triton epilogues (the test at the end: on CUDA, or through Triton's interpreter on the CPU where triton is
installed).

The checkpoint: the tiny random glm5_next with its routed experts' gate|up scaled ×4 and swiglu_limit 1.5, so that
most routed activations exceed the limit (the test measures how many). Without the clamp Kiln's logits leave
transformers' by far more than the bar (test_without_the_clamp_the_logits_leave_transformers): the comparison can
fail."""
from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:        # the Triton kernels run for real through Triton's interpreter on CPU tensors (test_gpu_path's way)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.experts.reference import expert_ffn, moe_reference, swiglu
from engine.kernels import native
from engine.loader import load_model

LIMIT, SCALE = 1.5, 4.0
PROMPT_LEN, STEPS = 40, 64
ATOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The tiny glm5_next, routed experts' gate|up scaled so their activations pass the (small) limit."""
    from transformers import Glm5NextForConditionalGeneration
    from tests.fixtures.tiny_models import make_tiny_glm5_next
    out = make_tiny_glm5_next(tmp_path_factory.mktemp("glm5_limit"), swiglu_limit=LIMIT)
    m = Glm5NextForConditionalGeneration.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        scaled = [p.mul_(SCALE) for n, p in m.named_parameters() if n.endswith("mlp.experts.gate_up_proj")]
    assert scaled
    m.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def reference(ckpt):
    from transformers import Glm5NextForConditionalGeneration
    return Glm5NextForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 384, (PROMPT_LEN + STEPS,), generator=torch.Generator().manual_seed(5))


def _exceeding(reference, tokens) -> float:
    """The share of the routed experts' gate and up values beyond the limit in transformers' forward."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextExperts
    seen = []
    orig = Glm5NextTextExperts._apply_gate

    def spy(self, gate_up):
        seen.append(gate_up.detach().clone())
        return orig(self, gate_up)
    Glm5NextTextExperts._apply_gate = spy
    try:
        with torch.inference_mode():
            reference(tokens[None])
    finally:
        Glm5NextTextExperts._apply_gate = orig
    gate, up = torch.cat(seen).chunk(2, dim=-1)
    return float(((gate > LIMIT) | (up.abs() > LIMIT)).float().mean())


def test_the_routed_activations_really_exceed_the_limit(reference, tokens):
    assert _exceeding(reference, tokens) > 0.3


def test_prefill_and_64_decode_steps_equal_transformers_with_identical_greedy_tokens(ckpt, reference, tokens):
    model = load_model(ckpt, max_context=160, max_batch=2)
    assert model.provider.swiglu_limit == LIMIT
    prompt = tokens[:PROMPT_LEN].tolist()
    with torch.inference_mode():
        torch.testing.assert_close(model.prefill(tokens, 1, all_logits=True), reference(tokens[None]).logits[0],
                                   atol=ATOL, rtol=0)
        logits = [model.prefill(prompt, 0)]
        out = [int(logits[0].argmax())]
        for i in range(STEPS - 1):
            logits.append(model.decode_step([out[-1]], [0], [PROMPT_LEN + i])[0])
            out.append(int(logits[-1].argmax()))
        want = reference(torch.tensor([prompt + out])).logits[0, PROMPT_LEN - 1:-1]
    torch.testing.assert_close(torch.stack(logits), want, atol=ATOL, rtol=0)
    assert out == want.argmax(-1).tolist()
    assert len(set(out)) > 3


def test_without_the_clamp_the_logits_leave_transformers(ckpt, reference, tokens):
    """The same model with its provider told there is no limit (as before this clamp): far outside the bar."""
    model = load_model(ckpt, max_context=160, max_batch=2)
    model.provider.use_swiglu_limit(None)
    with torch.inference_mode():
        diff = (model.prefill(tokens, 0, all_logits=True) - reference(tokens[None]).logits[0]).abs().max()
    assert diff > 100 * ATOL


def test_served_from_a_store_the_tiered_provider_clamps(ckpt, reference, tokens, tmp_path):
    """pack-store's records served by the tiered provider (RAM tier ← store, the CPU waves): transformers' logits."""
    from engine.cli import main
    store = tmp_path / "store"
    assert main(["pack-store", "--model", str(ckpt), "--store", str(store), "-q"]) == 0
    model = load_model(ckpt, store_dir=store, max_context=160, max_batch=1)
    assert model.provider.counters()["provider"] == "tiered" and model.provider.swiglu_limit == LIMIT
    with torch.inference_mode():
        torch.testing.assert_close(model.prefill(tokens, 0, all_logits=True), reference(tokens[None]).logits[0],
                                   atol=ATOL, rtol=0)


# ------------------------------------------------------------------ the providers and kernels, one by one

def _records(quant: str, dtype=None, order: str = "cols", experts: int = 4, h: int = 64, i: int = 64, seed: int = 0):
    """`experts` random experts (gate/up large enough to pass LIMIT) packed into records of `quant` (none: bf16
    or fp32 floats) → (layout, records [E, elems], the dequantized (gate, up, down) of each, fp32)."""
    from engine.experts.layout import ExpertLayout
    g = torch.Generator().manual_seed(seed)
    mats = [(torch.randn(i, h, generator=g) * 0.6, torch.randn(i, h, generator=g) * 0.6,
             torch.randn(h, i, generator=g) * 0.1) for _ in range(experts)]
    if quant == "none":
        layout = ExpertLayout(h, i, dtype, order)
        recs = torch.stack([layout.pack(*(m.to(dtype) for m in ms)) for ms in mats])
        deq = [tuple(v.float() for v in layout.views(r)) for r in recs]
    else:
        layout = ExpertLayout(h, i, torch.uint8, order, quant)
        recs = torch.stack([layout.pack(*ms) for ms in mats])
        deq = [tuple(v.float() for v in layout.quantized.dequantize(r)) for r in recs]
    return layout, recs, deq


def _routing(tokens: int, experts: int, k: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    return ids, torch.rand(tokens, k, generator=g)


@pytest.mark.parametrize("quant,dtype", [("none", torch.float32), ("none", torch.bfloat16), ("int8", None),
                                         ("int4", None)], ids=["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("tokens_n", [1, 5])
def test_the_cpu_provider_clamps_as_its_dequantized_reference(quant, dtype, tokens_n, threads):
    """InMemoryExperts (the CPU waves: pair/single kernels, a record's own quantized kernel, the native int4 FFN
    at one fp32 token) with the limit, against moe_reference over the dequantized records with the clamp; and the
    same provider without the limit differs (the clamp was active)."""
    from engine.tiers.memory import InMemoryExperts
    layout, recs, deq = _records(quant, dtype)
    x_dtype = dtype or torch.float32
    x = torch.randn(tokens_n, 64, generator=torch.Generator().manual_seed(2)).to(x_dtype)
    ids, w = _routing(tokens_n, len(deq))
    prov = InMemoryExperts(layout, {0: recs})
    prov.use_swiglu_limit(LIMIT)
    got = prov.forward(0, x, ids, w.to(x_dtype)).float()
    want = moe_reference(x.float(), ids, w, lambda e: deq[e], LIMIT)
    plain = moe_reference(x.float(), ids, w, lambda e: deq[e])
    # bf16 records compute in bf16; the int4 kernel rounds its operands to bf16 (quant_ffn_reference's contract).
    tol = 1e-5 if (quant == "none" and dtype == torch.float32) or quant == "int8" else 0.03
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, atol=tol * scale, rtol=0)
    assert (plain - want).abs().max() > 10 * tol * scale
    prov.use_swiglu_limit(None)
    torch.testing.assert_close(prov.forward(0, x, ids, w.to(x_dtype)).float(), plain,
                               atol=tol * float(plain.abs().max()), rtol=0)


def test_expert_ffn_and_swiglu_are_transformers_apply_gate():
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextExperts
    g = torch.Generator().manual_seed(3)
    gate, up, down, x = torch.randn(32, 16, generator=g), torch.randn(32, 16, generator=g), \
        torch.randn(16, 32, generator=g), torch.randn(5, 16, generator=g) * 2

    class Cfg:
        num_local_experts, hidden_size, moe_intermediate_size, swiglu_limit = 1, 16, 32, LIMIT
    ref = Glm5NextTextExperts(Cfg)
    want = torch.nn.functional.linear(ref._apply_gate(x @ torch.cat([gate, up]).t()), down)
    assert torch.equal(expert_ffn(x, gate, up, down, LIMIT), want)
    a, b = torch.randn(7, 9, generator=g) * 3, torch.randn(7, 9, generator=g) * 3
    assert torch.equal(swiglu(a, b), torch.nn.functional.silu(a) * b)        # no limit: the two plain ops
    assert torch.equal(swiglu(a, b, 0.0), swiglu(a, b))


native_only = pytest.mark.skipif(native.lib() is None, reason="no C++ compiler: the native kernels are not built")


@native_only
def test_native_int4_ffn_and_moe_tail_clamp():
    from engine.kernels.quant_cpu import quant_ffn_reference
    from engine.models.common import rms_norm
    layout, recs, deq = _records("int4")
    layout = layout.quantized
    x = torch.randn(64, generator=torch.Generator().manual_seed(4))
    for rec in recs:
        got = native.int4_ffn(x, rec, layout.regions, 32, LIMIT)
        want = quant_ffn_reference(layout, rec, x.view(1, -1), LIMIT).view(-1)
        plain = quant_ffn_reference(layout, rec, x.view(1, -1)).view(-1)
        scale = float(want.abs().max())
        torch.testing.assert_close(got, want, atol=2 ** -6 * scale, rtol=0)
        assert (plain - want).abs().max() > 2 ** -4 * scale
        assert torch.equal(native.int4_ffn(x, rec, layout.regions, 32), native.int4_ffn(x, rec, layout.regions, 32,
                                                                                         float("inf")))
    # The MoE tail: two experts' weighted sum added to the residual, then the next norm.
    tail = native.MoETail(layout.regions, 64, 64, 32, 2, LIMIT)
    gate = torch.randn(len(recs), 64, generator=torch.Generator().manual_seed(5))
    picked = tail.route(x, gate, True)
    resid, norm_w = torch.randn(64), torch.ones(64)
    got = tail(x, [recs[e].data_ptr() for e in picked], resid.clone(), norm_w, 1e-6)
    ys = sorted((e, native.int4_ffn(x, recs[e], layout.regions, 32, LIMIT) * tail.weights[j])
                for j, e in enumerate(picked))
    want = rms_norm((resid + ys[0][1] + ys[1][1]).view(1, -1), norm_w, 1e-6).view(-1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@native_only
def test_native_ggml_ffn_clamps():
    pytest.importorskip("gguf")
    from engine.kernels.quant_cpu import quant_ffn
    from tests.engine.test_ggml_types import mixed_record
    gen = torch.Generator().manual_seed(8)
    types = ("q8_0", "q8_0", "q8_0")
    lay, rec, (g, u, d) = mixed_record(types, 128, 96, gen)
    for m in (1, 4):                 # one token: the native ggml_ffn; more: three ggml_matmul calls and swiglu
        x = torch.randn(m, 128, generator=gen) * 8                # gate·x and up·x past the limit
        want = expert_ffn(x.double(), g.double(), u.double(), d.double(), LIMIT)
        got = quant_ffn(lay, rec, x, LIMIT).double()
        torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)
        assert (quant_ffn(lay, rec, x).double() - want).abs().max() > 1e-2 * float(want.abs().max())


# ------------------------------------------------------------------ the Triton epilogues

@pytest.mark.parametrize("quant,dtype", [("none", torch.bfloat16), ("none", torch.float32), ("int8", None),
                                         ("int4", None)], ids=["bf16", "fp32", "int8", "int4"])
# GEMV kernels (≤ 64 pairs), the grouped GEMM above; interpreted (no CUDA), more than one token takes 20-40 s: slow.
@pytest.mark.parametrize("tokens_n", [1, pytest.param(4, marks=[] if CUDA else [pytest.mark.slow]), 64])
def test_cuda_triton_epilogues_clamp(quant, dtype, tokens_n):
    """moe_from_slots (the resident/tiered/zero-copy providers' kernels) with the limit against moe_reference over
    the dequantized records with the clamp. On CUDA; without one, through Triton's interpreter (GEMV sizes only:
    the interpreted grouped GEMM takes minutes)."""
    pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch carry it)")
    from engine.kernels.triton_common import triton_available
    from engine.kernels.triton_moe import moe_from_slots
    dev = torch.device("cuda" if CUDA else "cpu")
    if not triton_available(dev) or (not CUDA and tokens_n > 4):
        pytest.skip("the Triton kernels need CUDA (or TRITON_INTERPRET=1 set before they were defined)")
    layout, recs, deq = _records(quant, dtype, order="rows", experts=8, h=128, i=128)
    x_dtype = dtype or torch.bfloat16
    x = torch.randn(tokens_n, 128, generator=torch.Generator().manual_seed(2)).to(x_dtype)
    ids, w = _routing(tokens_n, len(deq))
    args = (x.to(dev), recs.to(dev), ids.to(dev), w.to(x_dtype).to(dev), layout, ids.to(dev))
    got = moe_from_slots(*args, limit=LIMIT).float().cpu()
    plain = moe_from_slots(*args).float().cpu()
    want = moe_reference(x.float(), ids, w, lambda e: deq[e], LIMIT)
    scale = float(want.abs().max())
    tol = 1e-4 if x_dtype == torch.float32 else 0.03
    torch.testing.assert_close(got, want, atol=tol * scale, rtol=0)
    assert (plain - want).abs().max() > 10 * tol * scale
