"""`engine synth --quant`: a quantized synthetic store is the quantization of the same seed's bf16 store
(what the H200 bench's int4 runs serve), written as pack-store writes one, and it verifies."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.experts.layout import ExpertLayout
from engine.store import manifest as mf


def _synth(d, quant):
    subprocess.run([sys.executable, "-m", "engine", "synth", "--out", str(d / f"model-{quant}"), "--store",
                    str(d / f"store-{quant}"), "--layers", "2", "--hidden", "256", "--experts", "4", "--top-k", "2",
                    "--moe-intermediate", "128", "--vocab", "128", "--device", "cpu", "--quant", quant],
                   check=True, capture_output=True)
    return d / f"model-{quant}", d / f"store-{quant}"


def _record(store, layer, expert) -> torch.Tensor:
    m = mf.load(store)
    with open(store / mf.DATA, "rb") as f:
        f.seek(m.record(layer, expert).offset)
        return torch.frombuffer(bytearray(f.read(m.record_bytes)), dtype=torch.uint8)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_synth_store_is_the_bf16_store_quantized(tmp_path, quant):
    bf_model, bf_store = _synth(tmp_path, "none")
    q_model, q_store = _synth(tmp_path, quant)
    assert (bf_model / "model.safetensors").read_bytes() == (q_model / "model.safetensors").read_bytes()
    m = mf.load(q_store)
    assert m.quant == quant and m.dtype == "uint8"
    bf16 = ExpertLayout(256, 128, torch.bfloat16)
    lay = ExpertLayout(256, 128, torch.uint8, "rows", quant)
    for layer, expert in [(0, 0), (1, 3)]:
        src = _record(bf_store, layer, expert).view(torch.bfloat16)
        assert torch.equal(_record(q_store, layer, expert), lay.pack(*bf16.views(src)))
    r = subprocess.run([sys.executable, "-m", "engine", "verify-store", "--store", str(q_store), "--model",
                        str(q_model), "-q"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
