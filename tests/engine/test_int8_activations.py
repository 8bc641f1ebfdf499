"""The int8-activation mode of the native GGUF GEMVs (EngineConfig.cpu_activations "int8", llama.cpp's way: x
rounded to 8 bits as ggml-cpu rounds it for the weights' type -- Q8_0, Q8_1 or Q8_K -- integer dot products): each
quantized type's kernel against its definition, y = W·x̂ (a Q8_1 block's min times llama.cpp's s) with W the gguf
package's own dequantization and x̂ engine.kernels.native.q8_reference's rounding of x, on
random blocks holding the edge cases (tests.engine.test_ggml_types.random_blocks); a row's bits the same whatever
rows come with it and through every entry point a model's pass takes; and the mode confined to the passes of the
model loaded with it. Real kernels, built here with g++.
"""
from __future__ import annotations

import pytest
import torch

from engine.kernels import native
from engine.quant import ggml
from tests.engine.test_ggml_types import QUANTIZED, gguf_dense, inputs_for, random_blocks

pytestmark = pytest.mark.skipif(native.lib() is None, reason="native kernels need g++ on x86-64")


def rows_x(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(m, k, generator=gen) * torch.linspace(0.1, 3.0, k)     # blocks of very different scales
    x[0, :32] = 0.0                                                         # a block of zeros: d = 0
    if m > 1:
        x[1, 32:64] = torch.tensor([1e-30] * 31 + [-2.0])                   # one large value, the rest round to 0
    return x


def test_x_is_rounded_as_the_reference_rounds_it():
    gen = torch.Generator().manual_seed(1)
    x = rows_x(2, 512, gen)
    x[1, 256:512] = x[1, 256:512].abs()
    x[1, 300] = -x[1, 256:512].max() * 1.5               # a negative extreme: Q8_K's scale is signed
    for t in ("q8_0", "q4_1", "q4_k"):
        for row in x:
            q, d, xs = native.q8_quantize(row, t)
            assert q.abs().max() <= 127
            assert torch.equal((q.float().view(-1, 32) * d.view(-1, 1)).view(-1), native.q8_reference(row, t)), t
            assert torch.equal(xs, native.q8_min_sums(row, t)), t
        zero = x[0].clone()
        zero[:256] = 0.0                                  # a block of zeros (Q8_K's is 256 wide): d = 0, q = 0
        q, d, _ = native.q8_quantize(zero, t)
        assert d[0] == 0.0 and not q[:32].any()
    # the kinds differ where they should: Q8_0's fp16 scale per 32 against Q8_K's fp32 one per 256; Q8_1's s
    assert not torch.equal(native.q8_reference(x, "q8_0"), native.q8_reference(x, "q4_k"))
    assert not torch.equal(native.q8_min_sums(x, "q8_0"), native.q8_min_sums(x, "q4_1"))
    q, d, _ = native.q8_quantize(x[1], "q4_k")
    assert q[300] == -127 and d[8] > 0 and torch.all(d[8:] == d[8])     # the extreme maps to -127, d = 1/(-127/m)
    _, d0, _ = native.q8_quantize(x[1], "q8_0")
    assert torch.equal(d0, d0.half().float())                            # Q8_0's d is an fp16


def int8_want(name: str, x: torch.Tensor, w: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """The mode's definition in float64: W·x̂, plus for q4_1/q5_1 each block's min times (s - Σx̂), llama.cpp's Q8_1
    multiplying a min by its own fp16 sum s."""
    want = native.q8_reference(x, name).double() @ dense.T
    if native.q8_kind(name) == "q8_1":
        t = ggml.ggml_type(name)
        mins = w.view(-1, t.size)[:, 2:4].contiguous().view(torch.float16).double().view(w.shape[0], -1)   # [out, K/32]
        xr = native.q8_reference(x, name).double().view(x.shape[0], -1, 32).sum(-1)
        want += (native.q8_min_sums(x, name).double() - xr) @ mins.T
    return want


@pytest.mark.parametrize("name", QUANTIZED)
def test_each_type_computes_w_times_x_rounded(name):
    gen = torch.Generator().manual_seed(hash(name) % 1000)
    t = ggml.ggml_type(name)
    for k in inputs_for(name):
        out = 48
        w = random_blocks(name, out, k, gen)
        x = rows_x(3, k, gen)
        dense = gguf_dense(name, w, out, k)
        want = int8_want(name, x, w, dense)
        with native.allow(True, int8_activations=True):
            got = native.ggml_matmul(t.code, x, w, out).double()
        scale = native.q8_reference(x, name).double().abs() @ dense.abs().T
        assert torch.all((got - want).abs() <= 2e-6 * scale + 1e-30), f"{name}, {k} inputs"
        with native.allow(True):
            float_y = native.ggml_matmul(t.code, x, w, out).double()
        assert not torch.equal(float_y, got), f"{name}: the mode changed nothing"     # x̂ is not x


def test_the_avx2_build_computes_the_same_function():
    """Without AVX-512 (-mno-avx512f: every type through q8_row_generic, a block unpacked then integer dots) the
    mode computes what the AVX-512 kernels compute (q4_k/q5_k/q6_k: ggml's per-256 integer sums): the same integers,
    another fp32 summation order."""
    avx2 = native.load(native.build(native.compiler(), [*native.ARCH, "-mno-avx512f"]))
    gen = torch.Generator().manual_seed(3)
    for name in QUANTIZED:
        t = ggml.ggml_type(name)
        k = 512 if t.block == 256 else 160
        w = random_blocks(name, 32, k, gen)
        x = rows_x(2, k, gen)
        with native.allow(True, int8_activations=True):
            want = native.ggml_matmul(t.code, x, w, 32).double()
        y = torch.empty(2, 32)
        avx2.set_int8_activations(1)
        try:
            avx2.ggml_matmul(t.code, x.data_ptr(), 2, k, w.data_ptr(), 32, y.data_ptr(), 1)
        finally:
            avx2.set_int8_activations(0)
        scale = native.q8_reference(x, name).double().abs() @ gguf_dense(name, w, 32, k).abs().T
        assert torch.all((y.double() - want).abs() <= 2e-6 * scale + 1e-30), name


@pytest.mark.parametrize("name", ["q4_1", "q5_0", "q8_0", "q4_k", "q6_k", "iq4_xs"])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it_or_the_entry_point(name):
    gen = torch.Generator().manual_seed(7)
    t = ggml.ggml_type(name)
    k = inputs_for(name)[0] if t.block == 32 else 256
    w = random_blocks(name, 64, k, gen)
    x = rows_x(4, k, gen)
    with native.allow(True, int8_activations=True):
        many = native.ggml_matmul(t.code, x, w, 64)
        for m in range(4):
            assert torch.equal(native.ggml_matmul(t.code, x[m:m + 1], w, 64), many[m:m + 1])
        # q|k|v and gate|up: one region over the stacked rows, each output ggml_matmul's bits
        stacked = native.ggml_gemv_stack(x[2].contiguous(), [(t.code, w[:16].contiguous(), 16), (t.code, w[16:].contiguous(), 48)])
    assert torch.equal(stacked, many[2])


def test_the_mode_is_the_passes_own_and_put_back_after_them():
    so = native.lib()
    assert so.int8_activations() == 0
    with native.allow(True, int8_activations=True):
        assert so.int8_activations() == 1
        with native.allow(True):                         # a float model's pass inside: off for it, back after
            assert so.int8_activations() == 0
        assert so.int8_activations() == 1
    assert so.int8_activations() == 0
    with pytest.raises(RuntimeError):
        with native.allow(True, int8_activations=True):
            raise RuntimeError("a pass that fails")
    assert so.int8_activations() == 0


PROMPT = [5, 17, 200, 42, 99, 7, 311, 64, 128, 3, 250, 19]


@pytest.fixture(scope="module")
def q4_1_gguf(tiny_checkpoint, tmp_path_factory):
    from tests.fixtures.tiny_gguf import write_gguf
    return write_gguf(tiny_checkpoint("mixtral"), tmp_path_factory.mktemp("int8") / "mixtral.Q4_1.gguf", qtype="Q4_1")


def test_a_gguf_loaded_with_int8_activations_decodes_on_them(q4_1_gguf):
    """A model loaded with cpu_activations int8 keeps every matrix as the file's blocks (no int4 operand, which
    takes x in bf16) and computes them with x rounded to 8 bits: logits near the float model's, not equal to them;
    its one-call decode step is its per-layer walk, bit for bit; a float model's passes beside it stay float."""
    from engine.gguf_tensors import BlockProjection
    from engine.loader import load_model
    from tests.fixtures.decode import greedy
    float_m, int8_m, walk = (load_model(q4_1_gguf, max_context=64, max_batch=1, cpu_activations=a)
                             for a in ("float", "int8", "int8"))
    assert int8_m.int8_activations and not float_m.int8_activations
    assert all(isinstance(p, BlockProjection) for layer in int8_m.layers
               for p in getattr(layer.attn.qkv, "parts", [layer.attn.qkv]))
    walk._step_layers = False
    with torch.inference_mode():
        (f_toks, f_rows), (q_toks, q_rows), (w_toks, w_rows) = (greedy(m, PROMPT, 8) for m in (float_m, int8_m, walk))
        f_again = greedy(float_m, PROMPT, 8, slot=0)[1]
    assert isinstance(int8_m._step_layers, native.DecodeLayers)
    assert q_toks == w_toks and all(torch.equal(a, b) for a, b in zip(q_rows, w_rows))
    assert all(torch.equal(a, b) for a, b in zip(f_rows, f_again))
    f, q = torch.stack(f_rows), torch.stack(q_rows)
    assert not torch.equal(f, q)
    assert float((q - f).norm() / f.norm()) < 0.05
    assert (q.argmax(-1) == f.argmax(-1)).float().mean() >= 0.75


@pytest.mark.parametrize("knobs, why", [
    (dict(device="cuda", cpu_activations="int8"), "for device cpu"),
    (dict(cpu_activations="int4"), "not one of"),
])
def test_int8_activations_are_refused_where_they_cannot_run(knobs, why):
    from engine.engine_config import EngineConfig
    with pytest.raises(ValueError, match=why):
        EngineConfig(**knobs)


def test_int8_activations_need_the_native_kernels_and_a_gguf_file(q4_1_gguf, tiny_checkpoint):
    """Refused where they would not apply: without the native kernels, and on a checkpoint directory (its dense
    weights are floats or torch's int4 operand, its experts int4 records: nothing the mode computes)."""
    from engine.loader import load_model
    with pytest.raises(ValueError, match="needs the native CPU kernels"):
        load_model(q4_1_gguf, max_context=64, max_batch=1, cpu_activations="int8", native_kernels=False)
    with pytest.raises(ValueError, match="must be a .gguf file, not the checkpoint directory"):
        load_model(tiny_checkpoint("mixtral"), max_context=64, max_batch=1, cpu_activations="int8")


def test_engine_generate_takes_the_flag_and_refuses_it_on_a_gpu(q4_1_gguf, capsys):
    """As a user types it: `engine generate --cpu-activations int8` decodes; on --device cuda it is a usage error
    (exit 2) in one line that names the option, before anything loads."""
    from engine.cli import main
    assert main(["generate", "--model", str(q4_1_gguf), "--prompt", "hi", "--max-tokens", "3",
                 "--cpu-activations", "int8"]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", str(q4_1_gguf), "--prompt", "hi", "--max-tokens", "1", "--device", "cuda",
                 "--cpu-activations", "int8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cpu_activations int8 is for device cpu" in err and "Traceback" not in err
    code = main(["generate", "--model", str(q4_1_gguf), "--prompt", "hi", "--max-tokens", "1", "--no-native-kernels",
                 "--cpu-activations", "int8"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "needs the native CPU kernels" in err and "Traceback" not in err
