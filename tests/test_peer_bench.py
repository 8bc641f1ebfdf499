"""The peer bench's arithmetic and plumbing, on CPU (engine/measure/peer.py, which bench.h200_peer runs): the
--n-cpu-moe the 24 GB budget gives llama.cpp, the bytes a token reads where, a real GGUF's tensor sizes read back,
the report's merge of phase files, and bench.h200_peer's bad arguments (run as a user runs it, never imported).
The llama.cpp runs themselves are the script's `--tiny` dry run against the real CPU build (bench/README.md)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.measure import peer

REPO = Path(__file__).resolve().parent.parent
MEASURED = Path(__file__).resolve().parent / "fixtures" / "measured"
SHAPE = dict(num_hidden_layers=24, num_experts=128, num_experts_per_tok=8, num_key_value_heads=4, head_dim=128,
             vocab_size=151936)
RECORD = 3 * 768 * 2048 * 2                         # one bf16 expert: gate, up, down of 768 x 2048


def bf16_tensors(layers: int = 24) -> dict[str, int]:
    """The 24-layer synthetic checkpoint's GGUF bf16 sizes: experts per layer, and non-expert tensors that add up
    to the safetensors file h200_served measured (2,163,450,376 bytes)."""
    t = {f"blk.{l}.ffn_{n}_exps.weight": 128 * RECORD // 3 for l in range(layers) for n in ("gate", "up", "down")}
    t["token_embd.weight"] = t["output.weight"] = 151936 * 2048 * 2
    t["blk.0.attn_q.weight"] = 2163450376 - 2 * 151936 * 2048 * 2
    return t


def test_the_bf16_budget_is_kilns_formula_on_the_ggufs_sizes():
    b = peer.budget_n_cpu_moe(bf16_tensors(), {**SHAPE}, prefill=8192)
    served = json.loads((MEASURED / "h200-served-2026-12-01.json").read_text())["budget_24gb"]
    # the same room and slots Kiln's tiered run was given
    assert b["kiln_formula_gpu_slots"] == served["gpu_slots"] == 2149
    assert (b["non_expert_bytes"], b["kv_cache_bytes"], b["workspace_bytes"]) == (
        served["non_expert_bytes"], served["kv_cache_bytes"], served["workspace_bytes"])
    # 16 layers' experts (2,048 records) fit that room, 17 (2,176) do not: the first 8 layers' experts go to the CPU
    assert (b["n_cpu_moe"], b["expert_records_on_gpu"]) == (8, 2048)
    assert b["gpu_expert_bytes"] <= b["room_for_experts_bytes"] < b["gpu_expert_bytes"] + 128 * RECORD


def test_experts_that_all_fit_need_no_cpu_layers():
    q4 = {k: (v * 9 // 32 if "_exps" in k else v // 3) for k, v in bf16_tensors().items()}    # ~4.5 bpw
    assert peer.budget_n_cpu_moe(q4, {**SHAPE}, prefill=8192)["n_cpu_moe"] == 0


def test_uneven_layers_count_from_the_first_layer():
    """Q4_K_M gives some layers' ffn_down_exps more bits: the layers kept on the GPU are the last ones, so N is
    found by their sizes, not by an average."""
    t = bf16_tensors()
    for l in range(16, 24):                                # the last 8 layers a quarter bigger
        t[f"blk.{l}.ffn_down_exps.weight"] += 128 * RECORD // 4
    b = peer.budget_n_cpu_moe(t, {**SHAPE}, prefill=8192)
    sizes = b["expert_bytes_by_layer"]
    assert sum(sizes[b["n_cpu_moe"]:]) <= b["room_for_experts_bytes"] < sum(sizes[b["n_cpu_moe"] - 1:])
    assert b["n_cpu_moe"] == 10                            # room // the average layer would say 15 layers: N = 9


def test_token_bytes_split_by_where_the_experts_live():
    t = bf16_tensors()
    all_gpu, cpu8 = peer.token_bytes(t, {**SHAPE}, 0), peer.token_bytes(t, {**SHAPE}, 8)
    # h200_served's token_bytes on the same checkpoint: 1,541,124,616 non-expert + 1,811,939,328 expert bytes
    assert all_gpu == {"gpu": 1541124616 + 1811939328, "cpu": 0}
    assert cpu8["cpu"] == 8 * 8 * RECORD and cpu8["gpu"] + cpu8["cpu"] == all_gpu["gpu"]
    bound = peer.lane_bound(cpu8, {"hbm_gbps": 4240.53, "dram_read_16t_gbps": 73.91})
    assert bound["bound_tps"] == round(1 / (cpu8["cpu"] / 73.91e9), 1)      # the CPU lane binds


def test_a_real_gguf_is_read_back_by_layer(tmp_path):
    import gguf
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    arrays = {"token_embd.weight": np.zeros((10, 4), np.float32), "blk.0.ffn_gate_exps.weight": np.zeros((2, 3, 4), np.float32),
              "blk.0.ffn_down_exps.weight": np.zeros((2, 4, 3), np.float32), "blk.1.ffn_up_exps.weight": np.zeros((2, 5, 4), np.float32),
              "blk.1.attn_q.weight": np.zeros((4, 4), np.float32)}
    for name, a in arrays.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tensors = peer.gguf_tensors(path)                                  # the installed gguf package (llama.cpp's gguf-py)
    assert tensors == {k: a.nbytes for k, a in arrays.items()}
    assert peer.expert_bytes_by_layer(tensors, 2) == [2 * 2 * 3 * 4 * 4, 2 * 5 * 4 * 4]


def test_each_type_of_a_q4_k_m_file_names_its_cuda_path(tmp_path):
    """A real GGUF holding what llama-quantize's Q4_K_M of the qwen3moe slice holds (Q4_K and Q6_K experts, Q8_0 and
    Q6_K dense matrices, F32 norms) and one type Kiln lacks: each (type, role) is named with the path Kiln's CUDA
    serving takes, and the foreign type as NO KERNEL (bench.h200_gguf records this beside its speeds)."""
    import gguf
    q = gguf.GGMLQuantizationType
    path = tmp_path / "q4km.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    raw = {"blk.0.ffn_gate_exps.weight": (q.Q4_K, (2, 4, 144)), "blk.0.ffn_up_exps.weight": (q.Q4_K, (2, 4, 144)),
           "blk.0.ffn_down_exps.weight": (q.Q6_K, (2, 4, 210)), "blk.0.attn_q.weight": (q.Q8_0, (8, 34 * 8)),
           "output.weight": (q.Q6_K, (8, 210)), "blk.0.attn_k.weight": (q.TQ1_0, (8, 54))}
    for name, (ty, shape) in raw.items():
        w.add_tensor(name, np.zeros(shape, np.uint8), raw_dtype=ty)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(256, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert peer.cuda_paths(path) == {
        "F32: float, as it is": {"dense": 1},
        "Q4_K: triton, quant_triton typed expert kernels": {"expert": 2},
        "Q6_K: triton, ggml_linear on its blocks": {"dense": 1},
        "Q6_K: triton, quant_triton typed expert kernels": {"expert": 1},
        "Q8_0: triton, ggml_linear on its blocks": {"dense": 1},
        "TQ1_0: NO KERNEL": {"dense": 1}}


def phase_file(d: Path, phase: str, body: dict) -> None:
    (d / f"peer-{phase}.json").write_text(json.dumps({"phase": phase, **body}))


def test_the_report_sets_each_placement_beside_kilns(tmp_path, capsys):
    bench = {"all_gpu": {"n_cpu_moe": 0, "decode_tps": 400.0, "prefill_tps_8192": 10000.0},
             "n_cpu_moe_8_budget": {"n_cpu_moe": 8, "decode_tps": 100.0, "prefill_tps_8192": 1000.0},
             "n_cpu_moe_7": {"n_cpu_moe": 7, "decode_tps": 110.0}}
    serve = {"all_gpu": {"n_cpu_moe": 0, "decode_tps": 380.0, "prefill_tps": 9000.0},
             "n_cpu_moe_8_budget": {"n_cpu_moe": 8, "decode_tps": 90.0, "prefill_tps": 1200.0}}
    one, two = tmp_path / "call1", tmp_path / "call2"
    one.mkdir(), two.mkdir()
    phase_file(one, "bench-bf16", {"budget_24gb": {"n_cpu_moe": 8}, "llama_bench": bench})
    phase_file(two, "serve-bf16", {"budget_24gb": {"n_cpu_moe": 8}, "llama_server": serve})
    phase_file(two, "bench-q4", {"budget_24gb": {"n_cpu_moe": 0},
                                 "llama_bench": {"all_gpu": {"n_cpu_moe": 0, "decode_tps": 500.0}}})
    # two of Kiln's served files (one device call rarely holds every config): a run in the later one wins
    kiln, kiln4 = tmp_path / "kiln.json", tmp_path / "kiln-int4.json"
    kiln4.write_text(json.dumps({"date": "d", "command": "c4", "runs": {
        "resident": {"served": {"decode_tps": 1.0, "prefill_tps": 1.0}},
        "resident_int4": {"inprocess": {"decode_tps": 250.0, "prefill_tps": 1.0}},
        "budget_24gb_int4": {"inprocess": {"decode_tps": 400.0, "prefill_tps": 1.0}}}}))
    kiln.write_text(json.dumps({"date": "d", "command": "c", "runs": {
        "resident": {"served": {"decode_tps": 200.0, "prefill_tps": 3000.0}},
        "tiered_24gb": {"served": {"decode_tps": 150.0, "prefill_tps": 2400.0}}}}))
    args = type("A", (), {"from_": [str(one), str(two)], "kiln": [str(kiln4), str(kiln)]})()
    out = peer.report(args)
    q4 = [r for r in out["rows"] if r["quant"] == "q4"]
    rows = {r["run"]: r for r in out["rows"] if r["quant"] == "bf16"}
    assert list(rows) == ["all_gpu", "n_cpu_moe_8_budget", "n_cpu_moe_7"]
    # Q4_K_M all fits: all on the GPU is the budget too, beside both of Kiln's int4 runs
    assert [r["kiln_runs"] for r in q4] == [{"all_gpu": "resident_int4", "budget": "budget_24gb_int4"}]
    assert rows["n_cpu_moe_8_budget"]["is_24gb_budget"] and not rows["all_gpu"]["is_24gb_budget"]
    assert rows["n_cpu_moe_7"]["kiln_served"] is None         # an extra has no Kiln counterpart
    assert rows["n_cpu_moe_8_budget"]["kiln_runs"] == {"budget": "tiered_24gb"}
    t = out["targets"]
    assert t["bf16_budget_kiln_over_llama_bench_decode"] == 1.5
    assert t["bf16_budget_kiln_over_llama_server_prefill_8k"] == 2.0
    assert t["bf16_all_gpu_kiln_over_llama_bench_decode"] == 0.5
    assert (t["q4_all_gpu_kiln_over_llama_bench_decode"], t["q4_budget_kiln_over_llama_bench_decode"]) == (0.5, 0.8)
    assert "| bf16 | n_cpu_moe_8_budget (24 GB budget) | 8 | 100.0 |" in capsys.readouterr().out
    assert [s["runs"] for s in out["kiln_source"]] == [["budget_24gb_int4", "resident", "resident_int4"],
                                                       ["resident", "tiered_24gb"]]


@pytest.mark.parametrize("argv, message", [
    (["--phase", "bogus"], "--phase: unknown bogus"),
    (["--phase", "convert"], "needs --llama-bin, --llama-src and --out-dir"),
    (["--phase", "report", "--extra-n-cpu-moe", "int3=2"], "'int3=2' is not QUANT=N"),
])
def test_bad_arguments_get_one_line(argv, message):
    r = subprocess.run([sys.executable, "-m", "bench.h200_peer", *argv], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr
