"""A GGUF file alone is a model: config, tokenizer, chat template and every tensor from the file.

The files are written from the tiny transformers checkpoints by the gguf package's GGUFWriter in llama.cpp's
layout (tests/fixtures/tiny_gguf.py); Kiln's logits on the GGUF must equal Kiln's logits on the checkpoint the
file was written from (which tests/engine/test_models.py holds equal to transformers), exactly for F32 files and
within the quantization's error for quantized ones.
"""
from __future__ import annotations

import pytest
import torch

from engine.checkpoint import Checkpoint
from engine.gguf_model import GgufModel, load_tokenizer
from engine.loader import load_model
from tests.fixtures.tiny_gguf import write_gguf

ARCHS = ["mixtral", "qwen3_moe", "glm4_moe"]
PROMPT = [5, 17, 200, 42, 99, 7, 311, 64, 128, 3, 250, 19]


@pytest.fixture(scope="module")
def tiny_gguf(tiny_checkpoint, tmp_path_factory):
    """Factory: tiny_gguf(arch, qtype="F32") -> (checkpoint dir, GGUF path), cached for the module."""
    cache: dict = {}

    def make(arch: str, qtype: str = "F32"):
        if (arch, qtype) not in cache:
            ck = tiny_checkpoint(arch)
            cache[arch, qtype] = ck, write_gguf(ck, tmp_path_factory.mktemp("gguf") / f"{arch}.{qtype}.gguf", qtype=qtype)
        return cache[arch, qtype]
    return make


def _logits(model) -> torch.Tensor:
    seq = torch.tensor(PROMPT)
    with torch.inference_mode():
        got = [model.prefill(seq[:6], slot=0, all_logits=True)]
        got += [model.decode_step([int(seq[i])], [0], [i]) for i in range(6, len(PROMPT))]
    return torch.cat(got)


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_gguf_computes_the_checkpoint_it_was_written_from(arch, tiny_gguf):
    ck, path = tiny_gguf(arch)
    g, c = GgufModel(path), Checkpoint(ck)
    assert (g.arch, g.n_experts, g.hidden, g.moe_intermediate, g.moe_layers) == \
        (c.arch, c.n_experts, c.hidden, c.moe_intermediate, c.moe_layers)
    want = _logits(load_model(ck, max_context=64))
    got = _logits(load_model(path, max_context=64))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["mixtral", "glm4_moe"])
def test_q8_0_gguf_reads_every_tensor_within_its_quantization_error(arch, tiny_gguf):
    """Every tensor of the checkpoint, read from the Q8_0 file by its transformers name, is within 8-bit
    blocks' error of the original (about 0.5%); the routers and norms, which llama-quantize leaves F32, exactly."""
    ck, path = tiny_gguf(arch, "Q8_0")
    g, c = GgufModel(path), Checkpoint(ck)
    assert sorted(g.names()) == sorted(c.names())
    for name in c.names():
        got, want = g.tensor(name), c.tensor(name)
        if want.dim() == 1 or name.endswith("gate.weight"):
            assert torch.equal(got, want), name
        else:
            assert float((got - want).norm() / want.norm()) < 0.01, name
    if arch == "mixtral":           # GLM's grouped sigmoid routing flips on such changes; Mixtral's barely
        want, got = _logits(load_model(ck, max_context=64)), _logits(load_model(path, max_context=64))
        assert float((got - want).norm() / want.norm()) < 0.05
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_and_chat_template_come_from_the_file(arch, tiny_gguf):
    from transformers import AutoTokenizer
    ck, path = tiny_gguf(arch)
    tok, ref = load_tokenizer(GgufModel(path)), AutoTokenizer.from_pretrained(ck)
    msgs = [{"role": "user", "content": "What is 17 * 23? Reply with only the number."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok.eos_token == ref.eos_token and tok.decode(ids) == ref.decode(ids)
    assert GgufModel(path).config["eos_token_id"] == [ref.eos_token_id]


def test_dense_llama_gguf_is_upcycled_as_engine_convert_does(tmp_path):
    """A dense llama GGUF served as it is: the sparse-upcycled model `engine convert` writes (the same seeded
    routers, so the same numbers), computing the dense model's function (transformers' LlamaForCausalLM)."""
    from transformers import LlamaForCausalLM

    from engine.convert import convert_gguf
    from tests.fixtures.tiny_gguf import make_tiny_llama
    ck = make_tiny_llama(tmp_path / "llama")
    path = write_gguf(ck, tmp_path / "llama.gguf")
    g = GgufModel(path)
    assert (g.arch, g.n_experts, g.config["num_experts_per_tok"]) == ("mixtral", 8, 2)
    converted = convert_gguf(path, tmp_path / "converted", experts=8, top_k=2, seed=0)
    got = _logits(load_model(path, max_context=64))
    torch.testing.assert_close(got, _logits(load_model(converted, max_context=64)), atol=0, rtol=0)
    with torch.inference_mode():
        dense = LlamaForCausalLM.from_pretrained(ck, dtype=torch.float32).eval()(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(got, dense, atol=1e-4, rtol=0)


def test_a_real_q4_k_m_from_llama_quantize_loads(tiny_checkpoint, tmp_path):
    """llama.cpp's own llama-quantize makes a Q4_K_M from an F32 file: K-quant blocks where rows are multiples of
    256, its fallbacks (Q5_0/Q8_0 …) where they are not, Q6_K in places: a file that mixes types, as users have.
    Kiln loads it alone and computes close to the F32 file."""
    import os
    import subprocess
    from pathlib import Path

    from tests.fixtures.llama_server import DEFAULT
    quantize = Path(os.environ.get("KILN_LLAMA_QUANTIZE") or DEFAULT.with_name("llama-quantize"))
    if not quantize.is_file():
        why = f"no llama-quantize at {quantize} ($KILN_LLAMA_QUANTIZE); build it with `make llama-cpp`"
        if os.environ.get("KILN_REQUIRE_LLAMA_CPP") == "1":
            pytest.fail(why)
        pytest.skip(why)
    ck = tiny_checkpoint("qwen3_moe", layers=2, hidden=256)
    f32 = write_gguf(ck, tmp_path / "f32.gguf")
    q = tmp_path / "q4_k_m.gguf"
    r = subprocess.run([str(quantize), str(f32), str(q), "Q4_K_M"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    g = GgufModel(q)
    types = {t.tensor_type.name for t in g.tensors.values()}
    assert "Q4_K" in types and len(types - {"F32"}) >= 2, types       # a mix, not one type
    want, got = _logits(load_model(f32, max_context=64)), _logits(load_model(q, max_context=64))
    assert float((got - want).norm() / want.norm()) < 0.25
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.5


@pytest.mark.parametrize("arch", ARCHS)
def test_a_gguf_served_alone_on_the_gpu_keeps_its_expert_blocks(arch, tiny_gguf):
    """`engine serve --model FILE.gguf --experts resident` (no store): the GPU arena holds the file's own blocks as
    the ggml records pack-store --quant gguf makes (rows order, read by quant_triton's mixed-type kernels), not the
    experts dequantized to bf16 at load (a Q4_K_M would then read 3.5x its bytes a token). The arena is built on the
    CPU here; on a GPU it is the same bytes on the device (the CUDA test below computes with it)."""
    from engine.store.source import record_source
    from engine.tiers.resident import ResidentExperts
    ck = GgufModel(tiny_gguf(arch, "Q8_0")[1])
    res = ResidentExperts.from_checkpoint(ck, torch.device("cpu"), torch.bfloat16)
    layout, make = record_source(ck, order="rows", quant="gguf")
    assert (res.layout.quant, res.layout.order, res.arena.dtype) == (layout.quant, "rows", torch.uint8)
    assert res.layout.quant == "q8_0"                 # one type in every matrix: its own one-type records
    for layer in ck.moe_layers:
        for e in (0, ck.n_experts - 1):
            assert torch.equal(res.arena[res.bases[layer] + e], make(layer, e))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the H200 by the integrator)")
@pytest.mark.parametrize("arch", ARCHS)
def test_a_gguf_loads_on_cuda_and_computes_as_on_the_cpu(arch, tiny_gguf):
    """The same file on the GPU (experts resident, float32 compute): the logits of the CPU, to within the GPU's
    reduction order."""
    _, path = tiny_gguf(arch, "Q8_0")
    cpu = _logits(load_model(path, max_context=64))
    gpu = _logits(load_model(path, max_context=64, device="cuda", dtype="float32")).cpu()
    torch.testing.assert_close(gpu, cpu, atol=2e-3, rtol=0)


@pytest.mark.parametrize("qtype", ["Q5_0", "Q8_0"])
def test_dense_weights_keep_the_files_blocks_and_compute_their_dequantization(qtype, tiny_gguf, monkeypatch):
    """Attention and the output stay the file's own blocks (engine.gguf_tensors: no float copy), a decode step's
    attention half is one native call on them (GgmlAttnBlock) and a routed expert's one-token FFN, sum and norm
    another (GgmlTail); the logits are those of the same file with every tensor dequantized to float32 (fp32
    summation order apart)."""
    from engine.dense_weights import Projection
    from engine.kernels import native
    if native.lib() is None:
        pytest.skip("no C++ compiler: the native kernels are not built")
    _, path = tiny_gguf("mixtral", qtype)
    kept = load_model(path, max_context=64)
    attn = kept.layers[0].attn
    assert not isinstance(attn.qkv, Projection) and not isinstance(attn.o, Projection)
    assert attn.ggml_fits                  # a decode step's attention half: one native call (GgmlAttnBlock)
    assert not isinstance(kept.head, Projection)                                # no float output
    if qtype == "Q5_0":           # its experts are ggml: records (Q8_0's are the one-type q8_0 scheme)
        assert isinstance(kept.layers[0].mlp.tail, native.GgmlTail)
    got = _logits(kept)
    monkeypatch.setattr(GgufModel, "ggml_blocks", lambda self, name: None)      # every tensor as float32
    want = _logits(load_model(path, max_context=64))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * float(want.abs().max()))


def _llama_quantize():
    import os
    from pathlib import Path

    from tests.fixtures.llama_server import DEFAULT
    quantize = Path(os.environ.get("KILN_LLAMA_QUANTIZE") or DEFAULT.with_name("llama-quantize"))
    if not quantize.is_file():
        why = f"no llama-quantize at {quantize} ($KILN_LLAMA_QUANTIZE); build it with `make llama-cpp`"
        if os.environ.get("KILN_REQUIRE_LLAMA_CPP") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return quantize


@pytest.fixture(scope="module")
def quantized_mixtral(tiny_checkpoint, tmp_path_factory):
    """Factory: quantized_mixtral(qtype, hidden) → (a tiny Mixtral made `qtype` by llama.cpp's own llama-quantize,
    a store packed from it by engine pack-store --model FILE.gguf). Q4_K_M at hidden 320 (no multiple of 256) falls
    back as the demo's Q4_K_M does: q|k|v in Q5_0 and Q8_0, experts in Q5_0 with Q8_0 downs in some layers; Q5_K_M
    at hidden 256 keeps K-quants: Q5_K, with Q6_K v and downs in some layers."""
    import subprocess

    from engine.cli import main
    quantize = _llama_quantize()
    cache: dict = {}

    def make(qtype: str, hidden: int):
        if (qtype, hidden) not in cache:
            d = tmp_path_factory.mktemp(qtype)
            f32 = write_gguf(tiny_checkpoint("mixtral", layers=3, hidden=hidden, experts=4), d / "f32.gguf")
            q = d / f"{qtype}.gguf"
            r = subprocess.run([str(quantize), str(f32), str(q), qtype], capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stderr[-2000:]
            assert main(["pack-store", "-q", "--model", str(q), "--store", str(d / "store"), "--order", "cols"]) == 0
            cache[qtype, hidden] = q, d / "store"
        return cache[qtype, hidden]
    return make


FORMS = {"Q5_0 alone": None, "Q4_K_M alone": ("Q4_K_M", 320), "Q5_K_M alone": ("Q5_K_M", 256),
         "Q4_K_M tiered": ("Q4_K_M", 320), "Q5_K_M tiered": ("Q5_K_M", 256)}


@pytest.mark.parametrize("form", list(FORMS))
def test_a_ggufs_decode_step_in_one_native_call_is_the_layer_walk(form, tiny_gguf, request, threads):
    """A GGUF served on its own blocks (GgmlAttnBlock's q|k|v and o in their types, GgmlTail's mixed-type records)
    takes the one-call decode step (native.DecodeLayers) as the demo's int4 path does: the same logits bit for bit as
    the per-layer walk (two native calls a layer), the same picks served and counted. Tiered (a RAM tier of 3 of
    12 records) layers' records go missing mid-step: the call comes back, the walk reads them, it resumes."""
    from engine.kernels import native
    from tests.engine.test_native_cpu import counts
    from tests.fixtures.decode import greedy
    if native.lib() is None:
        pytest.skip("no C++ compiler: the native kernels are not built")
    kw = {}
    if FORMS[form] is None:
        path = tiny_gguf("mixtral", "Q5_0")[1]
    else:
        path, store = request.getfixturevalue("quantized_mixtral")(*FORMS[form])
        if form.endswith("tiered"):
            kw = dict(store_dir=store, ram_slots=3)
    one, walk = (load_model(path, device="cpu", max_context=64, max_batch=1, **kw) for _ in range(2))
    walk._step_layers = False                    # the per-layer walk: GgmlAttnBlock's call, then GgmlTail's
    assert all(layer.attn.ggml_fits and isinstance(layer.mlp.tail, native.GgmlTail) for layer in one.layers)
    if FORMS[form] is not None:                  # llama-quantize mixed the attention's types
        parts = [getattr(layer.attn.qkv, "parts", [layer.attn.qkv]) for layer in one.layers]
        assert any(len({p.type.code for p in ps}) > 1 for ps in parts)
    stops = []
    orig = native.DecodeLayers.__call__
    native.DecodeLayers.__call__ = lambda self, *a: stops.append(orig(self, *a)) or stops[-1]
    try:
        with torch.inference_mode():
            (toks, rows), (want, want_rows) = (greedy(m, PROMPT[:7], 12) for m in (one, walk))
    finally:
        native.DecodeLayers.__call__ = orig
        for m in (one, walk):
            getattr(m.provider, "close", lambda: None)()
    assert isinstance(one._step_layers, native.DecodeLayers)
    assert toks == want
    for a, b in zip(rows, want_rows):
        assert torch.equal(a, b)
    assert counts(one.provider.counters()) == counts(walk.provider.counters())
    layers = len(one.layers)
    assert stops.count(layers) == 11                  # every decode step finished in it ...
    if form.endswith("tiered"):
        assert any(s < layers for s in stops)         # ... some after a layer's records were read mid-step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200)")
@pytest.mark.parametrize("dense", ["blocks", "dequantized", "auto"])
def test_on_cuda_the_dense_matrices_are_blocks_or_copies_as_asked_and_compute_alike(dense, tiny_gguf):
    """--gguf-dense: a GGUF's attention and untied head on the GPU as their blocks (DeviceBlockProjection) or
    dequantized copies (Projection); auto with every expert resident on a card with room: copies. The logits agree
    with the CPU's either way (float32 compute)."""
    from engine.dense_weights import Projection
    _, path = tiny_gguf("mixtral", "Q5_0")
    cpu = _logits(load_model(path, max_context=64))
    model = load_model(path, max_context=64, device="cuda", dtype="float32", gguf_dense=dense)
    copies = isinstance(model.layers[0].attn.qkv, Projection)
    assert copies == (dense != "blocks")
    torch.testing.assert_close(_logits(model).cpu(), cpu, atol=2e-3, rtol=0)


def test_gguf_dense_is_refused_off_a_gpu_in_one_line(tiny_gguf, capsys):
    from engine.cli import main
    _, path = tiny_gguf("mixtral", "Q8_0")
    capsys.readouterr()                   # the fixture's own progress lines, when it makes the file now
    assert main(["generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "1",
                 "--gguf-dense", "dequantized"]) == 2
    err = capsys.readouterr().err
    assert "gguf_dense dequantized is for a CUDA device, not cpu" in err and len(err.strip().splitlines()) == 1


def test_gguf_dense_auto_dequantizes_only_where_every_expert_is_resident_and_the_copies_fit(tiny_gguf, monkeypatch):
    """engine.loader.gguf_dense_blocks' rule, with the card's free memory stood in for (no GPU here: a test double
    for torch.cuda.mem_get_info alone): auto keeps the blocks where experts are tiered or the copies do not fit the
    free memory beside the reserve, dequantizes otherwise; blocks / dequantized force it; a checkpoint directory or
    the CPU is never asked."""
    from engine.engine_config import EngineConfig
    from engine.loader import gguf_dense_blocks
    from engine.tiers.gpu import gpu_reserve
    ck = GgufModel(tiny_gguf("mixtral", "Q8_0")[1])
    copies = ck.non_expert_elements() * 2                       # bf16
    total = 80 << 30

    class Provider:
        def __init__(self, kind):
            self.kind = kind

        def counters(self):
            return {"provider": self.kind}

    def rule(mode, kind, free, ckpt=ck, device="cuda"):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
        return gguf_dense_blocks(EngineConfig(device=device, gguf_dense=mode), ckpt, Provider(kind), torch.bfloat16)

    roomy, tight = gpu_reserve(total) + copies + (1 << 20), gpu_reserve(total) + copies - 1
    assert rule("auto", "resident", roomy) is False                     # dequantized copies
    assert rule("auto", "resident", tight) is True                      # no room for them: the blocks
    assert rule("auto", "tiered", roomy) is True                        # every GiB holds expert slots
    assert rule("blocks", "resident", roomy) is True and rule("dequantized", "tiered", tight) is False
    assert rule("auto", "memory", roomy, device="cpu") is True          # the CPU keeps blocks (native kernels)
