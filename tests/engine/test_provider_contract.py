"""The provider contract (engine.experts.provider.ExpertProvider) is the only way the engine talks to a provider:
every provider subclasses it, the model calls its hooks where the contract says, the loader hands the predictor in,
and no engine module probes a provider (getattr/hasattr) or sets one's attributes from outside."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from engine.checkpoint import Checkpoint
from engine.experts.provider import ExpertProvider
from engine.loader import load_model
from engine.tiers import in_memory
from engine.tiers.memory import InMemoryExperts
from engine.tiers.resident import ResidentExperts
from engine.tiers.tiered import TieredExperts

ENGINE = Path(__file__).resolve().parents[2] / "engine"


class HookedExperts(ExpertProvider):
    """The real in-memory provider, noting each contract hook the engine calls (no GPU needed to see them)."""

    def __init__(self, inner: InMemoryExperts):
        self.inner, self.layout, self.calls, self.predictor = inner, inner.layout, [], None

    def forward(self, layer, x, topk_ids, topk_weights):
        return self.inner.forward(layer, x, topk_ids, topk_weights)

    def counters(self):
        return self.inner.counters()

    def before_decode(self):
        self.calls.append("before_decode")

    def after_decode_launch(self, pairs):
        self.calls.append(("after_decode_launch", pairs))

    def use_predictor(self, predictor):
        self.predictor = predictor


@pytest.mark.parametrize("cls", [InMemoryExperts, ResidentExperts, TieredExperts])
def test_every_provider_declares_the_contract(cls):
    assert issubclass(cls, ExpertProvider)
    assert cls.forward is not ExpertProvider.forward and cls.counters is not ExpertProvider.counters


def test_the_model_calls_the_hooks_and_the_loader_hands_the_predictor_in(tiny_checkpoint):
    ck = Checkpoint(tiny_checkpoint("qwen3_moe"))
    prov = HookedExperts(in_memory(ck))
    model = load_model(ck.dir, provider=prov, max_context=64, max_batch=2)
    with torch.inference_mode():
        model.prefill([5, 17, 200], 0)
        model.prefill([9, 3], 1)
        assert prov.calls == []                                   # prefill is no decode step
        model.decode_step([42, 7], [0, 1], [3, 2])
    assert prov.calls == ["before_decode", ("after_decode_launch", 2 * model.cfg.top_k)]
    # The predictor it was handed: the next MoE layer and its top-k experts for each token, from this layer's input.
    layers = sorted(ck.moe_layers)
    nxt, ids = prov.predictor(layers[0], torch.randn(3, model.cfg.hidden))
    assert nxt == layers[1] and ids.shape == (3, model.cfg.top_k)
    assert prov.predictor(layers[-1], torch.randn(1, model.cfg.hidden)) is None


def _probes_and_sets(path: Path) -> list[str]:
    """getattr/hasattr calls on anything named *provider*, and assignments to an attribute of one."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and node.args and "provider" in ast.unparse(node.args[0]):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and ast.unparse(t.value).endswith("provider"):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(t)} = ...")
    return found


def test_no_engine_module_probes_a_provider_or_sets_its_attributes(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f(model):\n    if hasattr(model.provider, 'x'):\n        model.provider.recorder = 1\n")
    assert len(_probes_and_sets(probe)) == 2                       # the check sees both kinds
    found = [hit for path in sorted(ENGINE.rglob("*.py")) for hit in _probes_and_sets(path)]
    assert not found, "\n".join(found)
