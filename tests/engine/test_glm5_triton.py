"""glm5_next's fused decode kernels (engine.kernels.triton_glm5) against the torch forms of engine.models.glm5_next
they replace, and a whole fused decode_static against the torch one.

On a CUDA machine they run for real. Without a GPU they still run for real through Triton's interpreter
(TRITON_INTERPRET=1) on CPU tensors, at small shapes; the model-level test makes a CPU model take the fused path by
patching triton_decode.serves_on (the one stand-in here: "this device is a GPU"), as tests/engine/test_fused_decode.py
does, so the code `engine serve --device cuda` runs inside its CUDA graphs is compared step by step with the torch step.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch carry it)")

from engine.kernels import triton_decode as td  # noqa: E402
from engine.kernels import triton_glm5 as tg  # noqa: E402
from engine.models.glm5_next import HyperConnection, _l2norm, kda_recurrent  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _rand(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


# ---------------------------------------------------------------- the GPU's compiler, without a GPU

# Each kernel compiled for an H200 (sm_90: Triton's passes and ptxas, no device touched) at GLM-5.3-Flash's shapes
# in bf16, with the launch options the wrappers use: what the interpreter cannot check (tl.dot's tile shapes, layouts,
# shared memory). Run in a subprocess: this module's kernels are the interpreter's.
AOT = r"""
import json, torch
torch.version.cuda = "12.4"          # engine.kernels imports Triton for a CUDA build of torch only
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.kernels import triton_glm5 as tg

def compile(fn, args, **options):
    sig = {n: args[n] if isinstance(args[n], str) else "constexpr" for n in fn.arg_names}
    const = {n: v for n, v in args.items() if not isinstance(v, str)}
    return triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32), options=options).metadata.shared

b, f, i, p = "*bf16", "*fp32", "i32", "fp32"
out = {"hc_dots": compile(tg._hc_dots_kernel, dict(x_ptr=b, fn_ptr=f, part_ptr=f, sq_ptr=f, K=i, CHUNK=1024, M=24,
                          BLOCK_M=32, BLOCK_K=tg.HC_BLOCK_K, SPLITS=tg.HC_SPLITS), num_warps=4),
       "hc_merge": compile(tg._hc_merge_kernel, dict(x_ptr=b, out_ptr=b, post_ptr=f, comb_ptr=f, new_ptr=b, H=i, HC=4,
                           BLOCK_HC=4, BLOCK_H=tg.HC_BLOCK_H), num_warps=4),
       "kda_decode": compile(tg._kda_decode_kernel, dict(mixed_ptr=b, fb_ptr=b, b_ptr=b, gate_ptr=b, convw_ptr=f,
                             conv_ptr=f, state_ptr=f, idx_ptr="*i64", dt_bias_ptr=f, a_log_ptr=f, onorm_ptr=f,
                             out_ptr=b, CS_SLOT=i, CS_CH=i, SS_SLOT=i, lower=p, eps=p, qscale=p, HEADS=64, D=128,
                             BLOCK_D=128, KERNEL=4, KP=4, HAS_LOWER=True), num_warps=4),
       "mla_attention": compile(tg._mla_attention_kernel, dict(qlat_ptr=b, lat_ptr=b, idx_ptr="*i64", keys_ptr="*i64",
                                valid_ptr="*u8", o_ptr=b, part_ptr=f, ml_ptr=f, QS_H=i, QS_B=i, LS_SLOT=i, LS_POS=i,
                                OS_H=i, OS_B=i, S=i, scale=p, B=i, H=64, R=512, BLOCK_R=512, BH=tg.MLA_HEADS,
                                CHUNK=128, SPLITS=32, BLOCK_N=tg.MLA_KEYS, F32=False), num_warps=8, num_stages=2),
       "mla_combine": compile(tg._mla_combine_kernel, dict(part_ptr=f, ml_ptr=f, o_ptr=b, R=512, BLOCK_R=512,
                              SPLITS=32), num_warps=4),
       "indexer_scores": compile(tg._indexer_scores_kernel, dict(q_ptr=b, w_ptr=b, index_ptr=b, ape_ptr=f,
                                 idx_ptr="*i64", pos_ptr="*i64", out_ptr=f, IS_SLOT=i, IS_POS=i, P=i, wscale=p,
                                 qscale=p, IH=32, BLOCK_IH=32, D=128, BLOCK_D=128, KP=16, BP=tg.INDEX_POOLS,
                                 F32=False), num_warps=4)}
for tokens, block_h in ((1, 256), (16, 64)):         # hc_pre's tiles for one sequence and for 16
    out[f"hc_mix_{tokens}"] = compile(tg._hc_mix_kernel, dict(x_ptr=b, part_ptr=f, sq_ptr=f, base_ptr=f, scale_ptr=f,
                                      post_ptr=f, comb_ptr=f, out_ptr=b, N=i, K=i, H=i, eps=p, hc_eps=p, HC=4,
                                      BLOCK_HC=4, ITERS=20, BLOCK_M=32, SPLITS=tg.HC_SPLITS, BLOCK_T=tokens,
                                      BLOCK_H=block_h), num_warps=4)
print(json.dumps(out))
"""


@pytest.mark.skipif(CUDA, reason="on a GPU the kernels compile and run for real")
def test_the_kernels_compile_for_an_h200_at_glm_5_3_flash_shapes():
    import json
    import subprocess
    import sys
    from pathlib import Path
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", AOT], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr[-4000:]
    shared = json.loads(run.stdout.splitlines()[-1])
    assert len(shared) == 8
    assert max(shared.values()) <= 232448, shared        # an H200 block's shared memory (227 KiB)


# ---------------------------------------------------------------- mHC

def _hc(g, hc, hidden, iters):
    m = (2 + hc) * hc
    return SimpleNamespace(fn=_rand(g, m, hc * hidden, scale=0.05), base=_rand(g, m), scale=_rand(g, 3) + 1,
                           hc=hc, iters=iters, hc_eps=1e-6, eps=1e-5)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_hc_pre_and_merge_are_the_hyper_connection(dtype, tol):
    g = torch.Generator().manual_seed(0)
    hc, hidden, n = 4, 96, 3                      # 96: the hidden blocks' mask is exercised
    w = _hc(g, hc, hidden, iters=20)
    streams = _rand(g, n, hc, hidden, dtype=dtype)
    post, comb, collapsed = HyperConnection.__call__(w, streams)
    got_post, got_comb, got_collapsed = tg.hc_pre(streams, w.fn, w.base, w.scale, iters=w.iters, hc_eps=w.hc_eps,
                                                  eps=w.eps)
    assert rel(got_post, post) < 1e-5 and rel(got_comb, comb) < 1e-5
    assert got_collapsed.dtype == dtype and rel(got_collapsed, collapsed) < tol
    # comb is doubly stochastic after Sinkhorn: rows and columns sum to ~1 (not a trivially equal pair of zeros)
    torch.testing.assert_close(got_comb.sum(-2).cpu(), torch.ones(n, hc), atol=1e-3, rtol=0)
    out = _rand(g, n, hidden, dtype=dtype)
    want = HyperConnection.merge(post, comb, out, streams)
    got = tg.hc_merge(post, comb, out, streams)
    assert got.dtype == dtype and rel(got, want) < tol
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------- KDA

def _torch_kda(mixed, f_b, b_proj, gate, w, conv, state, idx):
    """LinearAttention's torch decode (forget_gate, _decode, the output norm) on the same inputs."""
    heads, d = w.a_log.shape[0], w.o_norm.shape[0]
    n = mixed.shape[0]
    gr = (f_b.float() + w.dt_bias).view(n, heads, d)
    rate = w.a_log.exp().view(heads, 1)
    g = w.lower * torch.sigmoid(rate * gr) if w.lower is not None else \
        -rate * torch.where(gr > 20.0, gr, torch.log1p(torch.exp(gr)))
    beta = torch.sigmoid(b_proj.float())
    x = torch.cat([conv[idx], mixed.float().unsqueeze(-1)], dim=-1)
    conv[idx] = x[..., 1:]
    y = F.silu((x * w.conv).sum(-1))
    q, k, v = (t.reshape(n, heads, d) for t in y.split(y.shape[1] // 3, dim=1))
    q, k = _l2norm(q) * d ** -0.5, _l2norm(k)
    core, new = kda_recurrent(q[None], k[None], v[None], g[None], beta[None], state[idx])
    state[idx] = new
    core = core[0]
    out = core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + w.eps) * w.o_norm
    return (out * torch.sigmoid(gate.view(n, heads, d).float())).to(mixed.dtype).reshape(n, -1)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("lower", [-5.0, None])
def test_kda_decode_is_the_conv_the_delta_rule_and_the_gated_norm(dtype, tol, lower):
    g = torch.Generator().manual_seed(1)
    heads, d, kernel, slots, steps = 3, 16, 4, 4, 3
    qkv = heads * d
    w = SimpleNamespace(conv=_rand(g, 3 * qkv, kernel, scale=0.5), dt_bias=_rand(g, qkv), a_log=_rand(g, heads) * 0.5,
                        o_norm=_rand(g, d) + 1, lower=lower, eps=1e-5)
    conv = [_rand(g, slots, 3 * qkv, kernel - 1)] * 2
    state = [_rand(g, slots, heads, d, d, scale=0.1)] * 2
    conv, state = [c.clone() for c in conv], [s.clone() for s in state]
    idx = torch.tensor([2, 0], device=DEV)
    for _ in range(steps):              # several tokens: the window shifts and the state carries
        mixed, f_b = _rand(g, 2, 3 * qkv, dtype=dtype), _rand(g, 2, qkv, dtype=dtype, scale=3)
        b_proj, gate = _rand(g, 2, heads, dtype=dtype), _rand(g, 2, qkv, dtype=dtype)
        want = _torch_kda(mixed, f_b, b_proj, gate, w, conv[0], state[0], idx)
        got = tg.kda_decode(mixed, f_b, b_proj, gate, w.conv, conv[1], state[1], idx, dt_bias=w.dt_bias,
                            a_log=w.a_log, o_norm=w.o_norm, lower=lower, eps=w.eps)
        assert got.dtype == dtype and rel(got, want) < tol
    torch.testing.assert_close(conv[1], conv[0], atol=0, rtol=0)           # the windows: copies of the inputs
    torch.testing.assert_close(state[1], state[0], atol=1e-5, rtol=1e-4)
    assert torch.equal(state[1][1], state[0][1]) and not torch.equal(state[1][1], state[1][0])  # slot 1: untouched


# ---------------------------------------------------------------- MLA

def _torch_mla(q, kv_b, latent, idx, keys, valid, nope, scale):
    """SparseAttention._static's expanded form: the selected latent rows through kv_b, then SDPA, masked."""
    b, heads, _ = q.shape
    big = torch.iinfo(keys.dtype).max
    keys = torch.sort(torch.where(valid, keys, big), dim=1).values
    valid = keys != big
    cache = latent[idx[:, None], torch.where(valid, keys, 0)]
    kv = F.linear(cache, kv_b).view(b, keys.shape[1], heads, -1)
    k, v = kv.split([nope, kv.shape[-1] - nope], dim=-1)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=valid[:, None, None, :], scale=scale)
    return o.reshape(b, -1)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("n_keys", [12, 300])          # 300: more keys than one program takes, split and combined
def test_mla_decode_with_absorbed_projections_equals_the_expanded_form(dtype, tol, n_keys):
    g = torch.Generator().manual_seed(2)
    b, heads, nope, vd, rank, slots, max_len = 2, 3, 16, 32, 32, 3, 320
    q = _rand(g, b, heads, nope, dtype=dtype)
    kv_b = _rand(g, heads * (nope + vd), rank, dtype=dtype, scale=0.3)
    latent = _rand(g, slots, max_len, rank, dtype=dtype)
    idx = torch.tensor([2, 0], device=DEV)
    keys = torch.stack([torch.randperm(max_len, generator=g)[:n_keys] for _ in range(b)]).to(DEV)
    valid = torch.rand(b, n_keys, generator=g).to(DEV) < 0.7           # the selection's masked padding
    keys = torch.where(valid, keys, max_len + 5)                         # a padding key may lie past the cache
    want = _torch_mla(q, kv_b, latent, idx, keys, valid, nope, nope ** -0.5)
    got = tg.mla_decode(q, kv_b, latent, idx, keys, valid, nope=nope, scale=nope ** -0.5)
    assert got.shape == (b, heads * vd) and got.dtype == dtype
    assert rel(got, want) < tol


def test_warm_mla_compiles_each_variant_once_and_leaves_the_cache_alone():
    g = torch.Generator().manual_seed(10)
    heads, nope, vd, rank = 2, 16, 16, 16
    kv_b = _rand(g, heads * (nope + vd), rank)
    latent = _rand(g, 2, 320, rank)
    before = latent.clone()
    # 12 and 16 keys: one program (16 divisible by 16: its own specialisation); 300: split over programs
    assert tg.warm_mla(kv_b, latent, [12, 16, 300, 12, 28], heads=heads, nope=nope, scale=0.25) == 3
    assert torch.equal(latent, before)


# ---------------------------------------------------------------- DSA indexer

def _indexer(g, fused, *, heads, hd, kpool, topk, hidden, slots, max_len, dtype, ties):
    """An Indexer's select_static on the real code, its weights random (the projections: engine's Projection)."""
    from engine.dense_weights import Projection
    from engine.models.glm5_next import Indexer
    ix = Indexer.__new__(Indexer)
    weights = torch.zeros(heads, hidden) if ties else torch.randn(heads, hidden, generator=g)
    ix.caches = SimpleNamespace(index=None)
    ix.row, ix.fused, ix.heads, ix.hd, ix.kpool, ix.pools = 0, fused, heads, hd, kpool, topk // kpool
    ix.wq_b = Projection((torch.randn(heads * hd, 24, generator=g) * 0.3).to(dtype).to(DEV))
    ix.weights = Projection(weights.to(dtype).to(DEV))
    ix.ape = _rand(g, kpool, hd)
    return ix


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ties", [False, True])
def test_indexer_scores_select_the_same_pools_as_the_torch_step(dtype, ties):
    """select_static with the fused scores against its torch form: the same keys and masks, exact; with ties
    (weights of zero: every pool scores 0.0) the lower pools win in both (decode_static's tie order)."""
    from engine.models.glm5_next import StaticDecode
    heads, hd, kpool, topk, hidden, slots, max_len = 16, 16, 4, 16, 32, 3, 200
    picked = []
    for fused in (False, True):
        g = torch.Generator().manual_seed(3)
        ix = _indexer(g, fused, heads=heads, hd=hd, kpool=kpool, topk=topk, hidden=hidden, slots=slots,
                      max_len=max_len, dtype=dtype, ties=ties)
        ix.caches.index = _rand(g, 1, slots, max_len, 2 * hd, dtype=dtype)     # one layer
        h, q_resid = _rand(g, 3, hidden, dtype=dtype), _rand(g, 3, 24, dtype=dtype)
        st = StaticDecode(torch.tensor([1, 2, 0], device=DEV), torch.tensor([150, 37, 9], device=DEV), kv_len=160)
        picked.append(ix.select_static(h, q_resid, st))
    (keys, ok), (fkeys, fok) = picked
    assert keys.shape == (3, topk + kpool)
    assert torch.equal(fok, ok) and torch.equal(torch.where(ok, fkeys, -1), torch.where(ok, keys, -1))
    if ties:                            # the lowest visible pools, then the tail
        assert keys[0, :topk].tolist() == list(range(topk))
    else:                               # the scores really choose: not simply the first pools
        assert keys[0, :topk].tolist() != list(range(topk))


# ---------------------------------------------------------------- the whole step

@pytest.fixture(scope="module")
def flat_ckpt(tmp_path_factory):
    from tests.fixtures.tiny_models import make_flat_glm5_next
    return make_flat_glm5_next(tmp_path_factory.mktemp("glm5_flat"))


STEPS = 16 if CUDA else 3     # the interpreter: seconds a step; 3 still complete a pool in each sequence


def test_a_fused_static_decode_equals_the_torch_static_decode(flat_ckpt, monkeypatch):
    """Three sequences of different lengths (prompts past index_topk: the selection drops keys), STEPS greedy steps of
    decode_static, on the fused kernels and on the torch forms, from the same prefilled states: the same logits to
    float tolerance (the MLA is reassociated) and the same tokens, and the same KDA states after."""
    from engine.kv_cache import kv_bucket
    from engine.loader import load_model

    dev = "cuda" if CUDA else "cpu"
    plain = load_model(flat_ckpt, device=dev, dtype="float32", max_context=96, max_batch=3, fused_kernels=False,
                       cuda_graphs=False)
    if not CUDA:
        monkeypatch.setattr(td, "serves_on", lambda device: True)
    fused = load_model(flat_ckpt, device=dev, dtype="float32", max_context=96, max_batch=3, cuda_graphs=False)
    assert fused.fused and not plain.fused
    tokens = torch.randint(0, 384, (64,), generator=torch.Generator().manual_seed(4)).tolist()
    prompts = [tokens[:9], tokens[3:45], tokens[20:43]]     # pools complete at 11, 43, 23
    slots = [2, 0, 1]
    with torch.inference_mode():
        seqs = []
        for p, s in zip(prompts, slots):
            a, b = plain.prefill(p, s), fused.prefill(p, s)         # prefill: the torch forms in both
            torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
            seqs.append(p + [int(a.argmax())])
        idx = torch.tensor(slots, device=dev)
        for _ in range(STEPS):
            ids = torch.tensor([s[-1] for s in seqs], device=dev)
            pos = torch.tensor([len(s) - 1 for s in seqs], device=dev)
            kv_len = kv_bucket(max(len(s) for s in seqs), plain.max_len)
            want = plain.decode_static(ids, idx, pos, kv_len)
            got = fused.decode_static(ids, idx, pos, kv_len)
            torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
            assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
            for s, t in zip(seqs, want.argmax(-1).tolist()):
                s.append(t)
        # decode_step without graphs: the fused model takes the same fused static step
        last = ([s[-1] for s in seqs], slots, [len(s) - 1 for s in seqs])
        torch.testing.assert_close(fused.decode_step(*last), plain.decode_step(*last), atol=2e-4, rtol=0)
        torch.testing.assert_close(fused.caches.state, plain.caches.state, atol=1e-5, rtol=0)
        torch.testing.assert_close(fused.caches.conv, plain.caches.conv, atol=1e-4, rtol=0)
    assert len({t for s in seqs for t in s[-STEPS:]}) > 3         # the tokens vary: the comparison compares something


# ---------------------------------------------------------------- prefill

@pytest.mark.parametrize("group_bytes", [1, None])     # 1: one chunk at a time; None: all of them in one group
def test_kda_chunked_equals_the_recurrent_form_whatever_its_chunk_groups(monkeypatch, group_bytes):
    """Prefill's chunked KDA (on CPU and CUDA alike, for any segment past one token) against the token-by-token
    recurrence, over three chunks (the last one padded) from a non-zero state, chunk groups of one or all."""
    from engine.models import glm5_next
    if group_bytes is not None:
        monkeypatch.setattr(glm5_next, "KDA_GROUP_BYTES", group_bytes)
    g = torch.Generator().manual_seed(6)
    t, heads, d = 150, 2, 16
    q, k = _l2norm(torch.randn(t, heads, d, generator=g)) * d ** -0.5, _l2norm(torch.randn(t, heads, d, generator=g))
    v = torch.randn(t, heads, d, generator=g)
    gate = -5.0 * torch.sigmoid(torch.randn(t, heads, d, generator=g))     # the lower-bounded forget gate
    beta = torch.sigmoid(torch.randn(t, heads, generator=g))
    state = torch.randn(heads, d, d, generator=g) * 0.1
    want, want_state = kda_recurrent(q, k, v, gate, beta, state)
    got, got_state = glm5_next.kda_chunked(q, k, v, gate, beta, state)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got_state, want_state, atol=1e-5, rtol=1e-4)


def test_a_prefill_attends_in_query_blocks_with_the_same_logits(flat_ckpt, monkeypatch):
    """DSA prefill selects and attends PREFILL_QUERIES queries at a time (its masks and scores are [queries, keys]:
    O(T²) for a long prompt in one piece); blocks of 8 — pools of 4 split across blocks, a shared layer reading the
    full layer's block masks — give the logits of one block."""
    from engine.loader import load_model
    from engine.models import glm5_next
    model = load_model(flat_ckpt, dtype="float32", max_context=96, max_batch=1, fused_kernels=False)
    tokens = torch.randint(0, 384, (70,), generator=torch.Generator().manual_seed(8)).tolist()
    with torch.inference_mode():
        whole = model.prefill(tokens, 0, all_logits=True)
        monkeypatch.setattr(glm5_next, "PREFILL_QUERIES", 8)
        assert len(list(glm5_next.query_blocks([glm5_next.Segment(0, 0, 0, 70)]))) == 9
        blocked = model.prefill(tokens, 0, all_logits=True)
    torch.testing.assert_close(blocked, whole, atol=1e-5, rtol=0)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device: the fused step inside captured CUDA graphs")
def test_cuda_graphs_replay_the_fused_step_as_the_torch_step(flat_ckpt):
    """engine serve --device cuda's decode: graphs captured around the fused decode_static, against graphs of the
    torch forms (fused_kernels off), three sequences of different lengths, 24 greedy steps, fp32."""
    from engine.loader import load_model
    tokens = torch.randint(0, 384, (64,), generator=torch.Generator().manual_seed(9)).tolist()
    prompts, slots = [tokens[:9], tokens[:40], tokens[5:28]], [1, 0, 2]
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    runs = {}
    try:
        for fused in (True, False):
            model = load_model(flat_ckpt, device="cuda", dtype="float32", max_context=128, max_batch=3,
                               cuda_graphs=True, fused_kernels=fused)
            assert model.fused == fused and model.graphs is not None
            with torch.inference_mode():
                seqs = [p + [int(model.prefill(p, s).argmax())] for p, s in zip(prompts, slots)]
                rows = []
                for _ in range(24):
                    out = model.decode_step([q[-1] for q in seqs], slots, [len(q) - 1 for q in seqs])
                    rows.append(out.float().cpu())
                    for q, t in zip(seqs, out.argmax(-1).tolist()):
                        q.append(t)
            assert model.graphs.replays == 24
            runs[fused] = torch.stack(rows), seqs
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    torch.testing.assert_close(runs[True][0], runs[False][0], atol=2e-4, rtol=0)
    assert runs[True][1] == runs[False][1]
