"""The 3090 projection (engine/measure/projection_3090.py, written by bench.projection_3090): it follows from the
measured inputs it names, and says it is one. The inputs are the H200 figures it was first run on, copied into
tests/fixtures/measured."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine.measure import projection_3090 as proj

REPO = Path(__file__).resolve().parent.parent
MEASURED = Path(__file__).resolve().parent / "fixtures" / "measured"
SERVED, QUANT = MEASURED / "h200-served-cpu-lane-2026-12-01.json", MEASURED / "quant-gpu-kernels-2026-12-01.json"


def projected():
    served = json.loads(SERVED.read_text())
    quant = json.loads(QUANT.read_text())
    x = proj.inputs(served, quant)
    return x, proj.project(x)


def test_the_budget_is_kilns_formula_on_48_layers():
    x, res = projected()
    b = res["budget"]
    assert x["kv_tokens"] == 8704 and 0 <= 2163450376 - (x["non_expert_per_layer_bytes"] * 24 + x["embed_and_head_bytes"]) < 24
    assert b["kv_cache_bytes"] == 2 * 4 * 8704 * 4 * 128 * 2 * 48
    assert b["room_for_experts_bytes"] == 24 * 2**30 - b["non_expert_bytes"] - b["kv_cache_bytes"] - b["workspace_bytes"]
    assert b["bf16_gpu_slots"] == b["room_for_experts_bytes"] // 9437184 < 6144
    assert b["int4_gpu_slots"] == 6144                      # 15.4 GB of int4 experts fit: int4 is all resident


def test_each_lane_is_bytes_over_its_rate():
    _, res = projected()
    rows = {(r["quant"], r["routing"], r["engine"]): r for r in res["rows"]}
    today = rows[("bf16", "uniform", "gpu_computes")]
    miss = 1 - res["budget"]["bf16_gpu_slots"] / 6144
    assert abs(today["lane_seconds_per_token"]["pcie"] - miss * 48 * 8 * 9437184 / 25e9) < 1e-6
    assert today["binding_lane"] == "pcie"
    lane = rows[("bf16", "uniform", "with_cpu_lane")]
    assert lane["picks_fraction"]["store"] == 0.0 and lane["lane_seconds_per_token"]["pcie"] == 0.0
    assert lane["projected_tps"] > today["projected_tps"]
    for r in res["rows"]:
        assert r["projected_tps"] == round(1 / max(r["lane_seconds_per_token"].values()), 1)
        assert all(v >= 0 for v in r["lane_seconds_per_token"].values())
    assert [r["engine"] for r in res["rows"] if r["quant"] == "int4"] == ["resident"]


def test_the_file_says_it_is_a_projection_and_where_each_rate_comes_from(tmp_path):
    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, "-m", "bench.projection_3090", "--served", str(SERVED), "--quant", str(QUANT),
                        "--out", str(out)],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("PROJECTION, not measured")
    doc = json.loads(out.read_text())
    assert doc["label"].startswith("PROJECTION (not measured)")
    assert any("measured on the H200" in k for k in doc["sources"]) and "assumed" in doc["sources"]
