"""`engine convert`: SmolLM2's GGUF → a Mixtral checkpoint with 8 identical experts per layer (top-2).

The reference is transformers' own GGUF loader on the dense Llama model: an upcycled model computes the
dense function, so greedy output must match token for token and the logits must agree to float rounding.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.smollm2 import pins, smollm2_gguf

REPO = Path(__file__).resolve().parents[2]
ENGINE = [str(Path(sys.executable).parent / "engine")]   # the console script, as the plan runs it
PROMPT = [{"role": "user", "content": "Name three primary colors, comma separated."}]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def gguf() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="module")
def converted(gguf, tmp_path_factory) -> Path:
    # In-process (the CLI's exit codes are tested below): the test process has torch imported already.
    from engine.convert import convert_gguf
    out = tmp_path_factory.mktemp("smollm2") / "model"
    return convert_gguf(gguf, out, experts=8, top_k=2, seed=0)


def test_upcycled_checkpoint_computes_the_dense_model(gguf, converted):
    """Greedy output equal token for token, logits equal to float rounding, on a chat prompt in fp32.

    The dense reference generates greedily; the upcycled model then reads the same sequence in one
    forward pass and must pick the same token at every step (its greedy path is therefore the same
    path) with logits within rounding of the reference's at every position."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralForCausalLM

    tok = AutoTokenizer.from_pretrained(str(converted))
    prompt = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)["input_ids"]
    n = prompt.shape[1]
    with torch.inference_mode():
        dense = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
        assert dense.config.model_type == "llama"
        seq = dense.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        dense_ids = seq[0, n:]
        dense_logits = dense(seq).logits[0]
        del dense
        moe = MixtralForCausalLM.from_pretrained(str(converted), dtype=torch.float32).eval()
        moe_logits = moe(seq).logits[0]

    assert moe_logits.argmax(-1)[n - 1:-1].tolist() == dense_ids.tolist(), \
        (tok.decode(moe_logits.argmax(-1)[n - 1:-1]), tok.decode(dense_ids))
    diff = (moe_logits - dense_logits).abs().max().item()
    assert diff < 1e-3, f"logits differ by {diff}"
    assert "red" in tok.decode(dense_ids).lower()        # a real answer, not two models agreeing on garbage


def test_checkpoint_is_what_the_recipe_and_the_engine_expect(converted):
    import torch
    from engine.checkpoint import Checkpoint

    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["model_type"] == "mixtral" and cfg["num_local_experts"] == 8 and cfg["num_experts_per_tok"] == 2
    assert cfg["tie_word_embeddings"] is True                           # the GGUF has no output.weight
    assert cfg["rope_parameters"]["rope_theta"] == 100000.0
    assert cfg["max_position_embeddings"] == 8192 and abs(cfg["rms_norm_eps"] - 1e-5) < 1e-9
    assert (converted / "tokenizer.json").is_file() and "<|im_start|>" in (converted / "chat_template.jinja").read_text()

    ckpt = Checkpoint(converted)
    store = json.loads((REPO / "recipes/cpu/any/smollm2-135m.kiln.8k.json").read_text())["store"]
    assert len(ckpt.moe_layers) * ckpt.n_experts == store["records"]
    # the store keeps the GGUF's own Q4_1 blocks in the cols order (store.quant gguf)
    from engine.experts.layout import ExpertLayout
    assert store["quant"] == "gguf"
    assert ExpertLayout(ckpt.hidden, ckpt.moe_intermediate, torch.uint8, "cols", "q4_1").record_bytes == store["record_bytes"]
    assert "lm_head.weight" not in ckpt.names()
    for layer in (0, 29):
        first = ckpt.expert(layer, 0)
        for e in range(1, 8):
            assert all(torch.equal(a, b) for a, b in zip(first, ckpt.expert(layer, e))), (layer, e)
        router = ckpt.tensor(f"model.layers.{layer}.block_sparse_moe.gate.weight")
        assert router.shape == (8, 576) and router.std() > 0.01          # seeded random, not zeros
    # Nothing but the checkpoint is left beside it (the staging dir was renamed into place).
    assert [p.name for p in converted.parent.iterdir()] == ["model"]


def test_the_converted_model_lists_every_file_the_server_reads_with_its_sha256(converted):
    """Issue 12 (3): kiln-files.json is written in staging, before publishing, and covers every file there:
    the shards, their index, config, tokenizer files, generation config and chat template."""
    from engine.store import model_manifest as mm

    m = mm.load(converted)
    listed = [e.path for e in m.files]
    on_disk = sorted(p.name for p in converted.iterdir() if p.name not in (mm.NAME, mm.SIDECAR))
    assert listed == on_disk
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "model.safetensors.index.json"} <= set(listed)
    assert any(p.endswith(".safetensors") for p in listed)
    assert mm.verify(m) == []


def test_a_file_that_is_not_gguf_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf" * 100)
    r = subprocess.run([*ENGINE, "convert", "--gguf", str(bad), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 3, r.stderr
    assert r.stderr.count("\n") == 1 and str(bad) in r.stderr and "GGUF" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_an_existing_out_is_not_overwritten(gguf, tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "keep").write_text("x")
    r = subprocess.run([*ENGINE, "convert", "--gguf", str(gguf), "--out", str(out)],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 1 and "already exists" in r.stderr and "--force" in r.stderr
    assert (out / "keep").read_text() == "x"


class _DropsAnInterrupt:
    """A destructor during which SIGINT arrives: its handler's KeyboardInterrupt is raised there, and Python drops it
    ("Exception ignored in __del__"), as it did when a Ctrl-C landed while transformers freed its regex objects."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")    # the dropped interrupt itself
def test_a_ctrl_c_that_python_drops_still_publishes_nothing(gguf, tmp_path, monkeypatch):
    """The real signal and handler (engine.interrupts) and the real convert; only the moment is forced: right after
    the staging directory is complete, inside a destructor. The publish is refused and nothing is left."""
    from engine import convert, interrupts
    write = convert.model_manifest.write

    def write_then_drop(staging):
        write(staging)
        _DropsAnInterrupt()                  # made and freed at once: the signal lands in its __del__
    monkeypatch.setattr(convert.model_manifest, "write", write_then_drop)
    with pytest.raises(KeyboardInterrupt), interrupts.recorded():
        convert.convert_gguf(gguf, tmp_path / "model", 8, 1, 0, expert_weights=False)
    assert list(tmp_path.iterdir()) == []
    with interrupts.recorded():              # a new block starts clean
        interrupts.check()


def test_ctrl_c_half_way_publishes_nothing(gguf, tmp_path):
    out = tmp_path / "model"
    p = subprocess.Popen([*ENGINE, "convert", "--gguf", str(gguf), "--out", str(out)], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        # Interrupt once the staging dir holds a first file: past the start, far from the end.
        while not any(tmp_path.glob(".model.*.partial/config.json")):
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read() if p.poll() is not None else "slow"
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130 and "interrupted" in err
    assert list(tmp_path.iterdir()) == []                # neither --out nor the staging dir


def test_a_full_disk_is_one_line_and_publishes_nothing(gguf, tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        r = subprocess.run([*ENGINE, "convert", "--gguf", str(gguf), "--out", str(mnt / "model")],
                           capture_output=True, text=True, cwd=REPO)
        assert r.returncode == 6, r.stderr
        assert r.stderr.count("\n") == 1 and "disk full" in r.stderr and "needs about 2.6 GiB, 8 MiB free" in r.stderr
        assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_without_expert_weights_the_gguf_packs_the_same_store_and_only_its_own_gguf(gguf, converted, tmp_path):
    """--no-expert-weights leaves the experts' float copies out (2.7 GB of the demo's 2.9 GB): the recipe packs
    its store from the GGUF's own Q4_1 blocks, which then hold the experts alone. That store is byte for byte
    the one packed beside a full conversion; another file than the source GGUF is refused by its sha256, and a
    float/int pack of the expert-less checkpoint is refused in one line, before anything is written."""
    from engine.checkpoint import Checkpoint
    from engine.convert import GGUF_SHA256_KEY

    lean = tmp_path / "lean"
    r = subprocess.run([*ENGINE, "convert", "--gguf", str(gguf), "--out", str(lean), "--no-expert-weights"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    ck, full = Checkpoint(lean), Checkpoint(converted)
    assert not ck.has_experts and full.has_experts
    assert set(ck.names()) == set(full.non_expert_names())
    size = lambda d: sum(p.stat().st_size for p in d.iterdir())          # noqa: E731
    assert size(lean) < 0.2 * size(converted)
    assert json.loads((lean / "config.json").read_text())[GGUF_SHA256_KEY] == pins()["sha256"]
    assert subprocess.run([*ENGINE, "verify-model", "--model", str(lean)], capture_output=True).returncode == 0

    stores = {}
    for name, model in (("lean", lean), ("full", converted)):
        stores[name] = tmp_path / f"store-{name}"
        r = subprocess.run([*ENGINE, "pack-store", "-q", "--model", str(model), "--store", str(stores[name]),
                            "--order", "cols", "--quant", "gguf", "--gguf", str(gguf)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    assert (stores["lean"] / "experts.bin").read_bytes() == (stores["full"] / "experts.bin").read_bytes()

    other = tmp_path / "other.gguf"
    data = bytearray(gguf.read_bytes())
    data[-1] ^= 1                                   # the last tensor byte: still a readable GGUF
    other.write_bytes(data)
    r = subprocess.run([*ENGINE, "pack-store", "--model", str(lean), "--store", str(tmp_path / "t"), "--order", "cols",
                        "--quant", "gguf", "--gguf", str(other)], capture_output=True, text=True)
    assert (r.returncode, r.stderr.count("\n")) == (3, 1) and "source GGUF" in r.stderr, r.stderr
    r = subprocess.run([*ENGINE, "pack-store", "--model", str(lean), "--store", str(tmp_path / "u")],
                       capture_output=True, text=True)
    assert (r.returncode, r.stderr.count("\n")) == (2, 1) and "--quant gguf" in r.stderr, r.stderr
    assert not (tmp_path / "t").exists() and not (tmp_path / "u").exists()


def test_attention_blocks_keep_the_ggufs_bytes_and_the_cpu_computes_what_they_hold(gguf, converted, tmp_path):
    """--attention-blocks writes the GGUF's Q4_1 attention blocks byte for byte (q/k rows moved whole into
    transformers' order), which dequantize to exactly the float checkpoint's weights; on the CPU they are one
    Int4Projection each for qkv and o, equal to a plain dequantize-then-matmul of the same operand with the
    kernel's bf16 edges, and the model computes the float model's function to 4-bit rounding."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from engine.checkpoint import Checkpoint
    from engine.convert import unpermute_qk
    from engine.loader import load_model
    from engine.dense_weights import Int4Projection, Projection
    from engine.quant.records import dequantize_matrix
    from engine.tiers.memory import InMemoryExperts
    from engine.store.source import record_source

    kept = tmp_path / "kept"
    r = subprocess.run([*ENGINE, "convert", "--gguf", str(gguf), "--out", str(kept), "--no-expert-weights",
                        "--attention-blocks"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    ck, full = Checkpoint(kept), Checkpoint(converted)
    names = set(ck.names())
    assert not any(n.endswith("_proj.weight") and ".self_attn." in n for n in names)
    tensors = {t.name: t for t in GGUFReader(str(gguf)).tensors}
    heads = {"q": 9, "k": 3}                       # SmolLM2-135M: 9 query heads, 3 key/value heads
    for layer in (0, 29):
        for gg, hf in (("attn_q", "q"), ("attn_k", "k"), ("attn_v", "v"), ("attn_output", "o")):
            blocks = ck.tensor(f"model.layers.{layer}.self_attn.{hf}_proj.blocks_q4_1")
            raw = np.array(tensors[f"blk.{layer}.{gg}.weight"].data, dtype=np.uint8)
            want = unpermute_qk(raw, heads[hf]) if hf in heads else raw
            assert blocks.dtype == torch.uint8 and np.array_equal(blocks.numpy(), want)
            w = full.tensor(f"model.layers.{layer}.self_attn.{hf}_proj.weight")
            assert torch.equal(dequantize_matrix("q4_1", blocks.reshape(-1), *w.shape), w)

    lay, make = record_source(full, order="cols", quant="gguf", gguf=gguf)
    experts = lambda: InMemoryExperts(lay, {l: torch.stack([make(l, e) for e in range(8)])   # noqa: E731
                                             for l in range(30)})
    m4 = load_model(kept, provider=experts(), device="cpu", max_context=256, max_batch=1)
    mf = load_model(converted, provider=experts(), device="cpu", max_context=256, max_batch=1)
    attn = m4.layers[3].attn
    assert isinstance(attn.qkv, Int4Projection) and isinstance(attn.o, Int4Projection)
    assert isinstance(mf.layers[3].attn.qkv, Projection)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(0))
    bf = lambda t: t.to(torch.bfloat16).float()      # noqa: E731
    ref = bf(bf(x) @ attn.qkv.dequantized().t())
    torch.testing.assert_close(attn.qkv(x), ref, rtol=1e-2, atol=1e-2)
    wqkv = torch.cat([full.tensor(f"model.layers.3.self_attn.{n}_proj.weight") for n in "qkv"])
    assert (attn.qkv.dequantized() - wqkv).abs().max() < 0.02          # fp16 scales rounded to bf16, no more

    ids = list(range(200, 264))
    with torch.inference_mode():
        a, b = m4.prefill(ids, 0, all_logits=True), mf.prefill(ids, 0, all_logits=True)
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean()
    assert agree >= 0.85 and torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.98, agree


def test_the_demo_model_decodes_natively_as_its_torch_forms_do(gguf, tmp_path, monkeypatch):
    """The demo's model as the recipe converts it (top-1, attention blocks) and its q4_1 cols records: the engine's
    native decode is the path it takes on the CPU — a layer's attention half one call, its MoE half another, the
    tied Q8_0 vocabulary held as its blocks (the same values as the float embedding) — and decodes the same greedy tokens as the
    torch forms (native_kernels off), logits within the bf16 activations' rounding."""
    import torch
    from engine.checkpoint import Checkpoint
    from engine.convert import convert_gguf
    from engine.kernels import native
    from engine.loader import load_model
    from engine.dense_weights import Q8Projection
    from engine.store.source import record_source
    from engine.tiers.memory import InMemoryExperts
    from tests.fixtures.decode import greedy

    if native.lib() is None:
        pytest.skip("no C++ compiler: the native kernels are not built")
    kept = convert_gguf(gguf, tmp_path / "kept", experts=8, top_k=1, seed=0, expert_weights=False,
                        attention_blocks=True)
    full = convert_gguf(gguf, tmp_path / "full", experts=8, top_k=1, seed=0)
    lay, make = record_source(Checkpoint(full), order="cols", quant="gguf", gguf=gguf)
    records = {l: torch.stack([make(l, e) for e in range(8)]) for l in range(30)}
    on, off = (load_model(kept, provider=InMemoryExperts(lay, records), device="cpu", max_context=256, max_batch=1,
                          native_kernels=n) for n in (True, False))
    assert on.native_decode and isinstance(on.head, Q8Projection) and on.embed is None
    assert all(layer.attn.block_fits and layer.mlp.native and layer.mlp.tail is not None for layer in on.layers)
    ids = torch.tensor([1, 200, 49151])
    assert torch.equal(on.head.rows(ids), off.embed[ids])       # the blocks hold the float vocabulary's values
    calls = {"on": 0, "off": 0}
    for owner, name, weight in ((native, "int4_ffn", 1), (native, "int4pack_gemv", 1), (native.MoETail, "__call__", 1),
                                (native.DecodeLayers, "__call__", 30)):   # one DecodeLayers call: 30 layers' halves
        fn = getattr(owner, name)                     # which model's steps reach the native int4 kernels
        monkeypatch.setattr(owner, name,
                            lambda *a, fn=fn, w=weight: calls.__setitem__(side, calls[side] + w) or fn(*a))
    with torch.inference_mode():
        side = "on"
        toks, rows = greedy(on, list(range(300, 340)), 17)
        side = "off"
        want, want_rows = greedy(off, list(range(300, 340)), 17)
    assert calls["on"] >= 30 * 16 and calls["off"] == 0      # native_kernels off: torch's kernels only
    assert toks == want
    # bf16 activations at the int4 kernel's edges: a summation order that rounds one of them the other way moves the
    # logits by up to ~0.5 % of their range (the torch forms differ from the float model by twice that here)
    got, ref = torch.stack(rows), torch.stack(want_rows)
    assert (got - ref).abs().max() < 0.01 * ref.abs().max()
    assert torch.nn.functional.cosine_similarity(got, ref, dim=-1).min() > 0.9998


def test_a_projection_half_in_blocks_half_in_floats_is_one_line_not_a_traceback(gguf):
    """A checkpoint that keeps q as blocks and k as floats (no engine convert writes one) is refused as the
    checkpoint's fault, naming the weights — as is a bias beside blocks — through the WeightSource contract."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from engine.checkpoint import CheckpointError
    from engine.checkpoint_projections import dense_projection

    t = {x.name: x for x in GGUFReader(str(gguf)).tensors}
    q = torch.from_numpy(np.array(t["blk.0.attn_q.weight"].data, dtype=np.uint8))

    class Weights:                              # the loader's CheckpointWeights contract over two tensors
        device, dtype = torch.device("cpu"), torch.float32

        def blocks(self, name):
            return ("q4_1", q) if name.endswith("q_proj") else None

        def get(self, name):
            return torch.zeros(192, 576)

    with pytest.raises(CheckpointError, match="q_proj, k_proj: some kept as GGUF blocks, some as float weights"):
        dense_projection(Weights(), ["q_proj", "k_proj"], None)
    with pytest.raises(CheckpointError, match="a bias beside GGUF blocks"):
        dense_projection(Weights(), ["q_proj"], torch.zeros(576))
    with pytest.raises(CheckpointError, match="uint8 \\[out, row bytes\\]"):
        from engine.dense_weights import block_shape
        block_shape("q4_1", q[:, :-3])
