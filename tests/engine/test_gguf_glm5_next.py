"""A `glm5-next` GGUF (GLM-5.3-Flash's architecture in llama.cpp) made by llama.cpp's own tools is a model Kiln
serves: config, tokenizer and every tensor from the file, the converter's transforms undone.

The files are made from a tiny random transformers glm5_next checkpoint (KDA and DSA layers, a full and a shared
indexer, a dense and MoE layers, 4 mHC streams) by scripts/glm5_next_gguf.py, run as a user runs it: the published
flat form, llama.cpp's convert_hf_to_gguf.py from the pinned sdist (F32), llama-quantize (Q4_K_M). Where that
llama.cpp build is missing the tests skip naming it, except under KILN_REQUIRE_LLAMA_CPP=1 (CI), where they fail.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.checkpoint import Checkpoint
from engine.cli import main
from engine.gguf_model import GgufModel, load_tokenizer
from engine.loader import load_model
from tests.fixtures.llama_server import DEFAULT

REPO = Path(__file__).resolve().parents[2]
PROMPT_LEN, STEPS = 24, 16
HIDDEN = 256        # rows of 256: llama-quantize's Q4_K_M writes real K-quant blocks, not only its fallbacks


def _llama_cpp() -> Path:
    d = Path(os.environ.get("KILN_LLAMA_CPP_DIR") or DEFAULT.parents[1])
    missing = [p for p in (d / "convert_hf_to_gguf.py", d / "bin" / "llama-quantize") if not p.is_file()]
    if missing:
        why = f"no {missing[0]} ($KILN_LLAMA_CPP_DIR); build it with `make llama-cpp`"
        if os.environ.get("KILN_REQUIRE_LLAMA_CPP") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return d


def _convert(ckpt: Path, out: Path, types: str = "F32") -> dict[str, Path]:
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "glm5_next_gguf.py"), str(ckpt), str(out),
                        "--llama-cpp", str(_llama_cpp()), "--types", types],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    return {t: Path(p) for t, p in json.loads(r.stdout).items()}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.fixtures.tiny_models import make_tiny_glm5_next
    # n_group 1, as GLM-5.3-Flash
    return make_tiny_glm5_next(tmp_path_factory.mktemp("glm5") / "ck", hidden=HIDDEN, n_group=1, topk_group=1)


@pytest.fixture(scope="module")
def files(ckpt, tmp_path_factory):
    return _convert(ckpt, tmp_path_factory.mktemp("gguf"), "F32,Q4_K_M")


def _run(model, tokens: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Logits of a prefill then cached decode steps over `tokens`, and the greedy continuation of its prompt."""
    with torch.inference_mode():
        logits = [model.prefill(tokens[:PROMPT_LEN], 0, all_logits=True)]
        logits += [model.decode_step([int(tokens[i])], [0], [i]) for i in range(PROMPT_LEN, len(tokens))]
        out = [int(model.prefill(tokens[:PROMPT_LEN], 1).argmax())]
        for i in range(STEPS - 1):
            out.append(int(model.decode_step([out[-1]], [1], [PROMPT_LEN + i])[0].argmax()))
    return torch.cat(logits), out


TOKENS = torch.randint(0, 384, (PROMPT_LEN + 40,), generator=torch.Generator().manual_seed(7))


def test_f32_gguf_from_llama_cpps_converter_computes_the_checkpoint(ckpt, files):
    g, c = GgufModel(files["F32"]), Checkpoint(ckpt)
    assert (g.arch, g.n_experts, g.hidden, g.moe_intermediate, g.moe_layers) == \
        (c.arch, c.n_experts, c.hidden, c.moe_intermediate, c.moe_layers)
    assert g.config["layer_types"] == c.config["layer_types"] and g.config["indexer_types"] == c.config["indexer_types"]
    assert g.config["linear_attn_config"]["gate_lower_bound"] == -5.0
    for name in c.names():           # every tensor back in transformers' layout (A_log through -exp: an ulp)
        if not name.startswith("model.visual."):
            torch.testing.assert_close(g.tensor(name), c.tensor(name).float(), atol=1e-6, rtol=1e-6, msg=name)
    want, want_greedy = _run(load_model(ckpt, max_context=128, max_batch=2), TOKENS)
    got, got_greedy = _run(load_model(files["F32"], max_context=128, max_batch=2), TOKENS)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert got_greedy == want_greedy and len(set(got_greedy)) > 2


def test_tokenizer_and_chat_template_come_from_the_file(ckpt, files):
    from transformers import AutoTokenizer
    tok, ref = load_tokenizer(GgufModel(files["F32"])), AutoTokenizer.from_pretrained(ckpt)
    msgs = [{"role": "user", "content": "What is 17 * 23? Reply with only the number."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert GgufModel(files["F32"]).config["eos_token_id"] == [ref.eos_token_id]


def test_q4_k_m_from_llama_quantize_loads_and_serves(files, capsys):
    """Every tensor of llama-quantize's Q4_K_M, read by its transformers name (transforms undone on the quantized
    blocks), is within its type's error of the F32 file's (Q4_K on Gaussian weights: ~7%); the model it makes
    computes and serves. Its logits are only loosely those of F32: on random weights a 7% change flips routing and
    the indexer's pools, which the F32 test holds exactly."""
    q, f = GgufModel(files["Q4_K_M"]), GgufModel(files["F32"])
    types = {t.tensor_type.name for t in q.tensors.values()}
    assert "Q4_K" in types and len(types - {"F32"}) >= 2, types        # llama-quantize's mix, as users have it
    assert sorted(q.names()) == sorted(f.names())
    for name in f.names():
        want = f.tensor(name)
        assert float((q.tensor(name) - want).norm()) <= 0.1 * float(want.norm()) + 1e-6, name
    want, _ = _run(load_model(files["F32"], max_context=128, max_batch=2), TOKENS)
    got, greedy = _run(load_model(files["Q4_K_M"], max_context=128, max_batch=2), TOKENS)
    assert torch.isfinite(got).all() and float((got - want).norm() / want.norm()) < 1.0   # unrelated logits: ~1.4
    capsys.readouterr()
    assert main(["generate", "--model", str(files["Q4_K_M"]), "--prompt", "hello", "--max-tokens", "4",
                 "--ctx", "64"]) == 0


def _damaged(files: dict[str, Path], out: Path, edit) -> Path:
    """The flat form the F32 file was made from, with `edit` applied to its tensors, converted by llama.cpp's
    converter (which writes what it is given)."""
    import shutil

    from safetensors.torch import load_file, save_file
    flat = out / "src"
    shutil.copytree(files["F32"].parent / "flat", flat)
    weights = load_file(flat / "model.safetensors")
    edit(weights)
    save_file(weights, flat / "model.safetensors", metadata={"format": "pt"})
    return _convert(flat, out / "bad")["F32"]


def _drop(w):
    del w["model.layers.3.self_attn.g_b_proj.weight"]


def _narrow(w):
    w["model.layers.0.self_attn.f_a_proj.weight"] = w["model.layers.0.self_attn.f_a_proj.weight"][:14].contiguous()


@pytest.mark.slow             # a converter run each (~25 s on the shared 2 cores)
@pytest.mark.parametrize("edit,says", [
    (_drop, "lacks the tensor of model.layers.3.self_attn.g_b_proj.weight"),
    (_narrow, "tensor blk.0.ssm_f_a.weight has shape [256, 14], the metadata says [256, 16]"),
], ids=["missing-tensor", "wrong-shape"])
def test_a_damaged_file_is_one_line_exit_bad_model(files, tmp_path, capsys, edit, says):
    path = _damaged(files, tmp_path, edit)
    for argv in (["verify-model", "--model", str(path)], ["generate", "--model", str(path), "--prompt", "hi"]):
        capsys.readouterr()
        assert main(argv) == 3, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("engine: ") and says in err, (argv, err)


def test_int8_activations_are_refused_for_glm5_next(files):
    """--cpu-activations int8 has no glm5_next path (its CPU forms are torch's): one line from its constructor, not
    a silently float model."""
    with pytest.raises(ValueError, match="glm5_next has no int8-activation path"):
        load_model(files["F32"], max_context=64, max_batch=1, cpu_activations="int8")
