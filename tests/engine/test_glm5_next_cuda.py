"""glm5_next on CUDA through the same code as on the CPU, held to the CPU fp32 forward (itself held to
transformers by tests/engine/test_glm5_next.py). Skipped without a CUDA device; the integrator runs it on the H200.
The checkpoint is written from engine.synth's tensor table (tests/fixtures/tiny_models.make_flat_glm5_next), so
this file needs no transformers glm5_next on the GPU machine. Decode replays CUDA graphs of the static-shape step
(engine.models.glm5_next.Glm5DecodeGraphs), held to the eager CUDA step and to the CPU forward, alone, in a batch of
different lengths and through LLM (the serve path, decode ahead included); the routed experts' swiglu_limit through
the Triton kernels is held to the CPU reference (transformers' clamp: tests/engine/test_glm5_next_swiglu_limit.py)."""
from __future__ import annotations

import pytest
import torch

from engine.loader import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PROMPT, STEPS = 40, 24


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.fixtures.tiny_models import make_flat_glm5_next
    return make_flat_glm5_next(tmp_path_factory.mktemp("glm5_flat"))


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 384, (PROMPT + STEPS,), generator=torch.Generator().manual_seed(7))


def _cached(model, tokens, slot=0):
    out = [model.prefill(tokens[:PROMPT], slot, all_logits=True)]
    out += [model.decode_step([int(tokens[i])], [slot], [i]) for i in range(PROMPT, len(tokens))]
    return torch.cat(out).float().cpu()


@pytest.fixture(scope="module")
def cpu_logits(ckpt, tokens):
    model = load_model(ckpt, max_context=128, max_batch=2)
    with torch.inference_mode():
        return model.prefill(tokens, 0, all_logits=True)


def test_cuda_fp32_equals_the_cpu_forward(ckpt, tokens, cpu_logits):
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False     # the KDA conv runs on cuDNN
    try:
        model = load_model(ckpt, device="cuda", dtype="float32", max_context=128, max_batch=2, cuda_graphs=True)
        assert model.graphs is not None                  # decode replays the captured static-shape step
        with torch.inference_mode():
            got = _cached(model, tokens)
        assert model.graphs.replays == STEPS and model.graphs.captures >= 1
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    torch.testing.assert_close(got, cpu_logits, atol=2e-4, rtol=0)


def test_cuda_bf16_tracks_the_cpu_fp32_forward(ckpt, tokens, cpu_logits):
    model = load_model(ckpt, device="cuda", dtype="bfloat16", max_context=128, max_batch=2)
    with torch.inference_mode():
        got = _cached(model, tokens)
    # A random tiny model has flat logits, and bf16 flips near-tied indexer pools at a few positions (O(1) there):
    # judged over all positions. CPU bf16 against the same fp32 forward: top-1 0.89, mean KL 0.015.
    agree = (got.argmax(-1) == cpu_logits.argmax(-1)).float().mean().item()
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), cpu_logits.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1).mean().item()
    assert agree >= 0.8 and kl < 0.05, (agree, kl)


def test_cuda_batched_decode_equals_each_alone(ckpt, tokens):
    model = load_model(ckpt, device="cuda", dtype="float32", max_context=128, max_batch=3)
    prompts = [tokens[:9].tolist(), tokens[:PROMPT].tolist(), tokens[5:28].tolist()]
    with torch.inference_mode():
        alone = [model.prefill(p + [1, 2, 3], 2, all_logits=True)[-4:] for p in prompts]
        last = [model.prefill(p, s, all_logits=True)[-1] for p, s in zip(prompts, [1, 0, 2])]
        rows = [[x] for x in last]
        for i, t in enumerate([1, 2, 3]):
            out = model.decode_step([t] * 3, [1, 0, 2], [len(p) + i for p in prompts])
            for b in range(3):
                rows[b].append(out[b])
    for b in range(3):
        torch.testing.assert_close(torch.stack(rows[b]), alone[b], atol=2e-3, rtol=0)


@pytest.fixture()
def no_tf32():
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def _batch_greedy(model, prompts, slots, steps):
    """Greedy decode of several sequences of different lengths in one batch → (logits [steps, B, V] cpu, tokens)."""
    seqs = [list(p) + [int(model.prefill(p, s).argmax())] for p, s in zip(prompts, slots)]
    rows = []
    for _ in range(steps):
        out = model.decode_step([q[-1] for q in seqs], slots, [len(q) - 1 for q in seqs])
        rows.append(out.float().cpu())
        for q, t in zip(seqs, out.argmax(-1).tolist()):
            q.append(t)
    return torch.stack(rows), seqs


def test_cuda_graphs_equal_eager_and_the_cpu_over_64_steps_in_a_batch(ckpt, tokens, no_tf32):
    """Three sequences of 9, 40 and 23 tokens (longer than index_topk: pools complete and near-ties flip along the
    way), 64 greedy steps: graph replays against the eager CUDA step and the CPU's eager step, fp32."""
    prompts = [tokens[:9].tolist(), tokens[:PROMPT].tolist(), tokens[5:28].tolist()]
    slots = [1, 0, 2]
    runs = {}
    for name, kw in (("graphs", dict(device="cuda", cuda_graphs=True)), ("eager", dict(device="cuda", cuda_graphs=False)),
                     ("cpu", dict(device="cpu"))):
        model = load_model(ckpt, dtype="float32", max_context=128, max_batch=3, **kw)
        assert (model.graphs is not None) == (name == "graphs")
        with torch.inference_mode():
            runs[name] = _batch_greedy(model, prompts, slots, 64)
        if name == "graphs":
            assert model.graphs.replays == 64 and model.graphs.captures >= 1
    for name in ("eager", "cpu"):
        torch.testing.assert_close(runs["graphs"][0], runs[name][0], atol=2e-4, rtol=0)
        assert runs["graphs"][1] == runs[name][1], name


def test_cuda_llm_serve_path_replays_graphs_and_equals_the_cpu(ckpt, tokens, no_tf32):
    """engine serve --device cuda's engine (LLM: the scheduler, decode ahead): two concurrent greedy requests, the
    tokens the CPU engine gives, and the decode steps replayed from graphs."""
    from engine.llm import LLM
    from engine.request import SamplingParams
    prompts = [tokens[:PROMPT].tolist(), tokens[3:20].tolist()]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    out = {}
    for device in ("cuda", "cpu"):
        llm = LLM.load(ckpt, device=device, dtype="float32", max_context=128, max_batch=2)
        try:
            streams = [llm.stream(p, params) for p in prompts]
            out[device] = [[t.id for t in s] for s in streams]
            if device == "cuda":
                c = llm.counters()
                assert c["decode_graph_replays"] > 0 and c["decode_graph_captures"] >= 1, c
        finally:
            llm.close()
    assert out["cuda"] == out["cpu"]
    assert all(len(t) > 10 for t in out["cpu"])


def test_cuda_swiglu_limit_through_the_triton_kernels_equals_the_cpu(tmp_path, tokens, no_tf32):
    """The flat checkpoint with swiglu_limit 0.5 (its routed activations, ~N(0, 1.2), mostly past it): CUDA
    (resident experts: the Triton GEMV kernels in graphs, per-expert GEMMs at prefill) against the CPU forward,
    which tests/engine/test_glm5_next_swiglu_limit.py holds to transformers' clamp; and a real difference from the
    same model without a limit."""
    import json
    from tests.fixtures.tiny_models import make_flat_glm5_next
    ck = make_flat_glm5_next(tmp_path / "limit")
    cfg = json.loads((ck / "config.json").read_text())
    cfg["swiglu_limit"] = 0.5
    (ck / "config.json").write_text(json.dumps(cfg))
    with torch.inference_mode():
        cpu = load_model(ck, max_context=128, max_batch=2).prefill(tokens, 0, all_logits=True)
        model = load_model(ck, device="cuda", dtype="float32", max_context=128, max_batch=2, cuda_graphs=True)
        assert model.provider.swiglu_limit == 0.5 and model.graphs is not None
        got = _cached(model, tokens)
        model.provider.use_swiglu_limit(None)
        plain = model.prefill(tokens, 1, all_logits=True).float().cpu()
    torch.testing.assert_close(got, cpu, atol=2e-4, rtol=0)
    assert (plain - cpu).abs().max() > 1e-2
