"""Placement from routing statistics (engine.tiers.placement) on CPU CI, with real providers and tiers.

No GPU here. What stands in for one is the tiers' own CPU form: a CPU device given GPU slots keeps the slot tier
in host memory (engine.tiers.gpu), zero-copy decode's kernels run under Triton's interpreter and read the RAM
tier's records in place by their host address (what a GPU does over PCIe with the page-locked arena) — the same
stand-in tests/engine/test_zero_copy.py uses. The routing is real draws (engine.routing_trace) through load_model.
"""
from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from engine.routing_trace import BenchRouting
from engine.tiers.placement import Planner, skew_and_noise

PROMPT = list(range(3, 3 + 40))


def _counts(mode: str, rows: int, experts: int = 64, k: int = 8, seed: int = 1) -> np.ndarray:
    b = BenchRouting(mode, experts, k, [0], seed=seed)
    return b(0, torch.zeros(rows, k, dtype=torch.long)).numpy()


def test_uniform_routing_plans_static_and_skewed_plans_cache(caplog):
    """Two layers fed the same number of picks: uniform draws → static, calibrated draws → cache; one log line per
    change, nothing logged when a re-plan keeps the modes."""
    p = Planner([0, 1], 64, 1 << 20, every=512)
    with caplog.at_level(logging.INFO, logger="engine.tiers"):
        p.observe(0, _counts("uniform", 256))
        p.observe(1, _counts("calibrated", 256))
        assert p.due(2048)
        changed = p.plan(lambda layer: 8, {"pcie": 25.0})
    assert changed == [0]
    assert p.plans[0].mode == "static" and p.plans[1].mode == "cache"
    assert p.static_layers == {0} and not p.promotes(0) and p.promotes(1)
    lines = [r.message for r in caplog.records if r.message.startswith("placement:")]
    assert len(lines) == 1 and "layer 0 -> static" in lines[0] and "miss lane pcie" in lines[0]
    caplog.clear()
    p.observe(0, _counts("uniform", 256, seed=2))
    p.observe(1, _counts("calibrated", 256, seed=2))
    assert p.plan(lambda layer: 8, {"pcie": 25.0}) == []
    assert not [r for r in caplog.records if r.message.startswith("placement:")]


def test_hysteresis_and_churn():
    """A static layer needs ENTER of excess skew to become a cache, a cache layer stays one down to LEAVE; a cache
    whose promotions cost more than its misses save goes back to static. The faster lane serves the misses."""
    rng = np.random.default_rng(0)

    def skewed(share_hot: float, n: int = 4000) -> np.ndarray:
        hot = rng.integers(0, 8, int(n * share_hot))           # 8 of 64 experts take share_hot of the picks
        return np.concatenate([hot, rng.integers(8, 64, n - hot.size)])

    mid = skewed(0.125 + 0.09)           # excess over noise between LEAVE and ENTER at 4,000 picks
    s, noise = skew_and_noise(np.bincount(mid, minlength=64).astype(float), 8)
    assert 0.03 < s - noise < 0.06, (s, noise)
    for start, want in (("static", "static"), ("cache", "cache")):
        p = Planner([0], 64, 1 << 20)
        p.plans[0].mode = start
        p.observe(0, mid)
        p.plan(lambda layer: 8, {"pcie": 25.0})
        assert p.plans[0].mode == want
    p = Planner([0], 64, 1 << 20)
    p.observe(0, skewed(0.6))
    p.promoted[0] = 3000                  # ~0.75 promotions a pick: more PCIe than the hits save
    p.plan(lambda layer: 8, {"pcie": 25.0, "cpu": 40.0})
    assert p.plans[0].mode == "static" and p.plans[0].miss_lane == "cpu"
    assert p.plans[0].churn_s > 1.5 * p.plans[0].gain_s > 0


def test_forced_modes_never_change():
    for mode in ("cache", "static"):
        p = Planner([0], 64, 1 << 20, mode=mode)
        p.observe(0, _counts("uniform" if mode == "cache" else "calibrated", 512))
        assert p.plan(lambda layer: 0, {"pcie": 25.0}) == [] and p.plans[0].mode == mode
    with pytest.raises(ValueError, match="placement"):
        Planner([0], 8, 1, mode="lfu")


# ------------------------------------------------------------------ real tiers, real model, drawn routing

@pytest.fixture(scope="module")
def store(tiny_checkpoint, tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("CPU-device tiers (the interpreter would take the GPU's kernels over in this process)")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton", reason="triton is not installed (its interpreter runs the slot kernels)")
    from engine.store.pack import pack_store
    ck = tiny_checkpoint("qwen3_moe", experts=16, top_k=4, layers=3)          # 48 records
    st = tmp_path_factory.mktemp("placement-store") / "store"
    pack_store(ck, st, dtype=torch.float32)
    return ck, st


def _serve(store, routing: str, placement: str, steps: int = 6):
    """Zero-copy decode over a 16-slot slot tier and a 40-slot RAM tier (all 48 records), drawn routing: a
    prefill whose picks make the first plan, then `steps` decode steps. → (counters after, promotions during
    decode)."""
    from engine.loader import load_model
    from engine.store import manifest as mf
    from engine.tiers.tiered import TieredExperts
    ck, st = store
    prov = TieredExperts(mf.load(st), st, device="cpu", gpu_slots=16, ram_slots=40, readers=2, placement=placement)
    try:
        prov.preload()
        assert prov.use_zero_copy("on")
        prov.planner.every = 160               # the prefill's 40 tokens x 4 picks make a plan
        with torch.inference_mode():
            model = load_model(ck, provider=prov, device="cpu", max_context=64, bench_routing=routing,
                               bench_routing_seed=7)
            tok = int(model.prefill(torch.tensor(PROMPT), 0).argmax())
            before = prov.counters()["zero_copy"]["promotions"]
            for i in range(steps):
                tok = int(model.decode_step([tok], [0], [len(PROMPT) + i]).argmax())
            model.decode_step([tok], [0], [len(PROMPT) + steps])    # the last step's log is read at this launch
            c = prov.counters()
        return c, c["zero_copy"]["promotions"] - before
    finally:
        prov.close()


@pytest.mark.slow
def test_uniform_routing_freezes_the_split(store, caplog):
    """Uniform draws: every layer plans static after the prefill, and decode then promotes nothing (the preload's
    whole-layer split stays, llama.cpp's kind); the same run with --placement cache stays a cache. /metrics shows
    each layer's plan."""
    from engine.server.metrics import Metrics
    import engine.tiers.placement as placement
    mp = pytest.MonkeyPatch()
    mp.setattr(placement, "MIN_PICKS", 100)        # the prefill's 160 picks a layer are enough to plan
    try:
        with caplog.at_level(logging.INFO, logger="engine.tiers"):
            auto, moved = _serve(store, "uniform", "auto")
        cache, _ = _serve(store, "uniform", "cache")
    finally:
        mp.undo()
    plan = auto["placement"]
    assert plan["replans"] >= 1 and plan["layers_static"] == 3, plan
    assert moved == 0
    assert sum("placement: layer" in r.message and "-> static" in r.message for r in caplog.records) == 3
    assert cache["placement"]["layers_cache"] == 3
    text = Metrics(lambda: {**auto, "bench_routing": {"mode": "uniform"}}).render().decode()
    assert 'kiln_placement_layer_mode{layer="0",mode="static"} 1.0' in text
    assert 'kiln_bench_routing{mode="uniform"} 1.0' in text
    assert "kiln_placement_changes_total 3.0" in text


@pytest.mark.slow
def test_calibrated_routing_keeps_the_cache(store):
    """The calibrated skew's hot experts belong on the GPU: every layer stays a cache, and decode promotes."""
    import engine.tiers.placement as placement
    mp = pytest.MonkeyPatch()
    mp.setattr(placement, "MIN_PICKS", 100)
    try:
        c, moved = _serve(store, "calibrated", "auto")
    finally:
        mp.undo()
    assert c["placement"]["replans"] >= 1 and c["placement"]["layers_cache"] == 3, c["placement"]["layers"]
    assert all(p["skew"] > p["noise"] for p in c["placement"]["layers"].values())


# ------------------------------------------------------------------ zero-copy's hot set, driven step by step

def _zero_copy(store, placement="auto"):
    from engine.store import manifest as mf
    from engine.tiers.tiered import TieredExperts
    _, st = store
    prov = TieredExperts(mf.load(st), st, device="cpu", gpu_slots=16, ram_slots=40, readers=2, placement=placement)
    prov.preload()
    assert prov.use_zero_copy("on")
    prov.zero_copy.budget = lambda: 4             # the copy budget a GPU's step time gives; fixed: deterministic
    return prov


def _drive(prov, bench, steps, k=4):
    """`steps` decode steps of drawn picks through zero-copy's host side: each step's picks written into the routing
    log a GPU step's kernels write, then the after-launch hook that reads it, plans, promotes and writes back (what
    runs between two real steps; no kernel is needed for where records lie). → (share of the picks the GPU slots
    served, promotions a step)."""
    zc = prov.zero_copy
    g0, r0, p0 = zc.picks["gpu"], zc.picks["ram"], zc.promotions
    for _ in range(steps):
        for layer, row in zc.rows.items():
            zc.log[row, :k] = bench(layer, torch.zeros(1, k, dtype=torch.long)).reshape(-1).to(torch.int32)
        prov.after_decode_launch(k)
    g, r = zc.picks["gpu"] - g0, zc.picks["ram"] - r0
    return g / (g + r), (zc.promotions - p0) / steps


def _best_static(bench, layers, slots=16, experts=16):
    """The share of the bench's draws the `slots` most-drawn (layer, expert) records serve: a perfect static split."""
    counts = np.concatenate([np.bincount(bench.pool[layer].reshape(-1).numpy(), minlength=experts)
                             for layer in layers]).astype(float)
    return np.sort(counts)[::-1][:slots].sum() / counts.sum()


def test_the_slots_converge_on_the_hottest_records_and_then_hold_still(store):
    """Calibrated draws: the GPU slots come to serve what the hottest 16 records would (0.95 of a perfect static
    split at least), and then promote almost nothing. Promoting whatever a step read and evicting the least recently
    used kept the tail cycling through the slots (a budget's promotions every step, 0.38 where 0.56 was possible at
    the 6 GiB bench's shape: bench/placement_sim.py)."""
    prov = _zero_copy(store)
    try:
        layers = list(prov.zero_copy.rows)
        bench = BenchRouting("calibrated", 16, 4, layers, seed=3)
        _drive(prov, bench, 400)
        share, promotions = _drive(prov, bench, 300)
        assert prov.planner.summary()["layers_cache"] == 3
    finally:
        prov.close()
    assert share >= 0.95 * _best_static(bench, layers), (share, _best_static(bench, layers))
    assert promotions <= 0.1, promotions


def test_a_cache_under_uniform_routing_does_not_chase_noise(store):
    """--placement cache under uniform draws: a record displaces a resident only when measurably hotter (a resident
    is credited with 3 standard deviations of its count), so a sample's chance favourites are not promoted."""
    prov = _zero_copy(store, placement="cache")
    try:
        bench = BenchRouting("uniform", 16, 4, list(prov.zero_copy.rows), seed=4)
        _drive(prov, bench, 100)
        _, promotions = _drive(prov, bench, 400)
    finally:
        prov.close()
    assert promotions <= 0.05, promotions


def test_a_prefill_leaves_the_hot_set_in_its_slots(store):
    """A prefill's waves go through the slots the hot set leaves (a quarter of them here): the hottest residents are
    still in their slots after a prompt that picks every expert of every layer, and the prefill's output is the
    in-memory provider's."""
    from engine.tiers import build_provider
    ck, _ = store
    prov = _zero_copy(store)
    ref = build_provider(ck, None)
    try:
        layers = list(prov.zero_copy.rows)
        _drive(prov, BenchRouting("calibrated", 16, 4, layers, seed=3), 300)
        kept = prov.zero_copy.prefill_keep(layers[0])
        assert len(kept) == 12                             # 16 slots, a quarter the waves'
        g = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            for layer in layers:
                ids = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(40)])
                x = torch.randn(40, prov.layout.hidden, generator=g)
                w = torch.rand(40, 4, generator=g)
                got = prov.forward(layer, x, ids, w)
                want = ref.forward(layer, x, ids, w)
                assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
        assert kept <= set(prov.gpu.cache.resident())
    finally:
        prov.close()
