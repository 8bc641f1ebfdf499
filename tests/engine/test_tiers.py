"""TieredExperts over a real O_DIRECT store: identical results to all-in-memory whatever the tier sizes.

No GPU here: the CUDA path (GPU slots, cudaHostRegister) cannot run in CI; the GPU tier is
checked to be absent on the CPU device.
"""
from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from engine.checkpoint import Checkpoint
from engine.cli import main
from engine.errors import EngineError
from engine.store.pack import pack_store
from engine.tiers import build_provider, in_memory
from engine.tiers.memory import InMemoryExperts
from engine.cpu_layout import parse_cpu_layout


@pytest.fixture(scope="module")
def packed(tiny_checkpoint, tmp_path_factory):
    """arch -> (checkpoint dir, store dir), packed once per module."""
    cache = {}

    def get(arch, order="rows", **kw):
        key = (arch, order, tuple(sorted(kw.items())))
        if key not in cache:
            ck = tiny_checkpoint(arch, **kw)
            store = tmp_path_factory.mktemp(f"{arch}-{order}-store") / "store"
            pack_store(ck, store, order=order)
            cache[key] = (ck, store)
        return cache[key]
    return get


def routed_batches(ck: Checkpoint, steps: int, tokens: int, seed: int):
    """Random (layer, x, topk_ids, topk_weights) as a model would pass them, distinct experts per token."""
    g = torch.Generator().manual_seed(seed)
    k = int(ck.config["num_experts_per_tok"])
    for _ in range(steps):
        for layer in ck.moe_layers:
            x = torch.randn(tokens, ck.hidden, generator=g)
            ids = torch.stack([torch.randperm(ck.n_experts, generator=g)[:k] for _ in range(tokens)])
            w = torch.softmax(torch.randn(tokens, k, generator=g), -1)
            yield layer, x, ids, w


@pytest.mark.parametrize("arch,kw", [("qwen3_moe", {}), ("glm4_moe", {}), ("mixtral", {"dtype": "bfloat16"})])
@pytest.mark.parametrize("ram_slots", [1, 2, None])
@pytest.mark.parametrize("order", ["rows", "cols"])
def test_tiered_equals_in_memory_whatever_the_ram_tier(packed, arch, kw, ram_slots, order):
    ck_dir, store = packed(arch, order, **kw)
    ck = Checkpoint(ck_dir)
    n = len(ck.moe_layers) * ck.n_experts
    ref = in_memory(ck, order=order)          # the same records in memory: bit-equal, whatever the tiers do
    assert isinstance(ref, InMemoryExperts) and ref.layout.order == order
    if order == "cols":                       # what the CPU holds without a store
        assert build_provider(ck, None).layout.order == "cols"
    tiered = build_provider(ck, store, ram_slots=ram_slots or n, readers=2)
    try:
        picks = 0
        for layer, x, ids, w in routed_batches(ck, steps=3, tokens=5, seed=7):
            assert torch.equal(tiered.forward(layer, x, ids, w), ref.forward(layer, x, ids, w)), layer
            picks += ids.numel()
        c = tiered.counters()
        assert c["store_read_bytes"] > 0
        assert c["store_read_bytes"] == c["store_reads"] * tiered.layout.record_bytes
        assert sum(c["served"].values()) == picks and c["served"]["gpu"] == 0
        assert c["tiers"]["gpu"]["slots"] == 0 and c["tiers"]["ram"]["slots"] == (ram_slots or n)
        if ram_slots is None:      # every record read at most once, then served from RAM
            assert c["store_reads"] <= n and c["served"]["ram"] > 0 and c["tiers"]["ram"]["evictions"] == 0
        else:
            assert c["tiers"]["ram"]["evictions"] > 0
    finally:
        tiered.close()


def test_counters_follow_the_cache_exactly(packed):
    ck_dir, store = packed("qwen3_moe")
    ck = Checkpoint(ck_dir)
    t = build_provider(ck, store, ram_slots=2, readers=2, policy="lru", preload=False)   # from a cold start
    x = torch.randn(1, ck.hidden)
    w = torch.tensor([[0.6, 0.4]])
    try:
        for ids in ([0, 1], [1, 0], [2, 0], [3, 4]):
            t.forward(0, x, torch.tensor([ids]), w)
        c = t.counters()
        # [0,1]: 2 reads. [1,0]: 2 hits. [0,2]: 0 hit, 2 read evicting 1 (LRU). [3,4]: 2 reads evicting 0 and 2.
        assert c["served"] == {"gpu": 0, "ram": 3, "store": 5}
        assert (c["tiers"]["ram"]["hits"], c["tiers"]["ram"]["misses"], c["tiers"]["ram"]["evictions"]) == (3, 5, 3)
        assert c["store_reads"] == 5 and c["store_read_bytes"] == 5 * t.layout.record_bytes
    finally:
        t.close()


def test_trace_replays_in_the_simulator(packed, tmp_path, capsys):
    ck_dir, store = packed("qwen3_moe")
    ck = Checkpoint(ck_dir)
    trace = tmp_path / "routing.jsonl"
    t = build_provider(ck, store, ram_slots=4, readers=1, trace=trace, preload=False)   # the simulator starts cold
    for layer, x, ids, w in routed_batches(ck, steps=4, tokens=3, seed=1):
        t.forward(layer, x, ids, w)
    live = t.counters()["tiers"]["ram"]
    t.close()
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(steps) == 4 * len(ck.moe_layers) and steps[0]["layer"] == ck.moe_layers[0]
    capsys.readouterr()
    assert main(["simulate-cache", "--trace", str(trace), "--slots", "4", "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)["policies"]
    # every wave fits in 4 slots here, so the simulator replays exactly what the live LRU did
    assert (sim["lru"]["hits"], sim["lru"]["misses"]) == (live["hits"], live["misses"])
    assert sim["belady"]["hits"] >= sim["lru"]["hits"]


def test_reader_threads_are_pinned_to_the_cpu_layout(packed):
    ck_dir, store = packed("qwen3_moe")
    cpu = min(os.sched_getaffinity(0))
    t = build_provider(ck_dir, store, ram_slots=2, readers=2, cpu_layout=f"main=0;readers={cpu}")
    try:
        assert t.readers.cpus == {cpu}
        assert t.readers._pool.submit(os.sched_getaffinity, 0).result() == {cpu}
        assert os.sched_getaffinity(0) != {cpu} or len(os.sched_getaffinity(0)) == 1   # the caller is not pinned
    finally:
        t.close()


def test_bad_cpu_layout_is_one_line(packed):
    with pytest.raises(EngineError, match=r"--cpu-layout: 'readers' is not NAME=CPULIST") as e:
        parse_cpu_layout("main=0 readers")
    assert e.value.exit_code == 2


def test_store_of_another_checkpoint_or_dtype_is_refused(packed, tiny_checkpoint):
    ck_dir, store = packed("qwen3_moe")
    with pytest.raises(EngineError, match="packed from another checkpoint") as e:
        build_provider(tiny_checkpoint("qwen3_moe", layers=2), store, ram_slots=1)
    assert e.value.exit_code == 3
    with pytest.raises(EngineError, match="holds float32 records, bfloat16 was asked for") as e:
        build_provider(ck_dir, store, dtype=torch.bfloat16, ram_slots=1)
    assert e.value.exit_code == 3


def test_ram_tier_is_sized_from_memory_when_not_given(packed, caplog):
    ck_dir, store = packed("qwen3_moe")
    with caplog.at_level(logging.INFO, logger="engine.tiers"):
        t = build_provider(ck_dir, store, readers=1)
    try:
        # 24 tiny records always fit in this machine's memory budget
        assert t.counters()["tiers"]["ram"]["slots"] == 24
        assert any("RAM tier: 24 of 24 expert records" in r.message and ("cgroup" in r.message or "MemAvailable" in r.message)
                   for r in caplog.records)
    finally:
        t.close()
