"""engine.kernels.native: the engine's own CPU kernels for a one-sequence decode step, each against the torch
form it stands in for, every instruction-set path of the source (AVX-512 with and without bf16 dot products,
AVX2, plain C++) built and compared, and the model's native decode against its torch decode."""
from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.dense_weights import Q8Projection
from engine.kernels import native
from engine.models.common import apply_rotary, softmax_topk
from engine.quant.records import int4pack_operands, to_int4pack
from tests.fixtures.decode import greedy

pytestmark = pytest.mark.skipif(native.lib() is None, reason="no C++ compiler: the native kernels are not built")

BF = 2 ** -7                     # one bf16 rounding, relative


def int4_operand(out: int, inp: int, gen: torch.Generator):
    buf = to_int4pack(torch.randint(0, 16, (out, inp), generator=gen), torch.randn(out, inp // 32, 2, generator=gen))
    return int4pack_operands(buf, out, inp, 32)


def torch_int4(x: torch.Tensor, packed, sz) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.view(1, -1).to(torch.bfloat16), packed, 32, sz).float().view(-1)


def q8_weight(out: int, inp: int, gen: torch.Generator) -> torch.Tensor:
    """A float weight that is exactly Q8_0 blocks, as a GGUF's dequantizes: fp16 d · q, the largest |q| 127."""
    q = torch.randint(-127, 128, (out, inp // 32, 32), generator=gen).float()
    q[..., 0] = 127 * torch.sign(torch.randn(out, inp // 32, generator=gen)).clamp(min=0) * 2 - 127
    d = (torch.rand(out, inp // 32, 1, generator=gen) * 0.01).half().float()
    return (q * d).reshape(out, inp)


@pytest.mark.parametrize("out,inp", [(960, 576), (3072, 576), (576, 1536), (128, 256)])
def test_int4_gemv_is_torchs_int4_kernel(out, inp, threads):
    """The same function as torch's kernel (bf16 x and y, fp32 sums) in another summation order: within one
    bf16 rounding, and on most outputs the same bits."""
    gen = torch.Generator().manual_seed(out + inp)
    packed, sz = int4_operand(out, inp, gen)
    x = torch.randn(inp, generator=gen)
    got, want = native.int4pack_gemv(x, packed, sz, 32), torch_int4(x, packed, sz)
    torch.testing.assert_close(got, want, rtol=BF, atol=BF * float(want.abs().max()))
    assert (got == want).float().mean() > 0.95


def test_int4_ffn_is_quant_ffn(threads):
    from engine.kernels.quant_cpu import quant_ffn_reference
    from engine.quant.records import QuantLayout
    gen = torch.Generator().manual_seed(3)
    lay = QuantLayout(576, 1536, "int4", "cols")                  # the demo's expert shape
    rec = lay.pack(*(torch.randn(s, generator=gen) * 0.05 for s in ((1536, 576), (1536, 576), (576, 1536))))
    x = torch.randn(576, generator=gen)
    got, want = native.int4_ffn(x, rec, lay.regions, 32), quant_ffn_reference(lay, rec, x.view(1, -1)).view(-1)
    torch.testing.assert_close(got, want, rtol=2 * BF, atol=2 * BF * float(want.abs().max()))


def test_q8_projection_holds_exact_blocks_and_computes_the_float_matmul(threads):
    gen = torch.Generator().manual_seed(4)
    w = q8_weight(1000, 576, gen)
    p = Q8Projection.exact(w)
    assert p is not None and p.q.dtype == torch.int8 and p.d.shape == (1000, 18)
    assert torch.equal(p.dequantized(), w)
    ids = torch.tensor([[0, 999, 5]])
    assert torch.equal(p.rows(ids), F.embedding(ids, w))             # the embedding's rows, bit for bit
    for x in (torch.randn(1, 1, 576, generator=gen), torch.randn(5, 576, generator=gen)):
        torch.testing.assert_close(p(x), x @ w.t(), rtol=1e-5, atol=1e-4)
    assert Q8Projection.exact(torch.randn(64, 576, generator=gen)) is None        # plain floats: not blocks
    assert Q8Projection.exact(w.to(torch.bfloat16)) is None


def test_add_rms_norm_and_routing_are_the_torch_forms():
    from engine.models.common import rms_norm
    gen = torch.Generator().manual_seed(5)
    x, r, w = (torch.randn(1, 576, generator=gen) for _ in range(3))
    x0 = x.clone()
    h = native.add_rms_norm(x, r, w.view(-1), 1e-5)
    assert torch.equal(x, x0 + r)                                   # the residual add, in place
    torch.testing.assert_close(h, rms_norm(x0 + r, w.view(-1), 1e-5), rtol=1e-6, atol=1e-6)
    gate = torch.randn(8, 576, generator=gen)
    for k, renorm in ((1, True), (2, True), (3, False)):
        ids, wts = native.router_topk(x.view(-1), gate, k, renorm)
        want_ids, want_w = softmax_topk(F.linear(x, gate), k, renorm, torch.float32)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(wts, want_w, rtol=1e-6, atol=1e-7)
    assert native.router_topk(x.view(-1), gate, 1, True)[1].item() == 1.0   # top-1 renormalised: exactly 1


@pytest.mark.parametrize("nh,nkv,hd,rot,window", [(9, 3, 64, 64, 0), (4, 4, 32, 16, 0), (8, 2, 64, 64, 5)])
def test_attn_decode_is_rotary_kv_write_and_sdpa(nh, nkv, hd, rot, window, threads):
    """Rotary on q and k, k and v written at row p, attention over the rows the window keeps: as the torch
    forms (apply_rotary, the cache write, scaled_dot_product_attention) compute it."""
    gen = torch.Generator().manual_seed(nh + rot)
    max_len, p = 64, 40
    kc, vc = torch.randn(max_len, nkv, hd, generator=gen), torch.randn(max_len, nkv, hd, generator=gen)
    qkv = torch.randn((nh + 2 * nkv) * hd, generator=gen)
    cos, sin = torch.randn(rot, generator=gen), torch.randn(rot, generator=gen)
    q, k, v = qkv.split((nh * hd, nkv * hd, nkv * hd))
    q, k = (apply_rotary(t.view(-1, hd), cos, sin) for t in (q, k))
    keys, values = kc.clone(), vc.clone()
    keys[p], values[p] = k, v.view(nkv, hd)
    lo = max(0, p + 1 - window) if window else 0
    want = F.scaled_dot_product_attention(q.view(1, nh, 1, hd), keys[lo:p + 1].transpose(0, 1)[None],
                                          values[lo:p + 1].transpose(0, 1)[None], scale=hd ** -0.5,
                                          enable_gqa=True).view(-1)
    got = native.attn_decode(qkv, cos, sin, kc, vc, p, window, nh, nkv, hd, hd ** -0.5, torch.empty(nh * max_len))
    assert torch.equal(kc[p], keys[p]) and torch.equal(vc[p], values[p])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", [["-march=native", "-mno-avx512bf16"], ["-march=native", "-mno-avx512f"],
                                  ["-march=x86-64"]], ids=["avx512-fma", "avx2", "plain"])
def test_every_instruction_set_path_agrees(arch, tmp_path, monkeypatch):
    """The source's other paths, built here too (this CPU runs the widest): each GEMV against torch."""
    monkeypatch.setenv("KILN_NATIVE_CACHE", str(tmp_path))
    so = native.load(native.build(native.compiler(), arch))
    gen = torch.Generator().manual_seed(8)
    packed, sz = int4_operand(192, 576, gen)
    x = torch.randn(576, generator=gen)
    y = torch.empty(192)
    so.int4pack_gemv(x.data_ptr(), 576, packed.data_ptr(), sz.data_ptr(), 192, 32, y.data_ptr(), 2)
    want = torch_int4(x, packed, sz)
    torch.testing.assert_close(y, want, rtol=BF, atol=BF * float(want.abs().max()))
    w = q8_weight(70, 576, gen)
    p = Q8Projection.exact(w)
    y = torch.empty(70)
    so.q8_gemv(x.data_ptr(), 576, p.q.data_ptr(), p.d.data_ptr(), 70, y.data_ptr(), 2)
    torch.testing.assert_close(y, w @ x, rtol=1e-5, atol=1e-4)


def test_a_failed_build_leaves_torchs_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_NATIVE_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match="failed"):
        native.build(native.compiler(), ["-march=no-such-cpu"])
    assert not list(tmp_path.iterdir())                           # no half-written .so left to load


def test_native_decode_is_the_torch_decode(tiny_checkpoint):
    """A Mixtral checkpoint decoded natively and with the torch forms (EngineConfig.native_kernels off): the
    same greedy tokens, logits within float rounding; the native one takes the native step."""
    from engine.loader import load_model
    path = tiny_checkpoint("mixtral")
    on, off = (load_model(path, max_context=64, max_batch=1, native_kernels=n) for n in (True, False))
    assert on.native_decode and not off.native_decode
    seen = []
    on.layers[0].attn.native_block = (lambda f: lambda *a: seen.append(a[2].native) or f(*a))(on.layers[0].attn.native_block)
    with torch.inference_mode():
        (toks, rows), (want, want_rows) = (greedy(m, [5, 17, 200, 42, 99, 7], 13) for m in (on, off))
    assert toks == want
    torch.testing.assert_close(torch.stack(rows), torch.stack(want_rows), rtol=1e-4, atol=1e-4)
    assert seen and all(seen)



def test_the_cache_directory_is_systemds_else_the_users_else_a_temp_one(tmp_path, monkeypatch):
    import os
    (tmp_path / "not-a-dir").write_text("")           # a cache home nobody can make a directory in, root included
    monkeypatch.delenv("KILN_NATIVE_CACHE", raising=False)
    monkeypatch.delenv("CACHE_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-dir"))
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path))
    assert native.cache_dir() == tmp_path / f"kiln-native-{os.getuid()}"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert native.cache_dir() == tmp_path / "cache" / "kiln" / "native"
    monkeypatch.setenv("CACHE_DIRECTORY", f"{tmp_path / 'unit'}:{tmp_path / 'other'}")      # a systemd serve unit's
    assert native.cache_dir() == tmp_path / "unit" / "native"


@pytest.mark.parametrize("tiered", [True, False], ids=["ram-tier-smaller-than-the-store", "all-in-memory"])
def test_the_native_moe_half_is_the_providers_own_step(tiny_checkpoint, tmp_path, monkeypatch, tiered):
    """A one-token native decode step computes an int4 store's experts itself (MixtralBlock.native_step: route,
    the provider's host records, native.MoETail: FFNs, weighted sum, add + norm in one call): the same logits,
    bit for bit, as the provider's own forward over the same records (moe_forward), and the provider serves and
    counts the same — picks per tier, the RAM tier's hits, misses and evictions (a 4-slot tier: experts read
    from the store mid-step), lanes. Top-4, so the sum's expert order matters (two terms commute, three do not)."""
    from engine.checkpoint import Checkpoint
    from engine.loader import load_model
    from engine.store.pack import pack_store
    from engine.tiers import build_provider, in_memory
    path = tiny_checkpoint("mixtral", hidden=64, top_k=4)
    ck = Checkpoint(path)
    if tiered:
        pack_store(path, tmp_path / "s", order="cols", quant="int4")
    provider = (lambda: build_provider(ck, tmp_path / "s", ram_slots=4, readers=1)) if tiered else \
        (lambda: in_memory(ck, order="cols", quant="int4"))
    on, off = (load_model(path, provider=provider(), device="cpu", dtype="float32", max_context=64, max_batch=1)
               for _ in range(2))
    assert all(layer.mlp.tail is not None for layer in on.layers)
    for layer in off.layers:
        layer.mlp.tail = None                         # the provider's forward, as without this path
    calls = []
    monkeypatch.setattr(native.MoETail, "__call__", (lambda f: lambda *a: calls.append(1) or f(*a))(native.MoETail.__call__))
    with torch.inference_mode():
        (toks, rows), (want, want_rows) = (greedy(m, [5, 17, 200, 42, 99, 7], 12) for m in (on, off))
    assert toks == want
    for a, b in zip(rows, want_rows):
        assert torch.equal(a, b)
    assert len(calls) == 11 * len(on.layers)          # every decode step's every layer took it
    assert counts(on.provider.counters()) == counts(off.provider.counters())


def counts(c):
    """A provider's counters without its timings (the two runs' clocks differ, their counts must not)."""
    if isinstance(c, dict):
        return {k: counts(v) for k, v in c.items() if "seconds" not in k}
    return c


def test_the_engine_cli_makes_openmp_waits_spin_briefly_unless_the_caller_says(tmp_path):
    """`engine` sets GOMP_SPINCOUNT=1000 before torch loads libgomp (its millisecond default spins collapsed the
    demo's decode on a shared host, bench/README.md); a caller's GOMP_SPINCOUNT or OMP_WAIT_POLICY is kept."""
    import os
    import subprocess
    import sys
    probe = "import engine.cli, os; print(os.environ.get('GOMP_SPINCOUNT'))"
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    for extra, want in (({}, "1000"), ({"GOMP_SPINCOUNT": "7"}, "7"), ({"OMP_WAIT_POLICY": "passive"}, "None")):
        out = subprocess.run([sys.executable, "-c", probe], env={**base, **extra}, capture_output=True, text=True,
                             check=True, cwd=Path(__file__).resolve().parents[2])
        assert out.stdout.strip() == want, extra
