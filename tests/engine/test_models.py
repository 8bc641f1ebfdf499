"""The engine's models against transformers' own implementation of each architecture, on tiny random
checkpoints written by transformers' save_pretrained (tests/fixtures/tiny_models.py)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.checkpoint import Checkpoint, CheckpointError
from engine.model_config import ModelConfig
from engine.experts.provider import ExpertProvider
from engine.loader import load_model, resolve_dtype
from engine.tiers import in_memory
from tests.fixtures.decode import greedy

ARCHS = ["qwen3_moe", "glm4_moe", "mixtral"]
PROMPT = [5, 17, 200, 42, 99, 7, 311, 64, 128, 3, 250, 19]


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """transformers' model for each tiny checkpoint, fp32, loaded once per module."""
    from transformers import AutoModelForCausalLM
    cache = {}

    def get(arch: str, dtype=torch.float32):
        if (arch, dtype) not in cache:
            m = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(arch), dtype=dtype).eval()
            m.generation_config.eos_token_id = None      # compare full-length greedy runs
            cache[arch, dtype] = m
        return cache[arch, dtype]
    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_logits_equal_transformers(arch, tiny_checkpoint, reference):
    model = load_model(tiny_checkpoint(arch), max_context=64, max_batch=2)
    seq = torch.tensor(PROMPT)
    with torch.inference_mode():
        want = reference(arch)(seq[None]).logits[0]
        got = [model.prefill(seq[:6], slot=1, all_logits=True)]
        got += [model.decode_step([int(seq[i])], [1], [i]) for i in range(6, len(PROMPT))]
    got = torch.cat(got)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_transformers_generate(arch, tiny_checkpoint, reference):
    model = load_model(tiny_checkpoint(arch), max_context=64, max_batch=1)
    with torch.inference_mode():
        want = reference(arch).generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False,
                                        pad_token_id=0)[0, len(PROMPT):].tolist()
        got, _ = greedy(model, PROMPT, 20)
    assert len(want) == 20 and got == want


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_logits_match_transformers_bf16(arch, tiny_checkpoint, reference):
    model = load_model(tiny_checkpoint(arch), max_context=64, dtype="bfloat16")
    assert model.embed.dtype == torch.bfloat16 and model.kv.k.dtype == torch.bfloat16
    with torch.inference_mode():
        want = reference(arch, torch.bfloat16)(torch.tensor([PROMPT])).logits[0].float()
        got = model.prefill(PROMPT, 0, all_logits=True).float()
    # Same ops in the same dtype: at most about one bf16 ulp at these magnitudes (~2.5).
    torch.testing.assert_close(got, want, atol=0.05, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("slots", [[0, 1, 2], [3, 0, 2]], ids=["contiguous", "scattered"])
def test_batched_decode_equals_each_alone(arch, slots, tiny_checkpoint):
    model = load_model(tiny_checkpoint(arch), max_context=64, max_batch=4)
    prompts = [PROMPT[:4], PROMPT, PROMPT[3:11]]          # different lengths: 4, 12, 8
    steps = 8
    with torch.inference_mode():
        alone = [greedy(model, p, steps, slot=0) for p in prompts]
        last = []
        for p, s in zip(prompts, slots):
            last.append(int(model.prefill(p, s).argmax()))
        toks = [[t] for t in last]
        batch_logits = [[] for _ in prompts]
        for i in range(steps - 1):
            logits = model.decode_step([t[-1] for t in toks], slots, [len(p) + i for p in prompts])
            for b in range(len(prompts)):
                toks[b].append(int(logits[b].argmax()))
                batch_logits[b].append(logits[b])
    for b, (want_toks, want_logits) in enumerate(alone):
        assert toks[b] == want_toks
        torch.testing.assert_close(torch.stack(batch_logits[b]), torch.stack(want_logits[1:]), atol=1e-4, rtol=0)


class RecordingExperts(ExpertProvider):
    """The real in-memory provider, recording which experts each layer was asked for."""

    def __init__(self, inner):
        self.inner, self.layout, self.calls = inner, inner.layout, {}

    def forward(self, layer, x, topk_ids, topk_weights):
        assert topk_ids.dtype == torch.int64 and topk_ids.shape == topk_weights.shape == (x.shape[0], topk_ids.shape[1])
        self.calls.setdefault(layer, []).append((topk_ids.clone(), topk_weights.clone()))
        return self.inner.forward(layer, x, topk_ids, topk_weights)

    def counters(self):
        return self.inner.counters()


@pytest.mark.parametrize("arch", ARCHS)
def test_routing_is_exercised_and_layers_are_addressed_by_checkpoint_index(arch, tiny_checkpoint):
    ckpt = Checkpoint(tiny_checkpoint(arch))
    rec = RecordingExperts(in_memory(ckpt))
    model = load_model(ckpt.dir, provider=rec, max_context=64)
    with torch.inference_mode():
        model.prefill(PROMPT, 0)
    assert sorted(rec.calls) == ckpt.moe_layers                 # GLM: layer 0 is dense, never asked
    cfg = model.cfg
    for layer, [(ids, weights)] in rec.calls.items():
        # Many experts in play, and tokens disagree: routing is neither uniform nor constant.
        assert len(torch.unique(ids)) >= cfg.top_k + 2, (layer, ids)
        assert len({tuple(sorted(r)) for r in ids.tolist()}) > 1
        sums = weights.sum(-1)
        expect = cfg.routed_scaling_factor if cfg.norm_topk_prob else None
        if expect is not None:
            torch.testing.assert_close(sums, torch.full_like(sums, expect), atol=1e-5, rtol=0)


def test_glm_grouped_topk_matches_transformers_router_and_excludes_a_group(tiny_checkpoint, reference):
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    model = load_model(tiny_checkpoint("glm4_moe"), max_context=64)
    cfg = model.cfg
    assert (cfg.n_group, cfg.topk_group, cfg.n_experts) == (2, 1, 8)
    block = model.layers[1].mlp
    ref_router: Glm4MoeTopkRouter = reference("glm4_moe").model.layers[1].mlp.gate
    x = torch.randn(256, cfg.hidden, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ids, weights = block.route(x)
        _, ref_w, ref_ids = ref_router(x)
    order, ref_order = ids.sort(-1), ref_ids.sort(-1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), ref_w.gather(1, ref_order.indices), atol=1e-6, rtol=0)

    per_group = cfg.n_experts // cfg.n_group
    groups = ids // per_group
    assert (groups == groups[:, :1]).all(), "topk_group=1: every token's experts come from one group"
    assert len(torch.unique(groups)) == 2, "both groups are chosen for some tokens"
    # The restriction matters: plain top-k on the biased scores would mix groups for some tokens.
    scores = torch.sigmoid(x @ block.gate.T) + block.bias
    plain_groups = scores.topk(cfg.top_k, dim=-1).indices // per_group
    assert (plain_groups != plain_groups[:, :1]).any(dim=-1).sum() > 10


def _copy_with_config(src, dst, edit):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_config_reads_published_rope_keys_like_transformers_5(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("glm4_moe")
    saved = ModelConfig.from_checkpoint(Checkpoint(src))
    assert (saved.rotary_dim, saved.rope_theta, saved.routing) == (8, 10000.0, "sigmoid_grouped")

    def published(cfg):            # GLM-4.5's config.json style: top-level rope keys
        rp = cfg.pop("rope_parameters")
        cfg["rope_theta"], cfg["partial_rotary_factor"], cfg["rope_scaling"] = rp["rope_theta"], 0.5, None
    assert ModelConfig.from_checkpoint(Checkpoint(_copy_with_config(src, tmp_path / "pub", published))) == saved

    def no_partial(cfg):           # absent: Glm4MoeConfig's default of 0.5
        cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    assert ModelConfig.from_checkpoint(Checkpoint(_copy_with_config(src, tmp_path / "dflt", no_partial))) == saved


@pytest.mark.parametrize("edit, words", [
    (lambda c: c.update(num_key_value_heads=3), ["num_attention_heads 4", "num_key_value_heads 3"]),
    (lambda c: c.update(num_experts_per_tok=9), ["num_experts_per_tok 9", "8 experts"]),
    (lambda c: c.update(n_group=3), ["n_routed_experts 8", "n_group 3"]),
    (lambda c: c.update(topk_group=3), ["topk_group 3", "n_group 2"]),
    (lambda c: c["rope_parameters"].update(rope_type="yarn"), ["rope_type 'yarn'"]),
], ids=["gqa", "top_k", "groups", "topk_group", "rope"])
def test_config_invariants_name_the_keys(edit, words, tiny_checkpoint, tmp_path):
    bad = _copy_with_config(tiny_checkpoint("glm4_moe"), tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as e:
        ModelConfig.from_checkpoint(Checkpoint(bad))
    assert str(bad / "config.json") in str(e.value)
    for w in words:
        assert w in str(e.value)


def test_loader_refuses_tensors_the_model_would_ignore(tiny_checkpoint, tmp_path):
    # An unknown variant (here: attention sinks) must not load as if it were the plain architecture.
    from safetensors.torch import save_file
    bad = _copy_with_config(tiny_checkpoint("qwen3_moe"), tmp_path / "bad", lambda c: None)
    save_file({"model.layers.1.self_attn.sinks": torch.zeros(4)}, bad / "extra.safetensors")
    with pytest.raises(CheckpointError, match="1 tensors are not part of the qwen3_moe model .* "
                                              "model.layers.1.self_attn.sinks"):
        load_model(bad)


def test_dtype_and_context_arguments_are_checked(tiny_checkpoint):
    assert resolve_dtype("cpu", None, torch.float16) == torch.float32
    assert resolve_dtype("cpu", None, torch.bfloat16) == torch.bfloat16
    assert resolve_dtype("cuda", None, torch.float32) == torch.bfloat16
    assert resolve_dtype("cuda", "float16", torch.float32) == torch.float16
    with pytest.raises(ValueError, match="dtype float16 is not supported on cpu"):
        resolve_dtype("cpu", "float16", torch.float32)
    with pytest.raises(ValueError, match="context 5000 must be within 2..4096"):
        load_model(tiny_checkpoint("qwen3_moe"), max_context=5000)


def test_store_provider_gives_the_same_logits(tiny_checkpoint, tmp_path):
    """The tiered provider (RAM tier of two experts, so the O_DIRECT store is read) changes nothing."""
    from engine.store.pack import pack_store

    src = tiny_checkpoint("qwen3_moe")
    pack_store(src, tmp_path / "store")
    plain = load_model(src, max_context=64)
    tiered = load_model(src, store_dir=tmp_path / "store", ram_slots=2, readers=2, max_context=64)
    try:
        with torch.inference_mode():
            a, _ = greedy(plain, PROMPT, 8)
            b, _ = greedy(tiered, PROMPT, 8)
            assert a == b
            torch.testing.assert_close(tiered.prefill(PROMPT, 1, all_logits=True),
                                       plain.prefill(PROMPT, 1, all_logits=True), atol=1e-6, rtol=0)
        assert tiered.provider.counters()["store_read_bytes"] > 0
    finally:
        if close := getattr(tiered.provider, "close", None):
            close()
