"""The fused decode kernels (engine.kernels.triton_decode) against the torch ops they replace.

On a CUDA machine they run for real in bf16. Without a GPU they still run for real through Triton's
interpreter (TRITON_INTERPRET=1) on CPU tensors; the model-level test then makes a CPU model take the
fused path by patching `serves_on` (the one stand-in here: "this device is a GPU"), so the same code that
`engine serve --device cuda` runs is compared, step by step, with the torch forms.
"""
from __future__ import annotations

import os
import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch carry it)")

from engine.kernels import triton_decode as td  # noqa: E402
from engine.kernels.triton_common import sum_picks  # noqa: E402
from engine.models.common import apply_rotary, rms_norm, rotary_tables, softmax_topk  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_add_rms_norm_is_the_add_then_the_norm(dtype, tol):
    g = torch.Generator().manual_seed(0)
    for rows, n in [(1, 160), (3, 256)]:           # 160: not a power of two, the row mask is exercised
        x = torch.randn(rows, n, generator=g).to(dtype).to(DEV)
        r = torch.randn(rows, n, generator=g).to(dtype).to(DEV)
        w = (torch.rand(n, generator=g) + 0.5).to(dtype).to(DEV)
        want_x = x + r
        want_h = rms_norm(want_x, w, 1e-6)
        got_h = td.add_rms_norm(x, r, w, 1e-6)          # x updated in place
        if dtype == torch.float32:
            assert torch.equal(x, want_x)
        else:                                           # Triton's interpreter rounds bf16 its own way: 1 ulp
            torch.testing.assert_close(x, want_x)
        assert rel(got_h, want_h) < tol


def _torch_qk_rope_kv(qkv, qn, kn, cos, sin, pos, slots, kc, vc, nh, nkv, hd):
    b = qkv.shape[0]
    q, k, v = qkv.split((nh * hd, nkv * hd, nkv * hd), dim=-1)
    q, k, v = q.view(b, 1, nh, hd), k.view(b, 1, nkv, hd), v.view(b, 1, nkv, hd)
    if qn is not None:
        q, k = rms_norm(q, qn, 1e-6), rms_norm(k, kn, 1e-6)
    c, s = cos[pos].view(b, 1, 1, -1), sin[pos].view(b, 1, 1, -1)
    q, k = apply_rotary(q, c, s), apply_rotary(k, c, s)
    kc.index_put_((slots, pos), k[:, 0])
    vc.index_put_((slots, pos), v[:, 0])
    return q[:, 0]


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("norm,partial", [(True, 1.0), (False, 1.0), (True, 0.5)])
def test_qk_rope_kv_is_norm_rotary_and_cache_write(dtype, tol, norm, partial):
    from types import SimpleNamespace
    g = torch.Generator().manual_seed(1)
    nh, nkv, hd, b, max_len = 4, 2, 32, 3, 40
    cfg = SimpleNamespace(rotary_dim=int(hd * partial), rope_theta=10000.0)
    cos, sin = rotary_tables(cfg, max_len, dtype, DEV)
    qkv = torch.randn(b, (nh + 2 * nkv) * hd, generator=g).to(dtype).to(DEV)
    qn = (torch.rand(hd, generator=g) + 0.5).to(dtype).to(DEV) if norm else None
    kn = (torch.rand(hd, generator=g) + 0.5).to(dtype).to(DEV) if norm else None
    pos = torch.tensor([0, 17, 39], device=DEV)
    slots = torch.tensor([2, 0, 3], device=DEV)
    caches = [torch.zeros(4, max_len, nkv, hd, dtype=dtype, device=DEV) for _ in range(4)]
    want_q = _torch_qk_rope_kv(qkv, qn, kn, cos, sin, pos, slots, caches[0], caches[1], nh, nkv, hd)
    got_q = td.qk_rope_kv(qkv, qn, kn, cos, sin, pos, slots, caches[2], caches[3], num_heads=nh, num_kv_heads=nkv,
                          head_dim=hd, eps=1e-6)
    assert rel(got_q, want_q) < tol
    assert rel(caches[2], caches[0]) < tol
    assert torch.equal(caches[3], caches[1])            # values are copied as they are
    assert int((caches[2] != 0).any(-1).any(-1).sum()) == b     # exactly one position per sequence written


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("kv_len,window", [(64, 0), (1100, 0), (64, 9)])
def test_decode_attention_is_masked_sdpa(dtype, tol, kv_len, window):
    """64 keys: one program per head; 1100: split programs and the combine kernel."""
    g = torch.Generator().manual_seed(2)
    nh, nkv, hd, slots_n = 4, 2, 16, 3
    kc = torch.randn(slots_n, kv_len, nkv, hd, generator=g).to(dtype).to(DEV)
    vc = torch.randn(slots_n, kv_len, nkv, hd, generator=g).to(dtype).to(DEV)
    q = torch.randn(2, nh, hd, generator=g).to(dtype).to(DEV)
    slots = torch.tensor([2, 0], device=DEV)
    pos = torch.tensor([kv_len - 1, kv_len // 3], device=DEV)
    j = torch.arange(kv_len, device=DEV)
    mask = (j <= pos[:, None])
    if window:
        mask &= j > pos[:, None] - window
    want = F.scaled_dot_product_attention(q[:, :, None], kc[slots].transpose(1, 2), vc[slots].transpose(1, 2),
                                          attn_mask=mask[:, None, None, :], scale=hd ** -0.5, enable_gqa=True)
    got = td.decode_attention(q, kc, vc, slots, pos, kv_len, scale=hd ** -0.5, window=window)
    assert rel(got, want[:, :, 0].reshape(2, nh * hd)) < tol


@pytest.mark.parametrize("e,k,renorm", [(16, 4, True), (12, 2, False), (128, 8, True)])
def test_softmax_topk_picks_what_torch_picks(e, k, renorm):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, e, generator=g).to(torch.bfloat16).to(DEV)
    want_ids, want_w = softmax_topk(logits, k, renorm, torch.bfloat16)
    got_ids, got_w = td.softmax_topk(logits, k, renorm, torch.bfloat16)
    # bf16 logits tie often over 128 experts, and torch.topk orders ties its own way: the same experts with
    # the same weights, compared in expert order (the kernel takes the lowest id of a tie first).
    order_w, order_g = want_ids.sort(-1).indices, got_ids.sort(-1).indices
    assert torch.equal(got_ids.gather(-1, order_g).cpu(), want_ids.gather(-1, order_w).cpu())
    assert rel(got_w.gather(-1, order_g), want_w.gather(-1, order_w)) < 1e-2
    assert (got_w[:, :-1] >= got_w[:, 1:]).all()            # descending, as torch.topk


def test_sum_picks_sums_in_pick_order():
    g = torch.Generator().manual_seed(4)
    y = torch.randn(3 * 4, 1500, generator=g).to(DEV)          # 1500: two column blocks, the second masked
    assert rel(sum_picks(y, 3, 4, torch.float32), y.view(3, 4, -1).sum(1)) < 1e-6


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_a_fused_decode_step_equals_the_torch_step(tiny_checkpoint, monkeypatch, arch):
    """The whole served decode path with the fused kernels (batched, sequences at different positions, one
    of them in a non-contiguous slot) against the same model on the torch forms, in fp32 (Triton's
    interpreter rounds bf16 its own way). GLM: partial rotary, q/k/v biases, its own router."""
    from engine.loader import load_model
    model_dir = tiny_checkpoint(arch)
    dev = "cuda" if CUDA else "cpu"
    plain = load_model(model_dir, device=dev, dtype="float32", max_context=96, max_batch=3, fused_kernels=False,
                       cuda_graphs=False)
    if not CUDA:
        monkeypatch.setattr(td, "serves_on", lambda device: True)
    fused = load_model(model_dir, device=dev, dtype="float32", max_context=96, max_batch=3, cuda_graphs=False)
    assert fused.fused_kernels and not plain.fused_kernels
    vocab = fused.cfg.vocab_size
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, vocab, (n,), generator=g) for n in (7, 30)]
    slots = [0, 2]
    with torch.inference_mode():
        toks = []
        for p, slot in zip(prompts, slots):
            a, b = fused.prefill(p, slot), plain.prefill(p, slot)
            assert rel(a, b) < 1e-5
            toks.append(int(b.argmax()))
        positions = [len(p) for p in prompts]
        for _ in range(4):
            a = fused.decode_step(toks, slots, positions)
            b = plain.decode_step(toks, slots, positions)
            assert rel(a, b) < 1e-4
            assert torch.equal(a.argmax(-1).cpu(), b.argmax(-1).cpu())
            toks = b.argmax(-1).tolist()
            positions = [q + 1 for q in positions]


def test_the_kv_buckets_are_every_length_a_decode_can_need():
    from engine.kv_cache import kv_bucket, kv_buckets
    for max_len in (96, 256, 300, 8704, 32768):
        buckets = kv_buckets(max_len)
        assert buckets == sorted(set(buckets)) and buckets[-1] == max_len
        assert {kv_bucket(n, max_len) for n in range(1, max_len + 1)} == set(buckets)


def test_a_fused_model_compiles_each_buckets_attention_at_load_and_writes_nothing(tiny_checkpoint, monkeypatch,
                                                                                   caplog):
    """decode_attention's variants (SPLITS, CHUNK) differ by KV bucket; a model on the fused kernels launches
    each once at load, so a stream growing into a longer bucket does not stop to compile. The warm-up reads the
    cache and leaves it as it was."""
    import logging
    from engine.loader import load_model
    from engine.kv_cache import kv_buckets
    if not CUDA:
        monkeypatch.setattr(td, "serves_on", lambda device: True)
    with caplog.at_level(logging.INFO, logger="engine.models"):
        m = load_model(tiny_checkpoint("qwen3_moe"), device=DEV, dtype="float32", max_context=600, max_batch=2,
                       cuda_graphs=False)
    variants = {td.attention_variant(n) for n in kv_buckets(600)}
    assert kv_buckets(600) == [256, 512, 600] and len(variants) == 3
    assert "decode attention: 3 variants for 3 KV buckets ready in" in caplog.text
    k, v = m.kv.k[0].clone(), m.kv.v[0].clone()
    assert td.warm_attention(m.kv.k[0], m.kv.v[0], [256, 300, 512], num_heads=m.cfg.num_heads, scale=0.1) == 2
    def same_bytes(a, b):                       # bitwise: an unwritten cache may hold NaN patterns
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    assert same_bytes(k, m.kv.k[0]) and same_bytes(v, m.kv.v[0])
