"""The CUDA path: slot kernels, the resident and tiered providers, graph decode, and what `engine serve
--device cuda` builds from them.

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

from engine.experts.layout import ExpertLayout  # noqa: E402
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


# bf16: Triton's interpreter (no GPU) rounds to bf16 toward zero, not to nearest as a GPU does: a little more slack.
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2 if CUDA else 3e-2)])
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
    from engine.tiers.resident import ResidentExperts
    from engine.loader import load_model
    from engine.tiers import build_provider
    model_dir, store = synth_model
    dtype = "bfloat16"
    res = load_model(model_dir, provider=ResidentExperts.from_store(store, DEV), device=DEV, dtype=dtype, max_context=64)
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


@pytest.fixture(scope="module")
def tiny_store(tiny_checkpoint, tmp_path_factory):
    """A tiny qwen3_moe checkpoint with its tokenizer (what `engine serve` loads) and its rows-order store."""
    from engine.store.pack import pack_store
    ck = tiny_checkpoint("qwen3_moe", experts=16, top_k=4, layers=3)
    store = tmp_path_factory.mktemp("tiny-store") / "store"
    pack_store(ck, store, dtype=torch.bfloat16)          # the CUDA compute dtype: records are computed as stored
    return ck, store


PROMPTS = [[5, 17, 200, 42, 99, 7, 311, 64, 128, 3, 250, 19], [8, 9, 10, 11], [300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


def _one_by_one(llm, prompts, n=24):
    """Greedy tokens of each prompt alone (batch 1: the same batches whatever the timing)."""
    from engine.llm import SamplingParams
    return [[t.id for t in llm.generate(p, SamplingParams(max_tokens=n, ignore_eos=True))] for p in prompts]


def _streams(llm, prompts, n=24):
    """Greedy tokens of every prompt, all streaming at once (continuous batching: 1..3 sequences a step;
    which steps batch which sequences depends on timing, so these are not compared token for token)."""
    from engine.llm import SamplingParams
    its = [llm.stream(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in prompts]
    out = [[] for _ in prompts]
    live = list(range(len(prompts)))
    while live:
        for i in list(live):
            t = next(its[i])
            out[i].append(t.id)
            if t.finish is not None:
                live.remove(i)
    return out


@needs_cuda
def test_served_engine_is_graph_captured_and_equals_eager(tiny_store, caplog):
    """What `engine serve --device cuda` builds (LLM.load, defaults): every expert resident, decode from CUDA
    graphs, per batch size as streams join and leave, with the tokens of eager decode."""
    import logging
    from engine.llm import LLM
    from engine.tiers.resident import ResidentExperts
    ck, store = tiny_store
    with caplog.at_level(logging.INFO, logger="engine.tiers"):
        served = LLM.load(ck, store, device="cuda", max_context=256, max_batch=3)
    with served, LLM.load(ck, store, device="cuda", max_context=256, max_batch=3, cuda_graphs=False) as eager:
        assert isinstance(served.model.provider, ResidentExperts) and served.model.graphs is not None
        assert eager.model.graphs is None
        assert any("experts: resident" in r.message and "fit the GPU budget" in r.message for r in caplog.records)
        assert _one_by_one(served, PROMPTS) == _one_by_one(eager, PROMPTS)
        assert [len(t) for t in _streams(served, PROMPTS)] == [24] * 3
        g = served.model.graphs
        assert {b for b, _ in g.graphs} >= {1, 2} and g.replays >= 3 * 23 and g.pieces_per_step == 1
        assert served.counters()["decode_graph_replays"] == g.replays


@needs_cuda
def test_decoding_ahead_from_graphs_gives_the_step_by_step_tokens(tiny_store):
    """`engine serve --device cuda`'s default on a resident engine: each greedy step's graph is fed the last step's
    argmax on the device and launched before the host reads that step's tokens (engine.llm's decode ahead); the
    tokens are --no-decode-ahead's, and streams that join and leave mid-batch run to their lengths."""
    from engine.llm import LLM
    ck, store = tiny_store
    with LLM.load(ck, store, device="cuda", max_context=256, max_batch=3) as ahead, \
            LLM.load(ck, store, device="cuda", max_context=256, max_batch=3, decode_ahead=False) as plain:
        assert ahead._chain and not plain._chain and ahead.model.graphs is not None
        assert _one_by_one(ahead, PROMPTS) == _one_by_one(plain, PROMPTS)
        c = ahead.counters()
        # 23 decode steps a prompt: the first from the host's token, the other 22 launched ahead, each used.
        assert c["decode_ahead_steps_total"] == 3 * 22 and c["decode_ahead_redone_total"] == 0
        assert plain.counters()["decode_ahead_steps_total"] == 0
        assert [len(t) for t in _streams(ahead, PROMPTS)] == [24] * 3
        assert ahead.counters()["decode_ahead_steps_total"] > 3 * 22


@needs_cuda
def test_a_prompt_alone_is_prefilled_in_larger_chunks_and_chunks_see_what_one_prefill_sees(tiny_store):
    """On CUDA a prompt with no stream decoding beside it is prefilled ALONE_CHUNKS chunks a turn, beside a
    decoding stream chunk_size tokens a turn (the stream waits at most one chunk); a later chunk attends through
    the lower-right causal bias (flash attention), and the chunks' last logits are one whole prefill's."""
    from engine.llm import LLM, SamplingParams
    from engine.scheduler import ALONE_CHUNKS
    ck, store = tiny_store
    prompt = [(7 * i + 3) % 300 for i in range(150)]
    # (the prompt is sent again below: with no prefix reuse, so every chunk is prefilled)
    with LLM.load(ck, store, device="cuda", max_context=512, max_batch=2, chunk_size=16, prefix_cache=False) as llm:
        m, sizes = llm.model, []
        real = m.prefill

        def spy(ids, slot, start=0, all_logits=False):
            sizes.append(len(ids))
            return real(ids, slot, start=start, all_logits=all_logits)

        m.prefill = spy
        llm.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        assert ALONE_CHUNKS > 1 and sizes == [16 * ALONE_CHUNKS, 16 * ALONE_CHUNKS, 150 - 32 * ALONE_CHUNKS]
        sizes.clear()
        it = llm.stream(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
        next(it)                                            # its prompt is in: it decodes from here on
        llm.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        assert sizes == [12] + [16] * 9 + [6]
        for _ in it:                                        # run out: the scheduler idle before the model is used
            pass
        m.prefill = real
        with torch.inference_mode():
            whole = m.prefill(prompt, 0).float()
            for start in range(0, 150, 40):
                part = m.prefill(prompt[start:start + 40], 0, start=start)
        part = part.float()
        assert float((whole - part).norm() / whole.norm()) < 2e-2 and int(whole.argmax()) == int(part.argmax())


@needs_cuda
def test_tiered_engine_decodes_from_graph_pieces_with_the_resident_tokens(tiny_store, caplog):
    """Under a small GPU budget auto picks the tiered provider; its decode replays graph pieces between the
    routing reads and gives the resident engine's tokens, misses and all."""
    import logging
    from engine.llm import LLM
    from engine.tiers.tiered import TieredExperts
    ck, store = tiny_store
    with caplog.at_level(logging.INFO, logger="engine.tiers"):
        # cpu_experts off: every pick on the GPU, so the resident engine's tokens bit for bit and one cut per
        # layer (the CPU lane's split is tests/engine/test_cpu_lane_cuda.py's)
        tiered = LLM.load(ck, store, device="cuda", max_context=256, max_batch=3, gpu_slots=16, ram_slots=9,
                          cpu_experts="off")
    with tiered, LLM.load(ck, store, device="cuda", max_context=256, max_batch=3, cuda_graphs=False) as ref:
        p = tiered.model.provider
        assert isinstance(p, TieredExperts) and tiered.model.graphs is not None and p.predictor is not None
        assert any("experts: tiered" in r.message and "exceed the GPU budget" in r.message for r in caplog.records)
        want = _one_by_one(ref, PROMPTS)
        assert _one_by_one(tiered, PROMPTS) == want
        assert [len(t) for t in _streams(tiered, PROMPTS)] == [24] * 3
        g = tiered.model.graphs
        assert g.replays >= 24 and g.pieces_per_step == 3 + 1        # cut at each of the 3 MoE layers
        c = p.counters()
        assert c["store_read_bytes"] > 0 and c["served"]["store"] > 0 and c["pcie_bytes"] > 0
        forced = LLM.load(ck, store, device="cuda", max_context=256, max_batch=3, experts="tiered", cpu_experts="off",
                          zero_copy="off")
        with forced:
            assert isinstance(forced.model.provider, TieredExperts)
            assert _one_by_one(forced, PROMPTS[:1]) == want[:1]


@needs_cuda
@pytest.mark.parametrize("placement", ["resident", "tiered", "zero_copy"])
def test_graph_decode_equals_eager_as_the_batch_grows_and_shrinks(tiny_store, placement):
    """decode_step from graphs against eager decode over the same batches: slots joining and leaving,
    non-contiguous slots, a KV bucket crossed (positions past 256). tiered: 16 GPU slots and 9 in RAM over the
    48 records (piecewise, store reads); zero_copy: 16 + 40, every record held."""
    from engine.loader import load_model
    ck, store = tiny_store
    kw = {"experts": "tiered" if placement != "resident" else "resident", "cpu_experts": "off",
          "gpu_slots": 16 if placement != "resident" else None, "zero_copy": "on" if placement == "zero_copy" else "off",
          "ram_slots": {"tiered": 9, "zero_copy": 40}.get(placement)}
    models = [load_model(ck, store_dir=store, device=DEV, max_context=512, max_batch=4, cuda_graphs=g, **kw)
              for g in (True, False)]
    assert models[0].graphs is not None and models[1].graphs is None
    schedule = [[0], [0, 2], [0, 2, 3], [2, 3], [3], [0, 3]]
    start = 250
    with torch.inference_mode():
        runs = []
        for m in models:
            toks = {s: int(m.prefill(torch.tensor(PROMPTS[s % 3]) + s, s, start=start - len(PROMPTS[s % 3])).argmax())
                    for s in (0, 2, 3)}
            pos = {s: start for s in toks}
            out = []
            for step in range(12):
                batch = schedule[step % len(schedule)]
                logits = m.decode_step([toks[s] for s in batch], batch, [pos[s] for s in batch]).float()
                for s, row in zip(batch, logits):
                    toks[s], pos[s] = int(row.argmax()), pos[s] + 1
                out.append(logits.cpu())
            runs.append(out)
    for a, b in zip(*runs):
        assert float((a - b).norm() / b.norm()) < 1e-2
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    g = models[0].graphs
    assert {b for b, _ in g.graphs} == {1, 2, 3} and {k for _, k in g.graphs} == {256, 512}
    if placement == "zero_copy":
        assert g.pieces_per_step == 1 and all(m.provider.zero_copy is not None for m in models)
        assert models[0].provider.counters()["zero_copy"]["picks"]["ram"] > 0


@needs_cuda
def test_zero_copy_engine_is_one_graph_a_step_with_the_resident_tokens(tiny_store, caplog):
    """What `engine serve --device cuda` builds when GPU slots and the RAM tier hold every record (auto): decode reads
    RAM-tier records in place over PCIe from one CUDA graph a step, launched ahead of the host (async_decode), and
    gives the resident engine's tokens bit for bit; promotions move records behind the steps, no store read."""
    import logging
    from engine.llm import LLM
    from engine.tiers.tiered import TieredExperts
    ck, store = tiny_store
    with caplog.at_level(logging.INFO, logger="engine.tiers"):
        zc = LLM.load(ck, store, device="cuda", max_context=256, max_batch=3, gpu_slots=16, ram_slots=40,
                      cpu_experts="off")
    with zc, LLM.load(ck, store, device="cuda", max_context=256, max_batch=3, cuda_graphs=False) as ref:
        p = zc.model.provider
        assert isinstance(p, TieredExperts) and p.zero_copy is not None and zc.model.async_decode
        assert not zc._chain            # its routing log is read once a step's logits are: no step launched ahead
        assert any("zero-copy decode: on" in r.message for r in caplog.records)
        reads = p.counters()["store_reads"]
        want = _one_by_one(ref, PROMPTS)
        assert _one_by_one(zc, PROMPTS) == want
        assert [len(t) for t in _streams(zc, PROMPTS)] == [24] * 3
        g = zc.model.graphs
        assert g.replays >= 3 * 23 and g.pieces_per_step == 1
        c = p.counters()
        z = c["zero_copy"]
        assert c["store_reads"] == reads and z["picks"]["ram"] > 0 and z["read_in_place_bytes"] > 0
        assert z["promotions"] > 0 and z["demotions"] > 0
        assert torch.equal(p.zero_copy.table.cpu(), p.zero_copy.mirror)
        assert _one_by_one(zc, PROMPTS) == want          # after the promotions: the same tokens again


@needs_cuda
def test_offload_never_changes_a_token_and_graphs_match_eager(synth_model):
    from engine.loader import load_model
    from engine.tiers.resident import ResidentExperts
    from engine.tiers.tiered import TieredExperts
    from engine.store import manifest as mf
    model_dir, store = synth_model
    m = mf.load(store)
    res = load_model(model_dir, provider=ResidentExperts.from_store(store, DEV), device=DEV, dtype="bfloat16",
                     max_context=256, cuda_graphs=False)
    prov = TieredExperts(m, store, device=DEV, gpu_slots=6, ram_slots=9, readers=4)   # 48 records: misses galore
    off = load_model(model_dir, provider=prov, device=DEV, dtype="bfloat16", max_context=256, cuda_graphs=False)
    assert prov.predictor is not None
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
        for model in (res, off):                  # the same steps again, from graphs
            assert model.use_cuda_graphs()
            model.prefill(ids, 0)
            toks = [toks_res[0]]
            for i in range(24):
                toks.append(int(model.decode_step([toks[-1]], [0], [20 + i]).argmax()))
            assert toks == toks_res and model.graphs.replays == 24
    prov.close()


@needs_cuda
@pytest.mark.parametrize("flags,provider", [([], "resident"),
                                            (["--experts", "tiered", "--gpu-slots", "16", "--ram-slots", "9",
                                              "--cpu-experts", "off"], "tiered"),
                                            (["--experts", "tiered", "--gpu-slots", "16", "--ram-slots", "40",
                                              "--zero-copy", "on"], "tiered")])
def test_engine_serve_on_cuda_streams_from_graphs(tiny_store, tmp_path, flags, provider):
    """A real `engine serve --device cuda` subprocess: the streamed completion's tokens come from CUDA-graph
    replays of the provider its /metrics names, and equal the in-process engine's greedy tokens."""
    import json
    import socket
    import time
    import requests
    from engine.llm import LLM, SamplingParams
    ck, store = tiny_store
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--model", str(ck), "--store", str(store),
                             "--device", "cuda", "--port", str(port), "--ctx", "256", "--max-batch", "2", *flags],
                            stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[2])
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                h = requests.get(f"{base}/health", timeout=2)
                assert h.status_code != 500, h.text              # loading failed: say why at once
                if h.status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, "engine serve did not become ready"
            time.sleep(0.2)
        body = {"model": ck.name, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        usage, text = None, ""
        with requests.post(f"{base}/v1/completions", json=body, stream=True, timeout=60) as r:
            assert r.status_code == 200, r.text
            for line in r.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    ev = json.loads(line[6:])
                    usage = ev.get("usage") or usage
                    if ev.get("choices"):
                        text += ev["choices"][0].get("text") or ""
        assert usage["completion_tokens"] == 12 and usage["prompt_tokens"] == len(PROMPTS[0])
        metrics = requests.get(f"{base}/metrics", timeout=10).text
        assert f'kiln_expert_provider{{provider="{provider}"}} 1.0' in metrics
        if "--zero-copy" in flags:
            assert "kiln_zero_copy_decode 1.0" in metrics and "kiln_read_in_place_bytes_total" in metrics
        replays = [float(l.split()[-1]) for l in metrics.splitlines() if l.startswith("kiln_decode_graph_replays_total")]
        assert replays and replays[0] >= 11          # the first token comes from prefill, the rest from graphs
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    with LLM.load(ck, store, device="cuda", max_context=256, max_batch=2, cuda_graphs=False) as eager:
        want = eager.generate(PROMPTS[0], SamplingParams(max_tokens=12, ignore_eos=True))
    assert text == eager.tokenizer.decode([t.id for t in want])
