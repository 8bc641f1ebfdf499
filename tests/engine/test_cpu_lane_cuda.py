"""The CPU expert lane on a real GPU: the slot kernels on the device, the CPU lane on the host, their partial
sums added on the device; eager decode and CUDA-graph replay (two host steps per MoE layer: the routing
read, then the CPU sum's collection); and `engine serve --device cuda --cpu-experts on` through HTTP.

Needs a CUDA device (streams, page-locked staging, graphs): skipped without one. The same split on a CPU
"device" is tests/engine/test_cpu_lane.py, which runs on CPU CI.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (streams, page-locked "
                                                                      "staging, CUDA graphs)")
DEV = torch.device("cuda")

from tests.engine.test_gpu_path import tiny_store  # noqa: E402,F401  (3 layers, 16 experts, top-4; bf16 rows store)


@pytest.fixture(scope="module")
def synth(tiny_store):
    """tiny_store's checkpoint and a float32 rows-order store of its experts (48 records)."""
    from engine.store.pack import pack_store
    ck, store = tiny_store
    pack_store(ck, store.parent / "store32", dtype=torch.float32)
    return ck, store.parent / "store32"


def _greedy(model, ids, n):
    toks = [int(model.prefill(ids, 0).argmax())]
    for i in range(n - 1):
        toks.append(int(model.decode_step([toks[-1]], [0], [len(ids) + i]).argmax()))
    return toks


@pytest.mark.parametrize("mode,rates", [("on", "pcie=10,cpu=10,disk=5"), ("auto", "pcie=10,cpu=10,disk=5"),
                                        ("auto", None)])
def test_cpu_lane_on_cuda_keeps_the_resident_tokens_eager_and_from_graphs(synth, mode, rates):
    """float32, so the CPU lane's and the GPU kernels' roundings cannot flip a greedy token: the tokens of
    every expert resident on the GPU, against 6 GPU slots + 9 RAM slots with the lane split; then the same
    steps replayed from CUDA graphs."""
    from engine.loader import load_model
    from engine.store import manifest as mf
    from engine.tiers.resident import ResidentExperts
    from engine.tiers.tiered import TieredExperts
    model_dir, store = synth
    ids = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        res = load_model(model_dir, provider=ResidentExperts.from_store(store, DEV), device=DEV, dtype="float32",
                         max_context=256, cuda_graphs=False)
        want = _greedy(res, ids, 24)
        prov = TieredExperts(mf.load(store), store, device=DEV, gpu_slots=6, ram_slots=9, readers=4,
                             cpu_experts=mode, lane_rates=rates)
        try:
            off = load_model(model_dir, provider=prov, device=DEV, dtype="float32", max_context=256,
                             cuda_graphs=False)
            assert _greedy(off, ids, 24) == want
            c = prov.counters()
            if rates:                                   # rates that split: the CPU lane computed picks
                assert c["lanes"]["cpu"]["picks"] > 0 and c["lanes"]["cpu"]["seconds"] > 0
            assert c["lanes"]["pcie"]["bytes"] > 0 and c["lanes"]["pcie"]["seconds"] > 0
            assert set(c["lane_rates"]["source"].values()) == ({"config"} if rates else {"measured"})
            assert off.use_cuda_graphs()
            before = c["lanes"]["cpu"]["picks"]
            assert _greedy(off, ids, 24) == want and off.graphs.replays == 23
            # two host steps per MoE layer (routing read, CPU sum) + the last piece
            assert off.graphs.pieces_per_step == 2 * len(prov.manifest.moe_layers) + 1
            if rates:
                assert prov.counters()["lanes"]["cpu"]["picks"] > before   # replays run the lane too
            assert prov.ram.held == set()
        finally:
            prov.close()


def test_bf16_cpu_lane_stays_within_bf16_rounding_of_the_gpu(tiny_store):
    """bf16 (what serving runs): the logits with every non-slot pick on the CPU lane against all on the GPU,
    within bf16 rounding (the CPU sums in another order: the device difference, nothing more)."""
    from engine.loader import load_model
    from engine.store import manifest as mf
    from engine.tiers.resident import ResidentExperts
    from engine.tiers.tiered import TieredExperts
    model_dir, store = tiny_store                       # bf16 rows records: what serving computes from
    ids = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        res = load_model(model_dir, provider=ResidentExperts.from_store(store, DEV), device=DEV, dtype="bfloat16",
                         max_context=256, cuda_graphs=False)
        prov = TieredExperts(mf.load(store), store, device=DEV, gpu_slots=6, ram_slots=9, readers=4,
                             cpu_experts="on", lane_rates="pcie=10,cpu=10,disk=5")
        try:
            lane = load_model(model_dir, provider=prov, device=DEV, dtype="bfloat16", max_context=256,
                              cuda_graphs=False)
            a, b = res.prefill(ids, 0).float(), lane.prefill(ids, 0).float()
            tok = int(a.argmax())
            for i in range(8):
                a = res.decode_step([tok], [0], [20 + i]).float()
                b = lane.decode_step([tok], [0], [20 + i]).float()
                assert float((a - b).norm() / a.norm()) < 3e-2
                tok = int(a.argmax())
            assert prov.counters()["lanes"]["cpu"]["picks"] > 0
        finally:
            prov.close()


def test_engine_serve_cuda_cpu_experts_on_reports_the_cpu_lane(tiny_store):
    """A real `engine serve --device cuda --experts tiered --cpu-experts on`: completions stream, and /metrics
    counts picks on the cpu lane and the rates it was given."""
    pytest.importorskip("openai", reason="the server test helpers use the official client")
    from tests.engine.test_server_errors import serve_proc, wait_ready
    import requests
    model_dir, store = tiny_store
    p = serve_proc("--model", str(model_dir), "--store", str(store), "--device", "cuda", "--port", "0", "--ctx", "256",
                   "--max-batch", "2", "--experts", "tiered", "--gpu-slots", "16", "--ram-slots", "24",
                   "--cpu-experts", "on", "--lane-rates", "pcie=10,cpu=10,disk=5", "--log-level", "warning")
    try:
        base = wait_ready(p)
        r = requests.post(f"{base}/v1/completions", json={"prompt": [5, 17, 200, 42], "max_tokens": 16,
                                                           "ignore_eos": True, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        text = requests.get(f"{base}/metrics", timeout=10).text
        picks = [line for line in text.splitlines() if line.startswith('kiln_lane_picks_total{lane="cpu"}')]
        assert picks and float(picks[0].split()[-1]) > 0, text
        assert 'kiln_lane_rate_bytes_per_second{lane="cpu",source="config"} 1e+10' in text
    finally:
        p.terminate()
        p.communicate(timeout=30)
