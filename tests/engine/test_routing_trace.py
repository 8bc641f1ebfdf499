"""Bench routing (engine.routing_trace, `--bench-routing`): the draws' statistics, their determinism, and that the
drawn picks are what a real provider is handed, through the loader, on the CPU (the draws are plain tensor ops:
the same functions run on CUDA and inside a captured graph, tests/engine/test_gpu_path.py's ground)."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from engine.engine_config import EngineConfig
from engine.routing_trace import BenchRouting, RoutedBlock, calibrate, hot_count, install, uniforms


@pytest.mark.parametrize("n_experts", [128, 288])
def test_calibrated_hot_set_takes_39_percent(n_experts):
    """The hottest 11.4 % of each layer's experts take 0.39 ± 0.02 of the picks, over many drawn tokens."""
    b = BenchRouting("calibrated", n_experts, 8, [0, 1], seed=11)
    hot = hot_count(n_experts)
    for layer in (0, 1):
        hot_set = torch.tensor(b.ranks[layer][:hot])
        ids = torch.cat([b(layer, torch.zeros(2048, 8, dtype=torch.long)) for _ in range(4)])
        share = float(torch.isin(ids, hot_set).float().mean())
        assert 0.37 <= share <= 0.41, (n_experts, layer, share)
        assert all(len(set(row)) == 8 for row in ids[:500].tolist())         # without replacement
    assert b.ranks[0] != b.ranks[1]                  # each layer its own permutation: different hot experts
    assert 0.6 < calibrate(n_experts, 8) < 0.8


def test_uniform_draws_are_distinct_and_flat():
    b = BenchRouting("uniform", 64, 6, [3], seed=1, pool=8000)
    ids = torch.cat([b(3, torch.zeros(1000, 6, dtype=torch.long)) for _ in range(8)])
    assert all(len(set(r)) == 6 for r in ids.tolist())
    counts = torch.bincount(ids.view(-1), minlength=64).double()
    expected = ids.numel() / 64                               # 750 per expert
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 110, chi2                                   # 63 dof: p ≈ 2e-4 at 110; a skewed draw is far above


def test_draws_are_deterministic_per_seed_and_advance_per_call():
    a, b, c = (BenchRouting("calibrated", 32, 4, [0, 1], seed=s) for s in (5, 5, 6))
    ids = torch.zeros(3, 4, dtype=torch.long)
    seq_a = [a(l, ids) for _ in range(3) for l in (0, 1)]
    seq_b = [b(l, ids) for _ in range(3) for l in (0, 1)]
    seq_c = [c(l, ids) for _ in range(3) for l in (0, 1)]
    assert all(torch.equal(x, y) for x, y in zip(seq_a, seq_b))
    assert not all(torch.equal(x, y) for x, y in zip(seq_a, seq_c))
    assert not torch.equal(seq_a[0], seq_a[2])                # the next call of a layer draws anew
    assert seq_a[0].dtype == ids.dtype and seq_a[0].shape == ids.shape
    u = uniforms(5, 0, torch.tensor([7]), 4, 9)
    assert torch.equal(u, uniforms(5, 0, torch.tensor([7]), 4, 9)) and 0 < float(u.min()) and float(u.max()) < 1


def test_bad_modes_are_refused():
    with pytest.raises(ValueError, match="bench_routing"):
        EngineConfig(bench_routing="zipf")
    with pytest.raises(ValueError, match="not one of"):
        BenchRouting("model", 8, 2, [0])


def _provider_picks(trace) -> list[tuple[int, list[int]]]:
    return [(r["layer"], r["experts"]) for r in map(json.loads, trace.read_text().splitlines())]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_the_provider_gets_the_drawn_picks(arch, tiny_checkpoint, tmp_path):
    """Through load_model with a real tiered provider (RAM tier over a packed store, routing traced): the experts
    each call hands the provider are exactly the set a BenchRouting of the same seed draws in the same order of
    calls; the same seed gives the same trace, another seed and the model's router differ. Mixtral: its one-call
    native routing steps aside, so its picks too are the drawn ones."""
    from engine.loader import load_model
    from engine.store import manifest as mf
    from engine.store.pack import pack_store
    from engine.tiers.tiered import TieredExperts
    ck = tiny_checkpoint(arch, experts=16, top_k=4, layers=2)
    st = tmp_path / "store"
    pack_store(ck, st, dtype=torch.float32)

    def run(routing: str, seed: int, name: str):
        trace = tmp_path / f"{name}.jsonl"
        prov = TieredExperts(mf.load(st), st, device="cpu", ram_slots=32, readers=1, trace=trace)
        model = load_model(ck, provider=prov, device="cpu", max_context=64, bench_routing=routing,
                           bench_routing_seed=seed)
        try:
            prompt = [5, 17, 200, 42, 99, 7]
            tok = int(model.prefill(torch.tensor(prompt), 0).argmax())
            for i in range(6):
                tok = int(model.decode_step([tok], [0], [len(prompt) + i]).argmax())
        finally:
            prov.close()
        return _provider_picks(trace), model

    uni, model = run("uniform", 3, "u1")
    again, _ = run("uniform", 3, "u2")
    other, _ = run("uniform", 4, "u3")
    own, _ = run("model", 0, "m")
    assert uni == again and uni != other and uni != own
    moe = sorted(ck_layers := {layer for layer, _ in uni})
    replay = BenchRouting("uniform", 16, 4, moe, seed=3)
    rows = [6] + [1] * 6                      # the prefill's rows, then one per decode step
    expected = [(l, sorted(set(replay(l, torch.zeros(t, 4, dtype=torch.long)).view(-1).tolist())))
                for t in rows for l in moe]
    assert uni == expected, (ck_layers, uni[:4], expected[:4])
    blocks = [m for m in model.modules() if isinstance(m, RoutedBlock) and m.bench is not None]
    assert len(blocks) == len(moe)


def test_install_model_routing_is_a_no_op(tiny_checkpoint):
    from engine.loader import load_model
    model = load_model(tiny_checkpoint("qwen3_moe", experts=16, top_k=4, layers=2), device="cpu", max_context=32)
    assert install(model, "model") is None
    b = install(model, "calibrated", seed=2)
    assert b.describe()["zipf_s"] == calibrate(16, 4) and b.describe()["hot_experts"] == 2


def test_rewind_draws_the_same_picks_again():
    """What a graph's eager warm-up step does before its capture (engine.gpu.graphs): mark, draw, rewind: the
    next draw (the replay's) is the one the warm-up drew."""
    b = BenchRouting("uniform", 32, 4, [0], seed=2)
    ids = torch.zeros(2, 4, dtype=torch.long)
    mark = b.mark()
    first = b(0, ids)
    b.rewind(mark)
    assert torch.equal(b(0, ids), first) and not torch.equal(b(0, ids), first)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (graphs)")
@pytest.mark.parametrize("placement", ["resident", "tiered", "zero_copy"])
def test_drawn_routing_inside_cuda_graphs_equals_eager(tiny_checkpoint, tmp_path, placement):
    """On CUDA, the draws run inside the captured decode step: graph decode and eager decode with the same seed
    give the same logits step by step (the same picks), for every provider path; and they differ from the
    model's own routing."""
    from engine.loader import load_model
    from engine.store.pack import pack_store
    ck = tiny_checkpoint("qwen3_moe", experts=16, top_k=4, layers=3)
    store = tmp_path / "store"
    pack_store(ck, store, dtype=torch.bfloat16)
    kw = {"experts": "tiered" if placement != "resident" else "resident", "cpu_experts": "off",
          "gpu_slots": 16 if placement != "resident" else None, "zero_copy": "on" if placement == "zero_copy" else "off",
          "ram_slots": {"tiered": 9, "zero_copy": 40}.get(placement)}

    def run(graphs: bool, routing: str):
        m = load_model(ck, store_dir=store, device="cuda", max_context=512, max_batch=2, cuda_graphs=graphs,
                       bench_routing=routing, bench_routing_seed=5, **kw)
        out = []
        with torch.inference_mode():
            tok = int(m.prefill(torch.tensor([5, 17, 200, 42, 99, 7]), 0).argmax())
            for i in range(10):
                logits = m.decode_step([tok], [0], [6 + i]).float()
                tok = int(logits.argmax())
                out.append(logits.cpu())
        m.provider.close()
        return out, m.graphs
    graph, g = run(True, "uniform")
    eager, _ = run(False, "uniform")
    own, _ = run(True, "model")
    assert g is not None and g.replays > 0
    for a, b in zip(graph, eager):
        assert float((a - b).norm() / b.norm()) < 1e-2
    assert any(float((a - b).norm() / b.norm()) > 0.05 for a, b in zip(graph, own))
