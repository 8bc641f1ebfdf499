"""The quantized-records accuracy measure (engine/measure/quant_accuracy.py, which bench.quant_accuracy runs) on
a tiny checkpoint: what it compares is what it says it is.

The full run (SmolLM2, thousands of positions) is bench.quant_accuracy's; here the same code runs on a few
positions, so a change that breaks the bench or makes it compare the wrong records fails.
"""
from __future__ import annotations

import torch

from engine.measure import quant_accuracy as qa


def test_the_reference_agrees_with_itself_and_quantized_records_measure_their_error(tiny_checkpoint):
    from engine.checkpoint import Checkpoint
    model = tiny_checkpoint("qwen3_moe", hidden=128, experts=4, layers=2, top_k=2)
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randint(0, 384, (24,), generator=g).tolist() for _ in range(2)]
    prompts = [torch.randint(0, 384, (6,), generator=g).tolist()]
    res = qa.measure("tiny", model, ["fp32", "int8", "int4", "int4 g128", "int4 g64"], chunks, prompts)
    v = res["variants"]
    assert v["fp32"]["top1_agreement"] == 1.0 and v["fp32"]["kl_mean_nats"] == 0.0     # the reference itself
    assert v["fp32"]["greedy_first_divergence"] == [None]
    assert all(r["positions"] == 48 for r in v.values())
    assert 0 < v["int8"]["kl_mean_nats"] < v["int4"]["kl_mean_nats"]                  # 8 bits lose less than 4
    # a sweep row is the quantized grid itself: g128 over a 64-wide down projection does not apply
    ck = Checkpoint(model)
    assert not qa.applies(ck, "int4 g128") and "int4 g128" not in v and qa.applies(ck, "int4 g64")


def test_a_sweep_row_dequantizes_the_grid_it_names():
    from engine.quant.records import dequantize_matrix, quantize_int4
    w = torch.randn(64, 576, generator=torch.Generator().manual_seed(1))
    got = qa.sweep_matrix(("int4", "former", None), w)                 # 576: 128 does not divide it, 64 does
    assert torch.equal(got, dequantize_matrix("int4", quantize_int4(w, 64), 64, 576, group=64))
    e32 = (qa.sweep_matrix(("int4", 32, None), w) - w).norm()
    assert e32 < (got - w).norm()                                       # smaller groups, finer grids
