"""bench.served_overhead end to end, briefly (run as a user runs it, never imported): a real uvicorn child serving
the GPU double (tests/fixtures/gpu_double.py), the real client, both sides measured. A change that breaks the
bench, or the double's promise (a step takes its --step-ms; the host work holds the GIL for --host-ms), fails here."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_double_takes_its_step_time_and_returns_one_token_for_each_sequence(tiny_checkpoint):
    from engine.llm import LLM
    from tests.fixtures.gpu_double import gpu_double
    with LLM.load(tiny_checkpoint("qwen3_moe"), device="cpu", max_context=256, max_batch=4) as llm:
        gpu_double(llm, 0.02, 0.005)
        t0 = time.perf_counter()
        logits = llm.model.decode_step([1, 2, 3], [0, 1, 2], [5, 5, 5])
        took = time.perf_counter() - t0
        assert 0.02 <= took < 0.2 and logits.shape == (3, llm.model.cfg.vocab_size)
        assert logits.argmax(-1).tolist() == [300 % llm.model.cfg.vocab_size] * 3


def test_one_short_run_measures_both_sides_and_writes_its_json(tmp_path):
    out = tmp_path / "so.json"
    r = subprocess.run([sys.executable, "-m", "bench.served_overhead", "--rounds", "1", "--steps", "24",
                        "--step-ms", "2", "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    run = res["runs"]["step_2.0ms"]
    for side in ("inprocess", "served"):
        m = run["median"][side]
        assert 0 < m["decode_tps_1_stream"] <= 500 and 0 < m["decode_tps_4_streams_aggregate"] <= 2000  # 2 ms a step
    assert set(run["served_over_inprocess"]) == {"1_stream", "4_streams"} and res["commit"]
    assert "| step_2.0ms |" in r.stdout
