"""The CUDA fast path (engine/gpu): slot kernels, resident and offload providers, graph decode.

On a CUDA machine (the H200 bench machine) everything runs for real, bf16, against transformers.
Without a GPU, the Triton kernels still run for real through Triton's interpreter
(TRITON_INTERPRET=1, when triton is installed) on CPU tensors; the CUDA-only pieces (streams,
page-locked RAM tier, graphs) cannot exist here and are skipped with that reason.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch carry it)")

from engine.experts import ExpertLayout  # noqa: E402
from engine.kernels.triton_moe import slot_moe, slot_moe_reference  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (streams, page-locked memory, graphs)")


@pytest.fixture(scope="module")
def synth_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth")
    subprocess.run([sys.executable, "-m", "engine", "synth", "--out", str(d / "model"), "--store", str(d / "store"),
                    "--layers", "3", "--hidden", "256", "--experts", "16", "--top-k", "4", "--moe-intermediate", "128",
                    "--vocab", "512", "--device", "cpu"], check=True, capture_output=True)
    return d / "model", d / "store"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_slot_kernels_equal_reference(dtype, tol):
    g = torch.Generator().manual_seed(0)
    lay = ExpertLayout(160, 72, dtype)          # not multiples of the blocks: masks are exercised
    for t, k in [(1, 4), (3, 2), (4, 8)]:
        arena = (torch.randn(9, lay.record_elems, generator=g) * 0.1).to(dtype).to(DEV)
        x = torch.randn(t, 160, generator=g).to(dtype).to(DEV)
        slots = torch.randint(0, 9, (t, k), generator=g).to(DEV)
        w = torch.rand(t, k, generator=g).to(dtype).to(DEV)
        got = slot_moe(x, arena, slots, w, lay).float()
        ref = slot_moe_reference(x, arena, slots, w, lay).float()
        assert torch.isfinite(got).all()
        assert float((got - ref).norm() / ref.norm()) < tol


def test_resident_provider_matches_the_tiered_store(synth_model):
    from engine.checkpoint import Checkpoint
    from engine.gpu.providers import GpuResidentExperts
    from engine.loader import load_model
    from engine.tiers import build_provider
    model_dir, store = synth_model
    dtype = "bfloat16"
    res = load_model(model_dir, provider=GpuResidentExperts.from_store(store, DEV), device=DEV, dtype=dtype, max_context=64)
    ref_dev = "cpu"
    ref = load_model(model_dir, provider=build_provider(Checkpoint(model_dir), store, device=ref_dev, ram_slots=5),
                     device=ref_dev, dtype=dtype, max_context=64)
    ids = torch.randint(0, 512, (12,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        a, b = res.prefill(ids, 0).float().cpu(), ref.prefill(ids, 0).float()
        assert float((a - b).norm() / b.norm()) < 2e-2
        tok = int(b.argmax())
        for i in range(4):
            a = res.decode_step([tok], [0], [12 + i]).float().cpu()
            b = ref.decode_step([tok], [0], [12 + i]).float()
            assert float((a - b).norm() / b.norm()) < 3e-2
            tok = int(b.argmax())


@needs_cuda
def test_offload_never_changes_a_token_and_graphs_match_eager(synth_model):
    from engine.gpu.graphs import GraphDecoder
    from engine.gpu.providers import GpuOffloadExperts, GpuResidentExperts, layer_ahead_predictor
    from engine.loader import load_model
    from engine.store import manifest as mf
    model_dir, store = synth_model
    m = mf.load(store)
    res = load_model(model_dir, provider=GpuResidentExperts.from_store(store, DEV), device=DEV, dtype="bfloat16",
                     max_context=256)
    prov = GpuOffloadExperts(m, store, device=DEV, gpu_slots=6, ram_slots=9, readers=4)   # 48 records: misses galore
    off = load_model(model_dir, provider=prov, device=DEV, dtype="bfloat16", max_context=256)
    prov.predictor = layer_ahead_predictor(off)
    ids = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        a, b = res.prefill(ids, 0), off.prefill(ids, 0)
        assert torch.equal(a, b)                  # same kernels, same order: bit for bit
        toks_res, toks_off = [int(a.argmax())], [int(b.argmax())]
        for i in range(24):
            toks_res.append(int(res.decode_step([toks_res[-1]], [0], [20 + i]).argmax()))
            toks_off.append(int(off.decode_step([toks_off[-1]], [0], [20 + i]).argmax()))
        assert toks_res == toks_off
        c = prov.counters()
        assert c["store_read_bytes"] > 0 and c["served"]["store"] > 0
        res.prefill(ids, 0)
        dec = GraphDecoder(res, 1, bucket=64)
        dec.start(torch.tensor([toks_res[0]], device=DEV), torch.tensor([20], device=DEV))
        graph_toks = [toks_res[0]] + [int(t[0, 0]) for t in dec.run(24, 20)]
        assert graph_toks == toks_res
    prov.close()
