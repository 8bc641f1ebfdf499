"""Exact prefill (issue 32, "outputs are identical with and without the prefix cache") on the demo's quantized CPU
path: a position's keys, values and logits have the same bits whether it came from one whole prefill, a chunked
prefill of other lengths, or decode steps (MoEModel.exact_prefill: prefill runs the decode step's native kernels
row by row). So a prefix the cache reuses — computed by the last turn's decode steps or by a prefill of another
length — is what a fresh prefill computes, and greedy replies are equal with and without the cache.

The model is the demo's pipeline in miniature: a tiny dense Llama written as a Q4_1 GGUF (tests/fixtures/tiny_gguf.py),
converted as the recipe converts SmolLM2 (8 identical experts, top-1, the attention kept as the file's Q4_1 blocks)
and its experts packed as the GGUF's own blocks (store quant gguf, cols order). The real demo store is the slow test.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from engine.kernels import native

NATIVE = pytest.mark.skipif(native.lib() is None, reason="no C++ compiler: the native kernels are not built")

ENGINE = [str(Path(sys.executable).parent / "engine")]


def tokens(seed: int, n: int, vocab: int = 380) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, vocab) for _ in range(n)]


@pytest.fixture(scope="module")
def demo_shaped(tmp_path_factory):
    """(checkpoint with Q4_1 attention blocks and no expert weights, its store of the GGUF's expert blocks)."""
    pytest.importorskip("gguf")
    from engine.convert import convert_gguf
    from engine.store.pack import pack_store
    from tests.fixtures.tiny_gguf import make_tiny_llama, write_gguf
    d = tmp_path_factory.mktemp("exact")
    # hidden 256: head_dim 64, so q (256), k and v (128 each) and o are whole 64-row tiles of the int4 operand
    gguf = write_gguf(make_tiny_llama(d / "llama", layers=2, hidden=256, seed=3), d / "tiny.Q4_1.gguf", qtype="Q4_1")
    kept = convert_gguf(gguf, d / "model", experts=8, top_k=1, seed=0, expert_weights=False, attention_blocks=True)
    pack_store(kept, d / "store", order="cols", quant="gguf", gguf=gguf)
    return kept, d / "store"


@pytest.fixture(scope="module")
def model(demo_shaped):
    from engine.loader import load_model
    kept, store = demo_shaped
    m = load_model(kept, store_dir=store, device="cpu", max_context=128, max_batch=4)
    assert m.native_decode and m.exact_prefill        # the demo's path: 4-bit attention blocks, native MoE tail
    return m


def decode_from(model, toks: list[int], slot: int, k: int) -> list[torch.Tensor]:
    """Prefill toks[:k] into `slot`, then decode the rest one token at a time → the logits after each token
    from position k-1 on."""
    out = [model.prefill(toks[:k], slot)]
    for p in range(k, len(toks)):
        out.append(model.decode_step([toks[p]], [slot], [p])[0])
    return out


def kv(model, slot: int, n: int):
    return model.kv.k[:, slot, :n].clone(), model.kv.v[:, slot, :n].clone()


@NATIVE
def test_prefill_chunked_prefill_and_decode_give_the_same_bits(model):
    n = 37
    toks = tokens(1, n)
    with torch.inference_mode():
        whole = model.prefill(toks, 0, all_logits=True)
        k_whole, v_whole = kv(model, 0, n)
        stepped = decode_from(model, toks, 1, 5)                 # prefill of 5, then 32 decode steps
        k_dec, v_dec = kv(model, 1, n)
        chunks, done = [], 0
        for size in (3, 11, 1, 16, 6):                           # a chunked prefill of other lengths
            chunks.append(model.prefill(toks[done:done + size], 2, start=done, all_logits=True))
            done += size
        assert done == n
        k_chunk, v_chunk = kv(model, 2, n)
    assert torch.equal(k_dec, k_whole) and torch.equal(v_dec, v_whole)
    assert torch.equal(k_chunk, k_whole) and torch.equal(v_chunk, v_whole)
    assert torch.equal(torch.stack(stepped), whole[4:])          # logits after tokens 4..36, bit for bit
    assert torch.equal(torch.cat(chunks), whole)


@NATIVE
def test_a_layers_experts_in_one_native_call_are_its_per_expert_loop(model):
    """MixtralBlock.native_rows' one call for every picked expert (native.moe_rows, where all are resident) against
    its per-expert loop (taken where a record is not resident, forced here): the same keys, values and logits bit
    for bit, and the one call taken in every layer."""
    n = 40
    toks = tokens(6, n)
    calls, orig = [], native.moe_rows
    native.moe_rows = lambda *a: calls.append(1) or orig(*a)
    try:
        with torch.inference_mode():
            one, kv_one = model.prefill(toks, 0, all_logits=True), kv(model, 0, n)
    finally:
        native.moe_rows = orig
    assert len(calls) == len(model.layers)
    model.provider.host_record_table = lambda *a: None          # as if a record were not resident
    try:
        with torch.inference_mode():
            loop, kv_loop = model.prefill(toks, 1, all_logits=True), kv(model, 1, n)
    finally:
        del model.provider.host_record_table
    assert torch.equal(one, loop)
    assert all(torch.equal(a, b) for a, b in zip(kv_one, kv_loop))

@NATIVE
def test_a_decode_step_in_one_native_call_is_the_layer_walk(demo_shaped, threads):
    """native.DecodeLayers (a one-token step's layers in one call) against the per-layer walk it replaces
    (MoEModel._run_native's loop): the same logits bit for bit, and the provider serves and counts the same picks
    per tier, RAM hits, misses and evictions. A 3-slot RAM tier for 16 records, so layers' records are missing
    mid-step: the call comes back, the walk's own host_records reads them, and it resumes there."""
    from engine.loader import load_model
    from tests.engine.test_native_cpu import counts
    from tests.fixtures.decode import greedy
    kept, store = demo_shaped
    one, walk = (load_model(kept, store_dir=store, device="cpu", max_context=128, max_batch=1, ram_slots=3)
                 for _ in range(2))
    walk._step_layers = False                    # the per-layer walk, as before this path
    stops = []
    orig = native.DecodeLayers.__call__
    native.DecodeLayers.__call__ = lambda self, *a: stops.append(orig(self, *a)) or stops[-1]
    try:
        with torch.inference_mode():
            prompt = tokens(4, 9)
            (toks, rows), (want, want_rows) = (greedy(m, prompt, 24) for m in (one, walk))
    finally:
        native.DecodeLayers.__call__ = orig
    assert isinstance(one._step_layers, native.DecodeLayers)
    assert toks == want
    for a, b in zip(rows, want_rows):
        assert torch.equal(a, b)
    assert counts(one.provider.counters()) == counts(walk.provider.counters())
    layers = len(one.layers)
    assert stops.count(layers) == 23                  # every decode step finished in it ...
    assert any(s < layers for s in stops)             # ... some after a layer's records were read mid-step


@NATIVE
def test_exact_prefill_is_the_torch_forms_function(demo_shaped, model):
    """The rows path computes the model's function: the torch forms' prefill (native kernels off) within the
    bf16 activations' rounding, the same greedy token."""
    from engine.loader import load_model
    kept, store = demo_shaped
    off = load_model(kept, store_dir=store, device="cpu", max_context=128, max_batch=1, native_kernels=False)
    assert not off.exact_prefill
    toks = tokens(2, 30)
    with torch.inference_mode():
        got, want = model.prefill(toks, 3, all_logits=True), off.prefill(toks, 0, all_logits=True)
    assert (got - want).abs().max() < 0.02 * want.abs().max()
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.999
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@NATIVE
@pytest.mark.parametrize("threads", [1, 2])
def test_the_rows_kernels_are_the_one_row_kernels_row_by_row(threads):
    """The expert FFN (two int4 GEMVs around SwiGLU), the Q8_0 GEMV and the attention on M rows: each row bit-equal
    to its own one-row call, on one thread or two."""
    from engine.dense_weights import Q8Projection
    from engine.quant.records import QuantLayout
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(5)
        m = 7
        lay = QuantLayout(576, 1536, "int4", "cols")                  # the demo's expert shape
        rec = lay.pack(*(torch.randn(s, generator=gen) * 0.05 for s in ((1536, 576), (1536, 576), (576, 1536))))
        x = torch.randn(m, 576, generator=gen)
        tail = native.MoETail(lay.regions, 576, 1536, 32, 1)
        ones = torch.stack([native.int4_ffn(x[i].contiguous(), rec, lay.regions, 32) for i in range(m)])
        for rows in (2, 3, 4, 5, m):     # 2-4 rows: the tiles in registers (int4_tile_bf16_few); more: unpacked once
            assert torch.equal(native.int4_ffn_rows(x[:rows].contiguous(), rec.data_ptr(), tail), ones[:rows])

        q = torch.randint(-127, 128, (70, 576), generator=gen, dtype=torch.int8)
        d = torch.rand(70, 576 // 32, generator=gen) * 0.01
        q8 = Q8Projection(q, d)
        assert torch.equal(q8(x), torch.stack([q8(x[i]) for i in range(m)]))

        nh, nkv, hd, max_len, start = 9, 3, 64, 64, 20
        for window in (0, 9):
            qkv = torch.randn(m, (nh + 2 * nkv) * hd, generator=gen)
            cos, sin = torch.randn(m, hd, generator=gen), torch.randn(m, hd, generator=gen)
            kc, vc = torch.randn(max_len, nkv, hd, generator=gen), torch.randn(max_len, nkv, hd, generator=gen)
            kc2, vc2, qkv2 = kc.clone(), vc.clone(), qkv.clone()
            rows = native.attn_rows(qkv, cos, sin, kc, vc, start, window, nh, nkv, hd, hd ** -0.5)
            ones = [native.attn_decode(qkv2[i], cos[i].contiguous(), sin[i].contiguous(), kc2, vc2, start + i, window,
                                       nh, nkv, hd, hd ** -0.5, torch.empty(nh * max_len)) for i in range(m)]
            assert torch.equal(rows, torch.stack(ones))
            assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    finally:
        torch.set_num_threads(before)



def avx512() -> bool:
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@NATIVE
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("nh,nkv,hd,start,m,window", [
    (9, 3, 64, 300, 23, 0),      # the demo's heads, a later chat turn's rows over a long prefix
    (9, 3, 64, 0, 40, 0),        # a first turn: every row's keys are the rows before it
    (8, 2, 128, 130, 9, 0),      # groups of 4 heads, head size 128
    (10, 2, 32, 70, 6, 0),       # groups of 5: one of 4 heads, then one
    (9, 3, 64, 200, 20, 50),     # a sliding window (the first rows' keys start past 0)
    (6, 3, 64, 33, 3, 16),
    (12, 4, 48, 40, 5, 0),       # a head size the fast path does not take: attend_head row by row
])
def test_attention_on_many_rows_is_each_rows_decode_attention(threads, nh, nkv, hd, start, m, window):
    """attn_rows (the keys-in-lanes kernel where exact_attend_fast) against attn_decode on each row in turn, which
    attends through attend_head: the same outputs and KV rows bit for bit, over long prefixes, windows, GQA groups
    of 1-5 heads and head sizes 32-128. Scores spread past expf's special range (|x| >= 88) in some rows."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(start + m)
        max_len = start + m + 5
        qkv = torch.randn(m, (nh + 2 * nkv) * hd, generator=gen) * 2
        cos, sin = torch.randn(m, hd, generator=gen), torch.randn(m, hd, generator=gen)
        kc, vc = torch.randn(max_len, nkv, hd, generator=gen) * 3, torch.randn(max_len, nkv, hd, generator=gen)
        kc2, vc2, qkv2 = kc.clone(), vc.clone(), qkv.clone()
        rows = native.attn_rows(qkv, cos, sin, kc, vc, start, window, nh, nkv, hd, hd ** -0.5)
        ones = [native.attn_decode(qkv2[i], cos[i].contiguous(), sin[i].contiguous(), kc2, vc2, start + i, window,
                                   nh, nkv, hd, hd ** -0.5, torch.empty(nh * max_len)) for i in range(m)]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(rows, torch.stack(ones))
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert native.exact_attend_fast(hd) == (avx512() and hd in (32, 64, 128))


@NATIVE
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("nh,nkv,hd,p,window", [(9, 3, 64, 600, 0), (9, 3, 64, 0, 0), (8, 2, 128, 301, 0),
                                                (8, 8, 32, 17, 0), (9, 3, 64, 700, 100), (12, 4, 48, 40, 0)])
def test_the_direct_decode_attention_is_attn_decode(threads, nh, nkv, hd, p, window):
    """attn_decode_direct (one token's heads through attend_one_direct: no keys transposed) against attn_decode:
    the same output and KV rows bit for bit, on the fast path where the host has AVX-512 and hd is 32/64/128."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(p + hd)
        kc, vc = torch.randn(p + 8, nkv, hd, generator=gen) * 3, torch.randn(p + 8, nkv, hd, generator=gen)
        qkv = torch.randn((nh + 2 * nkv) * hd, generator=gen) * 2
        cos, sin = torch.randn(hd, generator=gen), torch.randn(hd, generator=gen)
        kc2, vc2 = kc.clone(), vc.clone()
        want = native.attn_decode(qkv.clone(), cos, sin, kc, vc, p, window, nh, nkv, hd, hd ** -0.5,
                                  torch.empty(nh * (p + 1)))
        got = native.attn_decode_direct(qkv.clone(), cos, sin, kc2, vc2, p, window, nh, nkv, hd, hd ** -0.5,
                                        torch.empty(nh * (p + 1)))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, want)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert bool(native.lib().attn_decode_direct_ok(hd)) == (avx512() and hd in (32, 64, 128))

@NATIVE
@pytest.mark.skipif(not avx512(), reason="the keys-in-lanes attention is AVX-512 only")
def test_the_vector_expf_is_glibcs_expf_bit_for_bit():
    """The attention's 16-wide expf (glibc's e_expf.c algorithm) against std::exp on every 97th float bit pattern
    (44M of them: negatives, positives, subnormals, the special range, infinities, NaNs); the slow test below
    takes all 2^32."""
    assert native.lib().exact_expf_mismatches(0, 0xFFFFFFFF, 97) == 0


@NATIVE
@pytest.mark.slow
@pytest.mark.skipif(not avx512(), reason="the keys-in-lanes attention is AVX-512 only")
def test_the_vector_expf_is_glibcs_expf_on_every_float():
    assert native.lib().exact_expf_mismatches(0, 0xFFFFFFFF, 1) == 0     # ~50 s

@NATIVE
@pytest.mark.slow
def test_the_real_demo_model_prefills_decodes_and_chunks_to_the_same_bits(tmp_path):
    """SmolLM2 as the recipe converts and packs it (Q4_1 attention blocks, 8 experts top-1 from the GGUF's own
    blocks, the tied Q8_0 vocabulary): the same bits from a whole prefill, prefill + decode and chunks (~1 min)."""
    pytest.importorskip("gguf")
    from engine.convert import convert_gguf
    from engine.dense_weights import Q8Projection
    from engine.loader import load_model
    from engine.store.pack import pack_store
    from tests.fixtures.smollm2 import smollm2_gguf
    gguf = smollm2_gguf()
    kept = convert_gguf(gguf, tmp_path / "model", experts=8, top_k=1, seed=0, expert_weights=False,
                        attention_blocks=True)
    pack_store(kept, tmp_path / "store", order="cols", quant="gguf", gguf=gguf)
    m = load_model(kept, store_dir=tmp_path / "store", device="cpu", max_context=256, max_batch=3)
    assert m.exact_prefill and isinstance(m.head, Q8Projection)
    n = 48
    toks = tokens(4, n, 49000)
    with torch.inference_mode():
        whole = m.prefill(toks, 0, all_logits=True)
        stepped = decode_from(m, toks, 1, 9)
        done = 0
        for size in (17, 2, 29):
            m.prefill(toks[done:done + size], 2, start=done)
            done += size
    for s in (1, 2):
        assert torch.equal(m.kv.k[:, s, :n], m.kv.k[:, 0, :n]) and torch.equal(m.kv.v[:, s, :n], m.kv.v[:, 0, :n])
    assert torch.equal(torch.stack(stepped), whole[8:])

def chat(client, name: str, turns: list[str], reply_tokens: int) -> list[str]:
    """A scripted chat through /v1/chat/completions: each reply greedy, appended to the history as a client does."""
    messages = [{"role": "system", "content": "You answer briefly. " * 4}]
    replies = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        r = client.post("/v1/chat/completions", json={"model": name, "messages": messages, "max_tokens": reply_tokens,
                                                      "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        reply = r.json()["choices"][0]["message"]["content"]
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply})
    return replies


@NATIVE
def test_a_steps_picks_booked_at_once_count_as_booked_layer_by_layer(demo_shaped):
    """TieredExperts.book_host_records (a DecodeLayers step's resident picks booked in a few calls) against the
    per-layer host_records it replaces (the provider's default): the same tokens, counters, planner counts and
    RAM tier order (LRU), step after step, with a plan made inside the window (a plan every 8 picks a layer)."""
    from engine.experts.provider import ExpertProvider
    from engine.loader import load_model
    from tests.engine.test_native_cpu import counts
    from tests.fixtures.decode import greedy
    kept, store = demo_shaped
    fast, slow = (load_model(kept, store_dir=store, device="cpu", max_context=128, max_batch=1) for _ in range(2))
    slow.provider.book_host_records = lambda first, picks: ExpertProvider.book_host_records(slow.provider, first, picks)
    calls = {id(fast): 0, id(slow): 0}
    for m in (fast, slow):
        m.provider.planner.every = 8
        one = m.provider.host_records
        m.provider.host_records = lambda *a, one=one, m=m: calls.__setitem__(id(m), calls[id(m)] + 1) or one(*a)
    with torch.inference_mode():
        (toks, _), (want, _) = (greedy(m, tokens(9, 7), 20) for m in (fast, slow))
    assert toks == want
    assert calls[id(slow)] - calls[id(fast)] == 19 * len(fast.layers)       # 19 steps' layers booked at once
    assert counts(fast.provider.counters()) == counts(slow.provider.counters())
    assert fast.provider.planner.replans == slow.provider.planner.replans >= 2
    assert (fast.provider.planner.counts == slow.provider.planner.counts).all()
    assert list(fast.provider.ram.cache.policy._order) == list(slow.provider.ram.cache.policy._order)


@NATIVE
def test_greedy_chat_replies_through_the_server_are_the_same_with_and_without_the_prefix_cache(demo_shaped):
    """The engine with and without the prefix cache behind the real server, one scripted six-turn chat each: every
    reply equal, the cached one reused each last turn's positions, and every decode step's logits (read where
    the scheduler gets them) are the same bits — what makes equal replies hold on near-ties too, where the tiny
    model's replies alone would not tell (they agree without exact prefill as well)."""
    import httpx

    from engine.llm import LLM
    from engine.server.app import create_app
    from tests.fixtures.served import Served
    kept, store = demo_shaped
    turns = ["plant soil water sun", "tomato carrot lettuce", "when to sow garlic", "slugs and snails",
             "compost heap", "pumpkin ripe"]
    replies, counters, logits = {}, {}, {}
    for cached in (True, False):
        with LLM.load(kept, store_dir=store, max_context=1024, max_batch=2, prefix_cache=cached) as llm, \
                Served(create_app(llm, served_name="tiny")) as s, httpx.Client(base_url=s.url, timeout=120) as c:
            assert llm.model.exact_prefill
            seen = logits[cached] = []
            step = llm.model.decode_step
            llm.model.decode_step = lambda *a, step=step, seen=seen: seen.append(step(*a)) or seen[-1]
            replies[cached] = chat(c, "tiny", turns, 24)
            counters[cached] = llm.counters()
    assert replies[True] == replies[False]
    assert len(logits[True]) == len(logits[False]) == len(turns) * 23
    assert all(torch.equal(a, b) for a, b in zip(logits[True], logits[False]))
    assert counters[True]["prefix_cache_hits_total"] >= len(turns) - 1
    assert counters[True]["prefix_cache_reused_tokens_total"] >= 16 * (len(turns) - 1)


# ---------------------------------------------------------------- CUDA (run on the H200)
# The CUDA path has no exact prefill: prefill is cuBLAS GEMMs (their kernel and split chosen by the row count) and
# flash attention, decode the fused Triton kernels (engine.kernels.triton_decode) over GEMMs of the batch's rows, so
# in bf16 a position's keys and values depend on whether a whole prefill, a chunk of another length or a decode
# step computed it — the CPU demo's issue. These tests say whether it shows on the device (xfail: expected to).

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200)")


@CUDA
@pytest.mark.xfail(reason="issue 32: no exact prefill on CUDA (cuBLAS/flash prefill vs fused Triton decode)", strict=False)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_on_cuda_prefill_chunked_prefill_and_decode_give_the_same_bits(tiny_checkpoint, dtype):
    from engine.loader import load_model
    model = load_model(tiny_checkpoint("qwen3_moe"), device="cuda", dtype=dtype, max_context=128, max_batch=3)
    n = 37
    toks = tokens(1, n, 300)
    with torch.inference_mode():
        whole = model.prefill(toks, 0, all_logits=True)
        stepped = decode_from(model, toks, 1, 5)
        done = 0
        for size in (3, 11, 1, 16, 6):
            model.prefill(toks[done:done + size], 2, start=done)
            done += size
        torch.cuda.synchronize()
    k_whole, k_dec, k_chunk = (model.kv.k[:, s, :n] for s in (0, 1, 2))
    diff = {"decode": float((k_dec.float() - k_whole.float()).abs().max()),
            "chunked": float((k_chunk.float() - k_whole.float()).abs().max()),
            "logits": float((torch.stack(stepped).float() - whole[4:].float()).abs().max())}
    assert torch.equal(k_dec, k_whole) and torch.equal(k_chunk, k_whole), diff
    assert torch.equal(torch.stack(stepped), whole[4:]), diff


@CUDA
@pytest.mark.xfail(reason="issue 32: no exact prefill on CUDA; bf16 greedy replies may part on near-ties", strict=False)
def test_on_cuda_bf16_chat_turns_give_the_same_tokens_with_and_without_the_prefix_cache(tiny_checkpoint):
    from engine.llm import LLM, SamplingParams
    ckpt = tiny_checkpoint("qwen3_moe")
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    with LLM.load(ckpt, device="cuda", dtype="bfloat16", max_context=400, max_batch=2) as cached, \
            LLM.load(ckpt, device="cuda", dtype="bfloat16", max_context=400, max_batch=2, prefix_cache=False) as plain:
        history = tokens(5, 40, 300)
        for turn in range(6):
            got = [t.id for t in cached.generate(history, greedy)]
            assert got == [t.id for t in plain.generate(history, greedy)], f"turn {turn}"
            history = history + got + tokens(7 + turn, 9, 300)
