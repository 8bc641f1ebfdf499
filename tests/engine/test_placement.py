"""Which expert provider a load builds (engine.tiers.choose_placement / build_provider), and the decode
step's KV buckets: the choices `engine serve` makes before any GPU is touched, tested with fake budgets."""
from __future__ import annotations

import logging

import pytest

from engine.errors import EngineError
from engine.kv_cache import MIN_KV_BUCKET, kv_bucket
from engine.tiers import choose_placement

GIB = 1 << 30


@pytest.mark.parametrize("mode,device,store,experts,budget,kind,why", [
    ("auto", "cuda", True, 29 * GIB, 120 * GIB, "resident", "fit the GPU budget of 120.00 GiB"),
    ("auto", "cuda", True, 29 * GIB, 29 * GIB, "resident", "fit the GPU budget"),         # exactly fits
    ("auto", "cuda", True, 29 * GIB, 20 * GIB, "tiered", "exceed the GPU budget of 20.00 GiB: tiered"),
    ("auto", "cuda", False, 29 * GIB, 20 * GIB, "resident", "no store to tier them from"),
    ("resident", "cuda", True, 29 * GIB, 1 * GIB, "resident", "--experts resident"),
    ("tiered", "cuda", True, 1 * GIB, 120 * GIB, "tiered", "--experts tiered"),
    ("auto", "cpu", False, 1 * GIB, None, "memory", "every expert in memory"),
    ("auto", "cpu", True, 1 * GIB, None, "tiered", "RAM tier over the store"),
    ("resident", "cpu", True, 1 * GIB, None, "memory", "every expert in memory"),
])
def test_placement_follows_the_budget_and_the_flags(mode, device, store, experts, budget, kind, why):
    p = choose_placement(mode, device, has_store=store, expert_bytes=experts, gpu_budget_bytes=budget)
    assert p.kind == kind and why in p.reason and f"{experts / GIB:.2f} GiB" in p.reason


def test_placement_refuses_what_cannot_be_built():
    with pytest.raises(EngineError, match=r"--experts tiered needs a packed expert store") as e:
        choose_placement("tiered", "cuda", has_store=False, expert_bytes=GIB, gpu_budget_bytes=GIB)
    assert e.value.exit_code == 2
    with pytest.raises(EngineError, match=r"--experts 'gpu' is not one of auto, resident, tiered"):
        choose_placement("gpu", "cuda", has_store=True, expert_bytes=GIB, gpu_budget_bytes=GIB)


def test_build_provider_logs_its_choice_with_the_sizes(tiny_checkpoint, tmp_path, caplog):
    from engine.store.pack import pack_store
    from engine.tiers import build_provider
    ck = tiny_checkpoint("qwen3_moe")
    pack_store(ck, tmp_path / "store", order="cols")
    with caplog.at_level(logging.INFO, logger="engine.tiers"):
        mem = build_provider(ck, None)
        tiered = build_provider(ck, tmp_path / "store", ram_slots=2, readers=1)
    try:
        assert type(mem).__name__ == "InMemoryExperts" and type(tiered).__name__ == "TieredExperts"
        lines = [r.message for r in caplog.records if r.message.startswith("experts: ")]
        assert lines[0].startswith("experts: memory (24 records of ") and "every expert in memory" in lines[0]
        assert lines[1].startswith("experts: tiered (24 records of ") and "RAM tier over the store" in lines[1]
    finally:
        tiered.close()


@pytest.mark.parametrize("need,max_len,want", [
    (1, 4096, MIN_KV_BUCKET), (256, 4096, 256), (257, 4096, 512), (4096, 4096, 4096), (3000, 3000, 3000),
    (2049, 3000, 3000), (100, 128, 128),
])
def test_kv_buckets_are_powers_of_two_capped_by_the_cache(need, max_len, want):
    assert kv_bucket(need, max_len) == want


def test_kv_bucket_refuses_keys_past_the_cache():
    with pytest.raises(AssertionError):
        kv_bucket(4097, 4096)


def test_cpu_decode_stays_eager(tiny_checkpoint):
    """No CUDA graphs on the CPU: use_cuda_graphs says no and decode_step runs the eager path."""
    from engine.loader import load_model
    model = load_model(tiny_checkpoint("qwen3_moe"), max_context=64)
    assert model.graphs is None and model.use_cuda_graphs() is False and model.graphs is None


def test_engine_config_carries_the_placement_and_refuses_an_unknown_one():
    from engine.engine_config import EngineConfig
    assert EngineConfig().experts == "auto" and EngineConfig().cuda_graphs is True
    assert EngineConfig(experts="tiered", cuda_graphs=False).experts == "tiered"
    with pytest.raises(ValueError, match=r"experts 'gpu' is not one of auto, resident, tiered"):
        EngineConfig(experts="gpu")
