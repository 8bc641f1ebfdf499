"""The CPU decode's fast paths compute exactly what the plain ones do, bit for bit.

pair_ffn (two experts as one batched matmul), Projection (a weight held transposed, a one-row GEMV as
two column halves) and moe_forward (one host read of the routing, experts paired) must equal
expert_ffn / one matmul / moe_reference exactly — with torch on one thread and on two, in both record
orders — so the thread count and the tier an expert comes from never change a token. The reference
for a one-token step is computed on ONE thread: a lone GEMV may be split by the BLAS across threads
in another summation order (MKL on Intel Xeons does; bench/probes/gemv_bits.py), so the fast paths
keep every GEMV sequential inside a batch instead. Real records: a packed per-layer tensor (all in memory) and an O_DIRECT-
aligned anonymous mapping like the RAM tier's arena.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.experts.layout import ORDERS, ExpertLayout
from engine.experts.reference import expert_ffn, moe_reference
from engine.tiers.waves import group_routes, moe_forward
from engine.kernels.cpu import pair_ffn, set_compute_threads, single_ffn
from engine.dense_weights import Projection
from engine.store.odirect import aligned_buffer

# (hidden, intermediate): the demo's SmolLM2 shape, a small aligned one, and odd ones (declined by pair_ffn).
SHAPES = [(576, 1536), (64, 96), (40, 72), (33, 50)]


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    set_compute_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def sequential(fn):
    """fn() on one intra-op thread: every GEMV in the BLAS's sequential order, the engine's definition."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def packed_records(layout: ExpertLayout, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    h, i = layout.hidden, layout.intermediate
    return torch.stack([layout.pack(torch.randn(i, h, generator=g) * 0.1, torch.randn(i, h, generator=g) * 0.1,
                                    torch.randn(h, i, generator=g) * 0.1) for _ in range(n)])


def arena_records(layout: ExpertLayout, recs: torch.Tensor):
    """The same records in a page-aligned mapping, slot by slot, as RamArena holds them."""
    mm = aligned_buffer(len(recs) * layout.record_bytes)
    arena = torch.frombuffer(mm, dtype=torch.uint8)
    for s, r in enumerate(recs):
        arena[s * layout.record_bytes:(s + 1) * layout.record_bytes].view(layout.dtype).copy_(r)
    return mm, [arena[s * layout.record_bytes:(s + 1) * layout.record_bytes].view(layout.dtype)
                for s in range(len(recs))]


@pytest.fixture(params=ORDERS)
def order(request):
    return request.param


def test_both_orders_hold_the_same_matrices(order):
    lay = ExpertLayout(40, 72, torch.float32, order)
    g = torch.Generator().manual_seed(3)
    gate, up, down = torch.randn(72, 40, generator=g), torch.randn(72, 40, generator=g), torch.randn(40, 72, generator=g)
    rec = lay.pack(gate, up, down)
    assert all(torch.equal(a, b) for a, b in zip(lay.views(rec), (gate, up, down)))
    n = 72 * 40                                         # and where: rows as given, cols transposed side by side
    first_row = rec[:2 * 72] if order == "cols" else rec[:40]
    assert torch.equal(first_row, torch.cat([gate[:, 0], up[:, 0]]) if order == "cols" else gate[0])
    assert torch.equal(rec[2 * n:3 * n], (down.t() if order == "cols" else down).reshape(-1))
    assert not rec[3 * n:].any()                        # the padding to 4 KiB is zeros


@pytest.mark.parametrize("hidden,inter", SHAPES)
@pytest.mark.parametrize("where", ["packed", "arena"])
def test_pair_ffn_is_each_expert_alone(hidden, inter, where, order, threads):
    lay = ExpertLayout(hidden, inter, torch.float32, order)
    recs = packed_records(lay, 5, seed=hidden)
    mm, slots = arena_records(lay, recs) if where == "arena" else (None, list(recs))
    g = torch.Generator().manual_seed(1)
    xa, xb = torch.randn(1, hidden, generator=g), torch.randn(1, hidden, generator=g)
    for a, b in [(0, 3), (4, 1), (2, 3)]:              # both address orders
        va, vb = lay.views(slots[a]), lay.views(slots[b])
        ys = pair_ffn(xa, xb, va, vb)
        if hidden % 16 or inter % 16:                  # rows off 64-byte alignment: declined, done one by one
            assert ys is None
            continue
        want = sequential(lambda: (expert_ffn(xa, *va), expert_ffn(xb, *vb)))
        assert torch.equal(ys[0], want[0]) and torch.equal(ys[1], want[1]), (a, b)
    del slots, mm


@pytest.mark.parametrize("hidden,inter", SHAPES)
@pytest.mark.parametrize("where", ["packed", "arena"])
def test_single_ffn_is_the_expert_alone_on_one_thread(hidden, inter, where, order, threads):
    lay = ExpertLayout(hidden, inter, torch.float32, order)
    recs = packed_records(lay, 3, seed=hidden + 1)
    mm, slots = arena_records(lay, recs) if where == "arena" else (None, list(recs))
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(2))
    for e in range(3):
        v = lay.views(slots[e])
        y = single_ffn(x, v)
        if hidden % 32 or inter % 16:                  # halves off 64-byte alignment: declined
            assert y is None
            continue
        assert torch.equal(y, sequential(lambda: expert_ffn(x, *v))), e
    assert single_ffn(torch.randn(2, hidden), lay.views(slots[0])) is None      # one token only
    del slots, mm


def test_pair_ffn_declines_what_it_cannot_batch():
    lay = ExpertLayout(40, 72, torch.float32)
    x = torch.randn(1, 40)
    one, other = packed_records(lay, 1, seed=0), packed_records(lay, 1, seed=1)   # two storages
    assert pair_ffn(x, x, lay.views(one[0]), lay.views(other[0])) is None
    bf = ExpertLayout(40, 72, torch.bfloat16)
    recs = packed_records(bf, 2, seed=2)                                           # records not in x's dtype
    assert pair_ffn(x, x, bf.views(recs[0]), bf.views(recs[1])) is None


@pytest.mark.parametrize("rows,cols", [(49152, 576), (960, 576), (576, 576), (2050, 33), (65536, 33)])
@pytest.mark.parametrize("bias", [False, True])
def test_projection_is_one_matmul(rows, cols, bias, threads):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(rows, cols, generator=g)
    b = torch.randn(rows, generator=g) if bias else None
    proj = Projection(w, b)
    assert proj.halves == ((rows // 2 * 4) % 64 == 0)
    for shape in [(cols,), (1, cols), (1, 1, cols), (3, cols), (2, 1, cols)]:      # one row is split, more are not
        x = torch.randn(*shape, generator=g)
        got = proj(x)
        wt = w.t().contiguous()
        plain = lambda: torch.addmm(b, x.reshape(-1, cols), wt).view(got.shape) if bias else x @ wt  # noqa: E731
        one_row = x.numel() == cols and not bias
        want = sequential(plain) if one_row and proj.halves else plain()     # a split row: the sequential bits
        assert got.shape == (*shape[:-1], rows) and torch.equal(got, want), shape
        # and the same function as transformers' nn.Linear, to fp32 rounding
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_group_routes_visit_experts_as_moe_reference_does():
    ids = torch.tensor([[3, 1], [1, 0], [3, 2], [0, 3]])
    routes = group_routes(ids)
    assert [r.expert for r in routes] == torch.unique(ids).tolist()
    for r in routes:
        tok, k = (ids == r.expert).nonzero(as_tuple=True)
        assert r.tokens == tok.tolist() and r.ks == k.tolist()


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens,top_k,experts", [(1, 2, 8), (37, 4, 8), (300, 8, 128), (64, 3, 200)])
def test_moe_reference_is_the_per_expert_nonzero_loop(device, tokens, top_k, experts):
    """moe_reference's one-sort grouping visits the experts, and each expert's (token, k) pairs, exactly as the
    plain loop over torch.unique and nonzero does: the same bits (unused experts, one-pair experts, and more
    experts than tokens pick among them)."""
    lay = ExpertLayout(64, 32, torch.float32, "rows")
    recs = packed_records(lay, experts, seed=tokens).to(device)
    g = torch.Generator().manual_seed(tokens + top_k)
    x = torch.randn(tokens, 64, generator=g).to(device)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(device)
    w = torch.softmax(torch.randn(tokens, top_k, generator=g), -1).to(device)
    want = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tok, k = (ids == e).nonzero(as_tuple=True)
        gate, up, down = lay.views(recs[e])
        want.index_add_(0, tok, expert_ffn(x[tok], gate, up, down) * w[tok, k, None])
    assert torch.equal(moe_reference(x, ids, w, lambda e: lay.views(recs[e])), want)


@pytest.mark.parametrize("hidden,inter", SHAPES[1:])
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (1, 3), (1, 8), (5, 2)])
@pytest.mark.parametrize("wave", [1, 2, 3, 8])
def test_moe_forward_equals_moe_reference(hidden, inter, tokens, top_k, wave, order, threads):
    lay = ExpertLayout(hidden, inter, torch.float32, order)
    recs = packed_records(lay, 8, seed=inter)
    mm, slots = arena_records(lay, recs)
    g = torch.Generator().manual_seed(tokens * 10 + top_k)
    for _ in range(3):
        x = torch.randn(tokens, hidden, generator=g)
        ids = torch.stack([torch.randperm(8, generator=g)[:top_k] for _ in range(tokens)])
        w = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
        ref = lambda: moe_reference(x, ids, w, lambda e: lay.views(recs[e]))  # noqa: E731
        want = sequential(ref) if tokens == 1 else ref()     # one token: the same bits on any thread count
        for source in (recs, slots):                        # all in memory, and RAM-tier slots
            got = moe_forward(x, w, group_routes(ids), lambda es: [lay.views(source[e]) for e in es], wave)
            assert torch.equal(got, want)
    del slots, mm


def test_set_compute_threads_is_explicit():
    before = torch.get_num_threads()
    try:
        assert set_compute_threads(1) == 1 and torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="threads is 0"):
            set_compute_threads(0)
    finally:
        torch.set_num_threads(before)


def test_an_engine_nobody_closed_still_exits_cleanly(tiny_checkpoint, tmp_path):
    """Two compute threads run OpenMP regions on the scheduler thread; a process that ends without
    LLM.close() must still exit 0 (without the stop at exit the C++ runtime aborts it: exit 134)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    script = tmp_path / "unclosed.py"
    script.write_text(
        "import sys\n"
        "from engine.llm import LLM, SamplingParams\n"
        f"llm = LLM.load({str(tiny_checkpoint('mixtral', hidden=512))!r}, dtype='float32', max_context=64, max_batch=1, threads=2)\n"
        "print(len(llm.generate([5, 17, 200], SamplingParams(max_tokens=4, ignore_eos=True))))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                                   os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert (out.returncode, out.stdout.strip()) == (0, "4"), out.stderr[-500:]
