"""The CPU expert lane (engine.tiers.lanes) and the lane split of TieredExperts, on CPU CI.

The split runs for real on a CPU "device" given GPU slots: the slot tier then lives in host memory
(engine.tiers.gpu), its side computed by the slot kernels under Triton's interpreter where triton is
installed (else their reference, the arena path), the CPU lane's side by the CPU expert kernels on the
lane thread, from real RAM-tier slots filled by real O_DIRECT reads. What a GPU adds (a side stream,
page-locked staging, graph pieces) is tests/engine/test_cpu_lane_cuda.py's, skipped without CUDA.
"""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")       # the slot side: the GPU kernels, interpreted on CPU tensors

from engine.tiers.lanes import GB, Candidate, LaneRates, promotions, split  # noqa: E402

B = 1 << 20        # a 1 MiB record


def rates(pcie, cpu, disk=5.0):
    return LaneRates(pcie * GB, cpu * GB, disk * GB)


def cands(*specs):
    """(expert, tokens, heat) triples."""
    return [Candidate(e, t, h) for e, t, h in specs]


# -- the cost model ----------------------------------------------------------------------------------
def test_split_modes_on_and_off_ignore_the_rates():
    c = cands((3, 1, 0), (5, 1, 9), (7, 2, 4))
    assert split(c, rates(25, 1), B, "off", 8) == ([5, 7, 3], [])
    assert split(c, rates(1, 25), B, "on", 8) == ([], [5, 7, 3])


def test_split_auto_balances_the_two_lanes():
    c = cands(*[(e, 1, 10 - e) for e in range(6)])        # heat falls with the expert id
    # Equal rates: three over PCIe and three on the CPU take half the time either way would alone.
    assert split(c, rates(10, 10), B, "auto", 8) == ([0, 1, 2], [3, 4, 5])
    # PCIe twice the CPU: four copies (4 b/2r) against two on the CPU (2 b/r) — the hottest copied.
    assert split(c, rates(20, 10), B, "auto", 8) == ([0, 1, 2, 3], [4, 5])
    # A CPU far slower than PCIe: everything copied; far faster: everything on the CPU.
    assert split(c, rates(25, 0.1), B, "auto", 8) == ([0, 1, 2, 3, 4, 5], [])
    assert split(c, rates(0.1, 25), B, "auto", 8) == ([], [0, 1, 2, 3, 4, 5])


def test_split_auto_counts_tokens_and_respects_the_slot_room():
    # Expert 1 (4 tokens) costs the CPU four one-token picks: left on the CPU after the hotter two it would take
    # 4 b/r against 2 b/r of copies, so all three are copied (one token each, it would stay on the CPU).
    c = cands((1, 4, 0), (2, 1, 5), (3, 1, 5))
    assert split(c, rates(10, 10), B, "auto", 8) == ([2, 3, 1], [])
    assert split(cands((1, 1, 0), (2, 1, 5), (3, 1, 5)), rates(10, 10), B, "auto", 8) == ([2, 3], [1])
    # No GPU slot free for this layer: all on the CPU whatever the rates say.
    assert split(c, rates(25, 0.1), B, "auto", 0) == ([], [2, 3, 1])
    # Room for one: the hottest.
    assert split(cands((1, 1, 1), (2, 1, 5)), rates(25, 0.1), B, "auto", 1) == ([2], [1])


def test_split_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="cpu_experts 'sometimes'"):
        split([], rates(1, 1), B, "sometimes", 1)


def test_promotions_fill_the_idle_pcie_lane_with_experts_hotter_than_the_victim():
    cpu = cands((4, 1, 9), (5, 1, 1), (6, 1, 7), (7, 1, 3))
    # 4 MiB on the CPU at 10 GB/s while PCIe at 20 GB/s copies nothing: room for 8 copies, capped by room=2.
    assert promotions(cpu, rates(20, 10), B, 0, None, 2) == [4, 6]
    # A victim of heat 5 keeps its slot against all but the two hotter experts.
    assert promotions(cpu, rates(20, 10), B, 0, 5, 8) == [4, 6]
    # The PCIe lane is already as busy as the CPU lane: nothing more to copy.
    assert promotions(cpu, rates(10, 10), B, 4, None, 8) == []


# -- the lane split, end to end on a CPU "device" ------------------------------------------------------
@pytest.fixture(scope="module")
def lane_store(tiny_checkpoint, tmp_path_factory):
    from engine.store.pack import pack_store
    ck = tiny_checkpoint("qwen3_moe", experts=16, top_k=4, layers=3)
    store = tmp_path_factory.mktemp("lane-store") / "store"
    pack_store(ck, store, dtype=torch.float32)             # rows: the slot kernels' order
    return ck, store


def _greedy(model, prompt, n):
    toks = [int(model.prefill(torch.tensor(prompt), 0).argmax())]
    for i in range(n - 1):
        toks.append(int(model.decode_step([toks[-1]], [0], [len(prompt) + i]).argmax()))
    return toks


PROMPT = [5, 17, 200, 42, 99, 7, 311, 64, 128, 3, 250, 19]


@pytest.mark.parametrize("mode,lane_rates", [("off", None), ("on", "pcie=10,cpu=10,disk=5"),
                                             ("auto", "pcie=10,cpu=10,disk=5")])
def test_greedy_tokens_are_the_same_whichever_lane_computes(lane_store, mode, lane_rates):
    """The memory provider's tokens (every expert on the CPU, the reference) against the tiered provider
    with a 6-slot "GPU" tier and a 9-slot RAM tier over a 48-record store (reads, evictions, promotions
    galore): all picks on the slot side (off), every non-slot pick on the CPU lane (on), the cost model's
    mix at rates that split the picks between the lanes (auto)."""
    from engine.loader import load_model
    from engine.store import manifest as mf
    from engine.tiers import build_provider
    from engine.tiers.tiered import TieredExperts
    ck, store = lane_store
    with torch.inference_mode():
        ref = load_model(ck, provider=build_provider(ck, None), device="cpu", max_context=64)
        want = _greedy(ref, PROMPT, 12)
        prov = TieredExperts(mf.load(store), store, device="cpu", gpu_slots=6, ram_slots=9, readers=2,
                             cpu_experts=mode, lane_rates=lane_rates)
        try:
            model = load_model(ck, provider=prov, device="cpu", max_context=64)
            assert prov.predictor is not None                # the layer-ahead prefetch stays on
            got = _greedy(model, PROMPT, 12)
            c = prov.counters()
        finally:
            prov.close()
    assert got == want
    lanes = c["lanes"]
    decode_picks = 11 * 3 * 4                                # 11 decode steps x 3 MoE layers x top-4
    assert lanes["disk"]["bytes"] > 0 and lanes["gpu"]["picks"] > 0
    if mode == "off":
        assert c["cpu_experts"] == "off" and lanes["cpu"]["picks"] == 0 and c["lane_rates"] is None
    else:
        assert c["cpu_experts"] == mode and lanes["cpu"]["picks"] > 0 and lanes["cpu"]["seconds"] > 0
        assert lanes["cpu"]["bytes"] > 0 and c["lane_rates"]["source"] == dict.fromkeys(("pcie", "cpu", "disk"),
                                                                                       "config")
        assert prov.ram.held == set()                         # every job collected, its RAM slots let go
    # every decode pick computed once, on one lane (prefill's 12 tokens x 3 layers x 4 on the slot side)
    assert lanes["gpu"]["picks"] + lanes["cpu"]["picks"] == decode_picks + 12 * 3 * 4
    if mode == "on":
        # promotions still fill GPU slots with hot experts: the slot side serves some decode picks
        assert lanes["gpu"]["picks"] > 12 * 3 * 4


def test_quantized_records_give_the_same_tokens_on_either_lane(tiny_checkpoint, tmp_path):
    """int8 records: the CPU lane's quantized kernel (engine.kernels.quant_cpu) against the slot side's."""
    from engine.loader import load_model
    from engine.store import manifest as mf
    from engine.store.pack import pack_store
    from engine.tiers.tiered import TieredExperts
    ck = tiny_checkpoint("qwen3_moe", experts=16, top_k=4, layers=3)
    store = tmp_path / "store"
    pack_store(ck, store, quant="int8")
    toks = {}
    with torch.inference_mode():
        for mode in ("off", "on"):
            prov = TieredExperts(mf.load(store), store, device="cpu", gpu_slots=6, ram_slots=9, readers=2,
                                 cpu_experts=mode, lane_rates="pcie=10,cpu=10,disk=5")
            try:
                toks[mode] = _greedy(load_model(ck, provider=prov, device="cpu", max_context=64), PROMPT, 8)
                if mode == "on":
                    assert prov.counters()["lanes"]["cpu"]["picks"] > 0
            finally:
                prov.close()
    assert toks["on"] == toks["off"]


def test_a_cpu_device_without_slots_has_no_lane_to_split(lane_store):
    """Without a slot tier the CPU computes every expert already: cpu_experts is off whatever was asked,
    and every pick counts on the cpu lane."""
    from engine.store import manifest as mf
    from engine.tiers.tiered import TieredExperts
    ck, store = lane_store
    prov = TieredExperts(mf.load(store), store, device="cpu", ram_slots=9, readers=1, cpu_experts="on")
    try:
        assert prov.lane is None and prov.counters()["cpu_experts"] == "off"
        x = torch.randn(1, prov.layout.hidden)
        prov.forward(prov.manifest.moe_layers[0], x, torch.tensor([[1, 2, 3, 4]]), torch.full((1, 4), 0.25))
        assert prov.counters()["lanes"]["cpu"]["picks"] == 4
    finally:
        prov.close()


def test_lane_rates_are_measured_at_load_where_not_given(lane_store):
    """measure_rates: the rates not given are measured on the provider's own tiers (real O_DIRECT reads into
    the RAM tier and a slot copy at load, a CPU expert FFN on the lane thread at first use), the given ones
    kept as given."""
    from engine.store import manifest as mf
    from engine.tiers.tiered import TieredExperts
    ck, store = lane_store
    prov = TieredExperts(mf.load(store), store, device="cpu", gpu_slots=6, ram_slots=9, readers=2,
                         cpu_experts="auto", lane_rates="pcie=7.5")
    try:
        assert prov.counters()["lane_rates"] is None                # the CPU rate is not measured yet
        prov.rates
        r = prov.counters()["lane_rates"]
        assert r["source"] == {"pcie": "config", "cpu": "measured", "disk": "measured"}
        assert r["pcie_gbps"] == 7.5 and r["cpu_gbps"] > 0 and r["disk_gbps"] > 0
        assert prov.counters()["lanes"]["disk"]["picks"] == 4     # 2 x readers records read to measure the disk
        assert len(prov.ram.cache) == 4 and not prov.gpu.data.any()   # they stay in RAM; the slot copy is undone
    finally:
        prov.close()
    prov = TieredExperts(mf.load(store), store, device="cpu", gpu_slots=6, ram_slots=9, readers=2, cpu_experts="on")
    try:
        assert not prov.gpu.data.any()                        # the PCIe rate's copy is undone too
        assert set(prov.rates.source.values()) == {"measured"} and prov.rates.pcie > 0
    finally:
        prov.close()


def test_metrics_export_each_lane_and_the_rates_the_cost_model_uses(lane_store):
    """/metrics' lane families, from a real provider's counters after a decode step split across lanes."""
    from prometheus_client.parser import text_string_to_metric_families
    from engine.server.metrics import Metrics
    from engine.store import manifest as mf
    from engine.tiers.tiered import TieredExperts
    ck, store = lane_store
    prov = TieredExperts(mf.load(store), store, device="cpu", gpu_slots=6, ram_slots=9, readers=2,
                         cpu_experts="on", lane_rates="pcie=10,cpu=12.5,disk=5")
    try:
        layer = prov.manifest.moe_layers[0]
        x = torch.randn(1, prov.layout.hidden)
        with torch.inference_mode():
            prov.forward(layer, x, torch.tensor([[0, 1, 2, 3]]), torch.full((1, 4), 0.25))   # a decode step
        text = Metrics(prov.counters).render().decode()
    finally:
        prov.close()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    c = prov.counters()["lanes"]
    for lane in ("gpu", "cpu", "pcie", "disk"):
        assert samples[("kiln_lane_picks_total", (("lane", lane),))] == c[lane]["picks"]
        assert samples[("kiln_lane_bytes_total", (("lane", lane),))] == c[lane]["bytes"]
        assert ("kiln_lane_busy_seconds_total", (("lane", lane),)) in samples
    assert c["cpu"]["picks"] == 4 and c["gpu"]["picks"] == 0         # nothing was in a slot: all on the CPU
    assert samples[("kiln_lane_rate_bytes_per_second", (("lane", "cpu"), ("source", "config")))] == 12.5e9


def test_lane_bound_is_the_slowest_lane_at_its_rate():
    from engine.tiers.lanes import lane_bound
    c = {"lanes": {"gpu": {"bytes": 0}, "pcie": {"bytes": 50 * 10**9}, "disk": {"bytes": 6 * 10**9},
                   "cpu": {"bytes": 24 * 10**9}},
         "lane_rates": {"pcie_gbps": 25.0, "cpu_gbps": 12.0, "disk_gbps": 3.0, "source": {}}}
    assert lane_bound(c, t_gpu=0.5) == {"gpu": 0.5, "pcie": 2.0, "disk": 2.0, "cpu": 2.0, "bound": 2.0}
    assert lane_bound(c, t_gpu=3.0)["bound"] == 3.0
    assert lane_bound({"lanes": {}, "lane_rates": None}, 1.5) == {"gpu": 1.5, "pcie": None, "disk": None,
                                                                   "cpu": None, "bound": 1.5}


def test_the_cpu_lane_runs_on_its_own_thread_pinned_to_the_lane_cpus():
    import threading
    from engine.tiers.lanes import CpuLane
    cpu = min(os.sched_getaffinity(0))
    lane = CpuLane({cpu, 10_000})                          # a CPU outside the process's set is dropped
    try:
        (cpus, name), seconds = lane.submit(lambda: (os.sched_getaffinity(0), threading.current_thread().name)).result()
        assert cpus == {cpu} and name.startswith("cpu-lane") and seconds >= 0
        assert os.sched_getaffinity(0) != {cpu} or len(os.sched_getaffinity(0)) == 1   # the caller is not pinned
    finally:
        lane.close()


def test_the_ram_tier_keeps_what_the_gpu_tier_evicts_so_each_record_is_read_once(lane_store):
    """24 slot-tier + 25 RAM slots over the 48-record store (one to swap through: a slot's victim is written
    back before the record taking its slot leaves RAM): the two tiers hold every record between them when the
    RAM tier keeps what the slot tier lacks (a record copied up leaves RAM; one evicted from a slot is written
    back). A long decode then reads each record from the store at most once — with a RAM tier that
    only caches what it last fetched (the slot tier's own recent records), the slot tier's victims went back
    to the store. Tokens stay the reference's."""
    from engine.loader import load_model
    from engine.store import manifest as mf
    from engine.tiers import build_provider
    from prometheus_client.parser import text_string_to_metric_families
    from engine.server.metrics import Metrics
    from engine.tiers.tiered import TieredExperts
    ck, store = lane_store
    prompt = [(31 * i + 7) % 300 for i in range(48)]
    with torch.inference_mode():
        ref = load_model(ck, provider=build_provider(ck, None), device="cpu", max_context=128)
        want = _greedy(ref, prompt, 40)
        prov = TieredExperts(mf.load(store), store, device="cpu", gpu_slots=24, ram_slots=25, readers=2)
        try:
            model = load_model(ck, provider=prov, device="cpu", max_context=128)
            got = _greedy(model, prompt, 40)
            c = prov.counters()
            text = Metrics(prov.counters).render().decode()
            ram_keys, slot_keys = set(prov.ram.cache.resident()), set(prov.gpu.cache.resident())
        finally:
            prov.close()
    assert got == want
    assert c["tiers"]["gpu"]["evictions"] > 0 and c["writebacks"] > 0       # the slot tier did turn over
    assert c["store_reads"] <= 48, c["store_reads"]
    assert c["writeback_bytes"] == c["writebacks"] * mf.load(store).record_bytes
    assert not ram_keys & slot_keys                                          # no record held twice
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["kiln_writeback_bytes_total"] == c["writeback_bytes"] > 0


def test_preload_fills_both_tiers_at_load_so_a_decode_never_reads_the_store(lane_store):
    """20 slot-tier + 29 RAM slots over the 48-record store (one to swap through, as above): preload puts the
    first 20 records (store order) in slots and the other 28 in RAM with 48 store reads, none in both tiers; a
    40-token decode then reads nothing from the store and its tokens are the reference's. Through build_provider (what
    LLM.load calls) a CPU device fills its RAM tier the same way, and preload=False leaves it empty."""
    from engine.loader import load_model
    from engine.store import manifest as mf
    from engine.tiers import build_provider
    from engine.tiers.cache import ExpertKey
    from engine.tiers.tiered import TieredExperts
    ck, store = lane_store
    m = mf.load(store)
    order = [ExpertKey(l, e) for l in m.moe_layers for e in range(m.experts_per_layer)]
    prompt = [(31 * i + 7) % 300 for i in range(48)]
    with torch.inference_mode():
        ref = load_model(ck, provider=build_provider(ck, None), device="cpu", max_context=128)
        want = _greedy(ref, prompt, 40)
        prov = TieredExperts(m, store, device="cpu", gpu_slots=20, ram_slots=29, readers=2)
        try:
            done = prov.preload()
            slot_keys, ram_keys = set(prov.gpu.cache.resident()), set(prov.ram.cache.resident())
            loaded = prov.counters()
            model = load_model(ck, provider=prov, device="cpu", max_context=128)
            got = _greedy(model, prompt, 40)
            after = prov.counters()
        finally:
            prov.close()
    assert done["gpu"] == 20 and done["ram"] == 28 and done["store_reads"] == 48 == loaded["store_reads"]
    assert slot_keys == set(order[:20]) and ram_keys == set(order[20:])
    assert got == want
    assert after["store_reads"] == 48 and after["served"]["store"] == 0
    for preload, resident in ((True, 48), (False, 0)):
        t = build_provider(ck, store, ram_slots=48, readers=2, preload=preload)
        try:
            assert len(set(t.ram.cache.resident())) == resident == t.counters()["store_reads"]
        finally:
            t.close()
