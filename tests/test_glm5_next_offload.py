"""The GLM-5.3-Flash offload bench (issue 28): its slice and tier arithmetic (engine/measure/glm5_slice.py), its
projection to the seed's box (engine/measure/projection_3090.py's glm5 part), and the whole pipeline run as a
user runs it, `python -m bench.glm5_next_offload --tiny`, on this CPU: engine synth's int4 glm5_next slice,
llama.cpp's own converter and llama-quantize on the same weights (read from Kiln's store), llama-bench, Kiln's
tiers in-process and through `engine serve`. The pipeline test needs the llama.cpp CPU build (skips naming it,
fails under KILN_REQUIRE_LLAMA_CPP=1, as CI sets)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.measure import glm5_slice
from engine.measure import projection_3090 as proj
from engine.synth import synth_config
from tests.fixtures.llama_server import DEFAULT

REPO = Path(__file__).resolve().parent.parent
RECORD = 15_728_640          # one int4 record of GLM-5.3-Flash's expert (4096 x 2048 x 3, groups of 32, 4 KiB aligned)


def slice_cfg(moe_layers: int) -> dict:
    return synth_config("glm5_next", num_hidden_layers=glm5_slice.DENSE + moe_layers)


def test_the_seeds_tiers_scale_to_any_slice():
    full = glm5_slice.seed_tiers(42 * 288)
    assert (full["gpu_slots"], full["ram_slots"], full["store_records"]) == (1376, 4831, 5889)   # ANCHORS.md
    two = glm5_slice.seed_tiers(2 * 288)
    assert (two["gpu_slots"], two["ram_slots"], two["store_records"]) == (66, 230, 280)
    assert abs(two["shares"]["gpu"] - 0.114) < 0.001 and abs(two["shares"]["ram"] - 0.399) < 0.001


def test_a_layers_files_and_the_layer_count_the_disk_holds():
    per = glm5_slice.layer_bytes(slice_cfg(1), RECORD)
    assert per["kiln_int4"] == 288 * RECORD and per["bf16"] == 288 * 3 * 4096 * 2048 * 2
    assert 288 * 3 * 4096 * 2048 * 4.5 / 8 < per["q4_k_m_bound"] == 288 * 3 * 4096 * 2048 * (2 * 4.5 + 6.5625) / 3 / 8
    gib = 1 << 30
    plan = glm5_slice.disk_plan(slice_cfg, RECORD, 64 * gib, 100 * gib, 128 * gib)
    assert plan["fits_by"]["disk"] == 6 and plan["moe_layers_fit"] == 6
    assert plan["bytes_at_fit"]["disk"] <= 64 * gib
    one_more = glm5_slice.disk_plan(slice_cfg, RECORD, plan["bytes_at_fit"]["disk"] - 1, 100 * gib, 128 * gib)
    assert one_more["fits_by"]["disk"] == 5                                  # a byte less, a layer less
    assert glm5_slice.disk_plan(slice_cfg, RECORD, 64 * gib, 64 * gib, 128 * gib)["fits_by"]["shm"] == 3


def test_llama_cpps_whole_layer_share_is_the_nearest_not_above_kilns():
    nine = [0, 0, 0] + [100] * 9                      # 3 dense layers, 9 MoE layers of equal experts
    r = glm5_slice.n_cpu_moe_for_share(nine, 0.114)
    assert r["moe_layers_on_gpu"] == 1 and r["n_cpu_moe"] == 11 and r["share_of_expert_bytes_on_gpu"] == 0.1111
    two = glm5_slice.n_cpu_moe_for_share([0, 0, 0, 100, 100], 0.114)
    assert two["moe_layers_on_gpu"] == 0 and two["n_cpu_moe"] == 5          # 0 % is nearer 11.4 % than 50 %
    assert glm5_slice.n_cpu_moe_for_share([0, 0, 0, 100, 100], 0.25)["share_of_expert_bytes_on_gpu"] == 0.0  # tie


def bench_doc() -> dict:
    """The fields projection_3090.glm5_inputs reads, in the shape bench.glm5_next_offload writes them. The figures are
    made up for the arithmetic (round numbers near the H200's), not measured."""
    cfg = slice_cfg(2)
    lanes = lambda cpu: {"gpu": {"bytes_per_token": 0, "busy_seconds_per_token": 0.0},   # noqa: E731
                         "pcie": {"bytes_per_token": 0, "busy_seconds_per_token": 0.0},
                         "disk": {"bytes_per_token": 2 * 8 * RECORD // 2, "busy_seconds_per_token": 0.05},
                         "cpu": {"bytes_per_token": cpu, "busy_seconds_per_token": cpu / 50e9},
                         "served_share": {"gpu": 0.4, "ram": 0.35, "store": 0.25}}
    return {"checkpoint": {"layers": 5, "moe_layers": 2, "record_bytes": RECORD,
                           "non_expert_bytes_per_token": glm5_slice.non_expert_bytes_per_token(cfg),
                           "full_model_non_expert_bytes_per_token": glm5_slice.non_expert_bytes_per_token(slice_cfg(42))},
            "lanes": {"hbm_gbps": 4000.0, "dram_read_16t_gbps": 100.0},
            "kiln": {"resident": {"calibrated": {"decode_tps": 200.0, "prefill_tps_8192": 20000.0,
                                                 "prefill_tps_32768": 400000.0, "lanes_per_token": lanes(0)}},
                     "three_tier": {"calibrated": {"decode_tps": 20.0, "lanes_per_token": lanes(int(2 * 8 * RECORD * 0.35))}}}}


def test_the_glm5_projection_is_each_lanes_bytes_over_the_boxs_rate():
    x = proj.glm5_inputs(bench_doc())
    assert x["h200_cpu_lane_gbps"] == pytest.approx(50.0)
    res = proj.project_glm5(x)
    picks = 42 * 8 * RECORD
    seed = next(r for r in res["decode"] if r["split"] == "seed_split")
    assert seed["picks_fraction"] == {"gpu": 0.39, "ram": 0.54, "store": 0.07}
    assert seed["ram_picks_on_cpu_lane"] == 1.0                  # the run computed every RAM pick on the CPU lane
    t = seed["lane_seconds_per_token"]
    assert t["disk"] == pytest.approx(0.07 * picks / 7e9, abs=1e-6)
    assert t["cpu"] == pytest.approx(0.54 * picks / 50e9, abs=1e-6)
    assert t["pcie"] == pytest.approx(0.07 * picks / 25e9, abs=1e-6)
    for r in res["decode"]:
        assert r["projected_decode_tps"] == round(1 / max(r["lane_seconds_per_token"].values()), 1)
    pre = {(r["chunk"], r["tokens"]): r for r in res["prefill"]}
    whole, chunked = pre[(32768, 32768)], pre[(8192, 32768)]
    assert chunked["passes"] == 4 and whole["passes"] == 1
    assert whole["lane_seconds"]["disk"] == pytest.approx(42 * 288 * RECORD * (1 - 1376 / 12096 - 4831 / 12096) / 7e9,
                                                         abs=1e-3)
    assert chunked["projected_tps"] < whole["projected_tps"]     # each chunk moves the experts again
    assert res["seed"]["decode_tps"] == 19.47 and res["targets"]["prefill_tps_32768"] == 969.0


def test_the_projection_refuses_a_cpu_run_in_one_line(tmp_path):
    doc = bench_doc()
    doc["lanes"] = None                                          # a --tiny run measures no lanes
    (tmp_path / "b.json").write_text(json.dumps(doc))
    r = subprocess.run([sys.executable, "-m", "bench.projection_3090", "--glm5", str(tmp_path / "b.json"),
                        "--out", str(tmp_path / "p.json")], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "glm5_next_offload" in r.stderr
    doc = bench_doc()
    (tmp_path / "b.json").write_text(json.dumps(doc))
    r = subprocess.run([sys.executable, "-m", "bench.projection_3090", "--glm5", str(tmp_path / "b.json"),
                        "--out", str(tmp_path / "p.json")], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("PROJECTION, not measured")
    assert json.loads((tmp_path / "p.json").read_text())["label"].startswith("PROJECTION (not measured)")


def _llama_cpp() -> Path:
    d = Path(os.environ.get("KILN_LLAMA_CPP_DIR") or DEFAULT.parents[1])
    missing = [p for p in (d / "convert_hf_to_gguf.py", d / "bin" / "llama-quantize", d / "bin" / "llama-bench")
               if not p.is_file()]
    if missing:
        why = f"no {missing[0]} ($KILN_LLAMA_CPP_DIR); build it with `make llama-cpp`"
        if os.environ.get("KILN_REQUIRE_LLAMA_CPP") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return d


def test_bad_arguments_exit_2_in_one_line(tmp_path):
    for argv, what in ((["--moe-layers", "43"], "--moe-layers 43"), (["--routings", "zipf"], "'zipf'")):
        r = subprocess.run([sys.executable, "-m", "bench.glm5_next_offload", "--tiny", "--work", str(tmp_path),
                            "--llama-bin", str(tmp_path), "--llama-src", str(tmp_path), "--out", str(tmp_path / "o.json"),
                            *argv], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert r.returncode == 2 and what in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_llama_cpps_converter_reads_kilns_int4_experts_from_the_store(tmp_path):
    """scripts/glm5_next_gguf.py --store: the GGUF's expert tensors are the store's int4 records dequantized (bf16),
    every expert in its place; the stand-in vocabulary goes in as written."""
    import gguf
    import torch
    from engine.quant.records import dequantize_matrix, matrix_bytes
    from engine.store import manifest as mf
    from engine.synth import stand_in_tokenizer, synthesize

    llama = _llama_cpp()
    shape = dict(hidden_size=256, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                 intermediate_size=512, vocab_size=320, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32,
                 q_lora_rank=64, qk_nope_head_dim=32, v_head_dim=32, index_head_dim=16, index_n_heads=2,
                 index_topk=16, index_kpool=4, linear_attn_config={"head_dim": 32, "num_heads": 2,
                 "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "safe_gate": True})
    model, store = tmp_path / "m", tmp_path / "s"
    synthesize(model, store, device="cpu", quant="int4", arch="glm5_next", num_hidden_layers=5, **shape)
    stand_in_tokenizer(model, 320)
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "glm5_next_gguf.py"), str(model), str(tmp_path / "g"),
                        "--llama-cpp", str(llama), "--store", str(store), "--types", "F32"],
                       capture_output=True, text=True, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    reader = gguf.GGUFReader(json.loads(r.stdout)["F32"])
    tensors = {t.name: t for t in reader.tensors}
    m = mf.load(store)
    q = m.layout.quantized
    for layer in (3, 4):
        for name, which, region in (("ffn_gate_exps", 0, "gate"), ("ffn_down_exps", 2, "down")):
            got = torch.from_numpy(tensors[f"blk.{layer}.{name}.weight"].data.copy())
            for e in range(4):
                with open(store / mf.DATA, "rb") as f:
                    f.seek(m.record(layer, e).offset)
                    rec = torch.frombuffer(bytearray(f.read(m.record_bytes)), dtype=torch.uint8)
                t = q.record_types(rec)[which]
                _, _, o, k = q.regions[region]
                want = dequantize_matrix(t, q.region(rec, region)[:matrix_bytes(t, o, k)], o, k).to(torch.bfloat16).float()
                assert torch.equal(got[e], want), (layer, name, e)
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == 320 and bytes(tokens.parts[tokens.data[257]]).decode() == "<|endoftext|>"


@pytest.mark.slow
def test_the_tiny_pipeline_runs_end_to_end_on_the_cpu(tmp_path):
    """Every step of the H200 call on toy widths, one routing and the three-tier placement (in-process, then served)
    to keep CI short. Its figures mean nothing; that each step ran and measured what it says is the test."""
    llama = _llama_cpp()
    out = tmp_path / "out.json"
    r = subprocess.run([sys.executable, "-m", "bench.glm5_next_offload", "--tiny", "--work", str(tmp_path / "w"),
                        "--llama-bin", str(llama / "bin"), "--llama-src", str(llama), "--out", str(out),
                        "--routings", "calibrated", "--placements", "three_tier", "--prefills", "64",
                        "--steps", "4", "--budget-s", "900"],
                       capture_output=True, text=True, cwd=REPO, timeout=1200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["checkpoint"]["layers"] == 5 and doc["checkpoint"]["moe_layers"] == 2
    assert doc["gguf"]["q4_k_m_bytes"] > 0 and "--store" in doc["gguf"]["command"]
    tensors = doc["placements"]["llama_cpp"]
    assert tensors["n_cpu_moe"] == 5 and tensors["share_of_expert_bytes_on_gpu"] == 0.0   # 2 MoE layers: 0 % nearest
    peer = doc["llama_cpp"]["llama_bench"]
    assert peer["decode_tps"] > 0 and peer["prefill_tps_64"] > 0 and "--n-cpu-moe 5" in peer["command"]
    tier = doc["kiln"]["three_tier"]["calibrated"]
    assert tier["decode_tps"] > 0 and tier["provider"] == "TieredExperts"
    assert tier["engine_config"]["ram_slots"] == doc["placements"]["three_tier"]["ram_slots"] == 13    # 39.9 % of 32
    assert tier["lanes_per_token"]["disk"]["bytes_per_token"] > 0        # the rest is read from the store
    assert tier["bench_routing"]["mode"] == "calibrated"
    served = doc["kiln"]["three_tier_served"]["calibrated"]
    assert served["decode_tps"] > 0 and "-m engine serve" in served["command"]
    assert served["lanes_per_token"]["disk"]["bytes_per_token"] > 0      # read from /metrics' lane counters
    assert set(doc["kiln"]) == {"three_tier", "three_tier_served"} and doc["table"][0]["placement"] == "three_tier"
    assert "| three_tier | calibrated |" in r.stdout


def test_an_earlier_calls_peer_figures_are_reused_only_for_the_same_slice():
    prior = {"date": "2026-12-05", "commit": "acdc05c", "checkpoint": {"layers": 5},
             "llama_cpp": {"llama_bench": {"decode_tps": 155.2, "n_cpu_moe": 5}},
             "placements": {"llama_cpp": {"n_cpu_moe": 5, "share_of_expert_bytes_on_gpu": 0.0}}}
    peer, share = glm5_slice.earlier_peer(prior, "prior.json", 5)
    assert peer["llama_bench"]["decode_tps"] == 155.2 and "prior.json" in peer["reused_from"]
    plan = glm5_slice.placements(576, share)
    assert plan["like_for_like"]["gpu_slots"] == 1 and plan["three_tier"]["gpu_slots"] == 66
    with pytest.raises(ValueError, match="no llama-bench run of a 6-layer slice"):
        glm5_slice.earlier_peer(prior, "prior.json", 6)       # another slice: its figures are not this one's
    with pytest.raises(ValueError, match="no llama-bench run"):
        glm5_slice.earlier_peer({"checkpoint": {"layers": 5}, "llama_cpp": {}}, "x.json", 5)   # a Kiln-only call's
