"""Zero-copy decode (engine.tiers.zero_copy) on CPU CI.

The slot kernels run for real under Triton's interpreter on CPU tensors: a CPU "device" given GPU slots has the
slot tier in host memory (engine.tiers.gpu), and the record table points either at one of its slots or at a real
RAM-tier slot (a page-aligned mapping filled by real O_DIRECT reads), which the kernels read in place by its
address — what a GPU does over PCIe with the page-locked arena. What only a GPU has (the copy stream, the events
that hold a moved slot, one CUDA graph a step) is tests/engine/test_gpu_path.py's, skipped without CUDA.
"""
from __future__ import annotations

import logging
import re
import os

import numpy as np
import pytest
import torch

if torch.cuda.is_available():     # the interpreter below would take the GPU's kernels over in this process
    pytest.skip("CPU-device tests; on CUDA tests/engine/test_gpu_path.py runs zero-copy decode for real",
                allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="triton is not installed (its interpreter runs the slot kernels)")

from engine.errors import EngineError, Exit  # noqa: E402
from engine.experts.layout import ExpertLayout  # noqa: E402
from engine.kernels.triton_moe import slot_moe, slot_moe_reference  # noqa: E402

PROMPTS = [[5, 17, 200, 42, 99, 7, 311, 64, 128, 3, 250, 19], [8, 9, 10, 11, 300, 1, 2]]


@pytest.fixture(scope="module")
def store(tiny_checkpoint, tmp_path_factory):
    from engine.store.pack import pack_store
    ck = tiny_checkpoint("qwen3_moe", experts=16, top_k=4, layers=3)          # 48 records
    st = tmp_path_factory.mktemp("zc-store") / "store"
    pack_store(ck, st, dtype=torch.float32)                                    # rows: the slot kernels' order
    return ck, st


def _tiered(store, *, gpu_slots=16, ram_slots=40, preload=True, mode="on", **kw):
    from engine.store import manifest as mf
    from engine.tiers.tiered import TieredExperts
    ck, st = store
    prov = TieredExperts(mf.load(st), st, device="cpu", gpu_slots=gpu_slots, ram_slots=ram_slots, readers=2, **kw)
    try:
        if preload:
            prov.preload()
        prov.use_zero_copy(mode)
    except BaseException:
        prov.close()
        raise
    return prov


def _greedy(model, prompt, n):
    toks = [int(model.prefill(torch.tensor(prompt), 0).argmax())]
    for i in range(n - 1):
        toks.append(int(model.decode_step([toks[-1]], [0], [len(prompt) + i]).argmax()))
    return toks


def _check_table(prov):
    """Every record is where the device table says, and in one tier unless it is being moved."""
    zc = prov.zero_copy
    zc.sync()
    assert torch.equal(zc.table.cpu(), zc.mirror)
    for key in zc.keys:
        assert int(zc.mirror[zc._index(key)]) == zc._offset(key)
        both = key in prov.gpu.cache and key in prov.ram.cache
        assert (key in prov.gpu.cache or key in prov.ram.cache) and (not both or key in zc.promoting | zc.demoting)


def test_table_kernels_read_records_wherever_the_table_points():
    """slot_moe with a record table: each pick's record read at its offset from the arena's start — here half of
    them in another buffer (the RAM tier's stand-in) — equals the reference over the same records; the log gets
    the picks' ids."""
    g = torch.Generator().manual_seed(0)
    lay = ExpertLayout(160, 72, torch.float32)
    arena = torch.randn(6, lay.record_elems, generator=g) * 0.1
    other = torch.randn(5, lay.record_elems, generator=g) * 0.1      # records outside the arena
    where = {e: ("arena", e % 6) if e % 2 else ("other", e % 5) for e in range(10)}
    item = lay.itemsize
    table = torch.tensor([s * lay.record_elems if t == "arena" else
                          (other[s].data_ptr() - arena.data_ptr()) // item for t, s in where.values()])
    gather = torch.stack([arena[s] if t == "arena" else other[s] for t, s in where.values()])
    for t, k in [(1, 4), (3, 2)]:
        x = torch.randn(t, 160, generator=g)
        ids = torch.randint(0, 10, (t, k), generator=g)
        w = torch.rand(t, k, generator=g)
        log = torch.full((64,), -1, dtype=torch.int32)
        got = slot_moe(x, arena, ids, w, lay, table=table, log=log)
        ref = slot_moe_reference(x, gather, ids, w, lay)
        assert float((got - ref).norm() / ref.norm()) < 1e-5
        assert log[:t * k].tolist() == ids.reshape(-1).tolist() and (log[t * k:] == -1).all()


def test_table_kernels_read_quantized_records_in_place():
    """The quantized GEMV kernels take the same table (byte offsets): int4 records outside the arena."""
    from engine.kernels.quant_triton import quant_moe_reference, quant_slot_moe
    g = torch.Generator().manual_seed(1)
    lay = ExpertLayout(256, 128, torch.uint8, quant="int4")
    q = lay.quantized
    recs = torch.stack([lay.pack(*(torch.randn(s, generator=g) * 0.05 for s in ((128, 256), (128, 256), (256, 128))))
                        for _ in range(6)])
    arena, other = recs[:3].clone(), recs[3:].clone()
    table = torch.tensor([0, lay.record_bytes, 2 * lay.record_bytes] +
                         [other[i].data_ptr() - arena.data_ptr() for i in range(3)])
    x = torch.randn(2, 256, generator=g)
    ids = torch.tensor([[0, 4, 5], [3, 1, 2]])
    w = torch.rand(2, 3, generator=g)
    got = quant_slot_moe(x, arena, ids, w, q, block_i=64, block_h=128, table=table)
    ref = quant_moe_reference(x, recs, ids, w, q)
    assert float((got - ref).norm() / ref.norm()) < 1e-4


def test_zero_copy_decode_gives_the_reference_tokens_and_promotes_what_it_reads(store, caplog):
    """A 16-slot slot tier and a 40-slot RAM tier over 48 records, preloaded: decode reads the RAM tier's records
    in place (no copy before the kernels, no store read), promotes them behind the steps, and its greedy tokens
    are the in-memory provider's, across two requests (a prefill between them moves records the table follows)."""
    from engine.loader import load_model
    from engine.tiers import build_provider
    ck, _ = store
    with torch.inference_mode():
        ref = load_model(ck, provider=build_provider(ck, None), device="cpu", max_context=64)
        want = [_greedy(ref, p, 14) for p in PROMPTS]
        with caplog.at_level(logging.INFO, logger="engine.tiers"):
            prov = _tiered(store)
        try:
            assert prov.zero_copy is not None and not prov.host_steps
            assert any("zero-copy decode: on" in r.message for r in caplog.records)
            model = load_model(ck, provider=prov, device="cpu", max_context=64)
            reads = prov.counters()["store_reads"]
            got = [_greedy(model, p, 14) for p in PROMPTS]
            c = prov.counters()
            _check_table(prov)
        finally:
            prov.close()
    assert got == want
    zc = c["zero_copy"]
    assert c["store_reads"] == reads                       # preloaded: nothing read from the store while serving
    assert zc["picks"]["ram"] > 0 and zc["read_in_place_bytes"] == zc["picks"]["ram"] * prov.layout.record_bytes
    assert zc["promotions"] > 0 and zc["demotions"] > 0
    # every decode pick but the last step's (its log is read at the next launch) is counted where it was read
    logged = 2 * 12 * 3 * 4
    assert logged <= zc["picks"]["gpu"] + zc["picks"]["ram"] <= logged + 2 * 3 * 4
    assert c["lanes"]["pcie"]["bytes"] >= zc["read_in_place_bytes"]
    assert c["served"]["ram"] >= zc["picks"]["ram"]


def test_zero_copy_batches_equal_one_sequence_at_a_time(store):
    """Two sequences decoded together (8 picks a layer, some the same expert) give each one's own logits."""
    from engine.loader import load_model
    ck, _ = store
    prov = _tiered(store)
    try:
        with torch.inference_mode():
            model = load_model(ck, provider=prov, device="cpu", max_context=64, max_batch=2)
            toks = [int(model.prefill(torch.tensor(p), s).argmax()) for s, p in enumerate(PROMPTS)]
            pos = [len(p) for p in PROMPTS]
            both = model.decode_step(toks, [0, 1], pos)
            alone = torch.cat([model.decode_step([toks[s]], [s], [pos[s]]) for s in (0, 1)])
        assert float((both - alone).norm() / alone.norm()) < 1e-5
        assert torch.equal(both.argmax(-1), alone.argmax(-1))
        _check_table(prov)
    finally:
        prov.close()


@pytest.mark.parametrize("kw,why", [
    ({"gpu_slots": 16, "ram_slots": 32}, "hold 16 + 32 records, not more than the store's 48"),
    ({"preload": False}, "are in neither tier"),
    ({"cpu_experts": "on", "lane_rates": "pcie=10,cpu=10,disk=5"}, "the CPU expert lane is on"),
])
def test_zero_copy_on_names_what_blocks_it_and_auto_stays_off(store, kw, why, caplog):
    kw = {"gpu_slots": 16, "ram_slots": 40, **kw}
    with pytest.raises(EngineError, match="--zero-copy on: .*" + re.escape(why)) as e:
        _tiered(store, **kw, mode="on")
    assert e.value.exit_code == Exit.USAGE
    with caplog.at_level(logging.INFO, logger="engine.tiers"):
        prov = _tiered(store, **kw, mode="auto")
    try:
        assert prov.zero_copy is None and prov.host_steps
        assert any("zero-copy decode: off" in r.message and why in r.message for r in caplog.records)
    finally:
        prov.close()


def test_cpu_experts_auto_never_switches_zero_copy_off(store, caplog):
    """--cpu-experts auto may not switch off a faster path it does not replace: where the lane is all that blocks
    zero-copy decode, the lane goes (and says so); --cpu-experts on keeps it, as asked."""
    with caplog.at_level(logging.INFO, logger="engine.tiers"):
        prov = _tiered(store, cpu_experts="auto", lane_rates="pcie=10,cpu=10,disk=5", mode="auto")
    try:
        assert prov.zero_copy is not None and prov.lane is None and prov.cpu_experts == "off"
        assert any("CPU expert lane (auto): off" in r.message for r in caplog.records)
    finally:
        prov.close()
    prov = _tiered(store, cpu_experts="on", lane_rates="pcie=10,cpu=10,disk=5", mode="auto")
    try:
        assert prov.zero_copy is None and prov.lane is not None
    finally:
        prov.close()


def test_a_moved_slot_is_reused_only_after_its_table_update(store):
    """The promotions' bookkeeping: a record written back keeps its GPU slot, and one copied up its RAM slot, until
    the table update that moves it has been made (on a CPU device at once, at the next step); the freed GPU slots
    are what the next promotions take."""
    from collections import Counter
    prov = _tiered(store)
    try:
        zc = prov.zero_copy
        zc.step_seconds = 1.0                                   # a budget of several moves
        assert prov.gpu.cache.free == 0                         # preloaded full: write-backs first
        hot = [k for k in zc.keys if k not in prov.gpu.cache][:3]
        for k in hot:                                           # three RAM-tier records picked far more than any
            prov.planner.counts.ravel()[zc._index(k)] = 100.0
        zc._promote(np.array([], dtype=np.int64), Counter())
        down = set(zc.demoting)
        assert len(down) == 3 and all(k in prov.gpu.cache and k in prov.ram.cache for k in down)
        assert all(zc._offset(k) == zc.ram_offsets[prov.ram.cache.slot_of(k)] for k in down)   # the table: RAM
        zc._release()
        assert zc.demoting == down and prov.gpu.cache.free == 0     # not synced yet: nothing freed
        zc.sync()
        zc._release()
        assert not zc.demoting and prov.gpu.cache.free == len(down) and not any(k in prov.gpu.cache for k in down)
        key = hot[0]
        zc._promote(np.array([zc._index(key)]), Counter({key: 1}))
        assert key in zc.promoting and key in prov.gpu.cache and key in prov.ram.cache
        assert zc._offset(key) == prov.gpu.cache.slot_of(key) * zc.rec_elems         # the table: its slot
        assert torch.equal(prov.gpu.data[prov.gpu.cache.slot_of(key)],
                           prov.ram.arena.tensor(prov.ram.cache.slot_of(key), torch.float32))
        zc.sync()
        zc._release()
        assert key not in prov.ram.cache and not zc.promoting
        _check_table(prov)
    finally:
        prov.close()


def test_the_eviction_policy_hears_of_decodes_picks_in_their_order(store):
    """Decode's picks reach the GPU tier's eviction policy (LRU here) when it must choose, most recent last: the
    victim is a record no step picked, and among the picked the one picked longest ago."""
    prov = _tiered(store)
    try:
        zc = prov.zero_copy
        zc.budget = lambda: 0                                # no promotion or write-back: only the reads
        on_gpu = [k for k in zc.keys if k in prov.gpu.cache]
        layer0 = [k for k in on_gpu if k.layer == zc.keys[0].layer]
        # The first layer's records were admitted first at preload: the LRU's oldest, its victims but for the picks.
        # The older picks have the higher expert ids: an order by index, not by use, would fail below.
        older, newer = layer0[4:8], layer0[:4]
        for picks in (older, newer, newer):                  # the log is read one launch later
            zc.log.fill_(0)
            zc.log[zc.rows[older[0].layer], :4] = torch.tensor([k.expert for k in picks], dtype=torch.int32)
            prov.after_decode_launch(4)
        zc.sync_policy()
        picked = set(older) | set(newer)
        assert prov.gpu.cache.policy.victim(zc.demoting) not in picked
        others = set(prov.gpu.cache.resident()) - picked
        assert prov.gpu.cache.policy.victim(others) in set(older)
        assert not zc.uses_since.any()                       # told once
    finally:
        prov.close()


def test_quantized_records_decode_zero_copy_with_the_piecewise_tokens(tiny_checkpoint, tmp_path):
    """int4 records (bytes; the table holds byte offsets): zero-copy decode gives the tokens the piecewise decode
    gives over the same records and kernels."""
    from engine.loader import load_model
    from engine.store.pack import pack_store
    ck = tiny_checkpoint("qwen3_moe", experts=16, top_k=4, layers=3)
    st = tmp_path / "store"
    pack_store(ck, st, quant="int4")
    toks = {}
    with torch.inference_mode():
        for mode in ("off", "on"):
            prov = _tiered((ck, st), mode=mode)
            try:
                assert (prov.zero_copy is not None) == (mode == "on")
                toks[mode] = _greedy(load_model(ck, provider=prov, device="cpu", max_context=64), PROMPTS[0], 10)
                if mode == "on":
                    assert prov.counters()["zero_copy"]["picks"]["ram"] > 0
                    _check_table(prov)
            finally:
                prov.close()
    assert toks["on"] == toks["off"]


def test_quantized_prefill_runs_the_grouped_gemm_over_the_slots(tiny_checkpoint, tmp_path, monkeypatch):
    """int4 records, a prompt's many tokens: the tiered provider computes them with the grouped GEMM over its GPU
    slots, the resident provider's kernel — in one wave (every picked expert of the layer fits the slots) its
    arithmetic bit for bit, in several (a smaller slot tier) within rounding of it — and not moe_forward's per-expert
    dequantize-then-matmul (about 3 s for an 8k prompt on a GPU at any budget)."""
    from engine.store import manifest as mf
    from engine.store.pack import pack_store
    from engine.tiers import tiered
    from engine.tiers.resident import ResidentExperts
    ck = tiny_checkpoint("qwen3_moe", experts=16, top_k=4, layers=3)
    st = tmp_path / "store"
    pack_store(ck, st, quant="int4")
    resident = ResidentExperts.from_store(st, "cpu")
    monkeypatch.setattr(tiered, "moe_forward", lambda *a, **k: pytest.fail("moe_forward ran"))
    g = torch.Generator().manual_seed(0)
    m = mf.load(st)
    layer = m.moe_layers[1]
    x = torch.randn(40, m.layout.hidden, generator=g)
    ids = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(40)])
    w = torch.softmax(torch.randn(40, 4, generator=g), -1)
    want = resident.forward(layer, x, ids, w)
    for slots in (16, 5):
        prov = tiered.TieredExperts(m, st, device="cpu", gpu_slots=slots, ram_slots=48 - slots + 8, readers=2)
        try:
            got = prov.forward(layer, x, ids, w)
            served = dict(prov.served)
        finally:
            prov.close()
        assert sum(served.values()) == ids.numel()
        if slots == 16:
            assert torch.equal(got, want)
        else:
            assert float((got - want).norm() / want.norm()) < 1e-5
