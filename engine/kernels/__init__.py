"""Compute kernels, one room per device: the experts' arithmetic is engine.experts' (moe_reference), these
compute it faster where they run.

cpu         — batched GEMVs over records where they lie (pair_ffn, single_ffn) and the compute-thread policy
triton_moe  — slot-indexed Triton kernels for CUDA (their interpreter runs them on CPU tensors in the tests)
triton_common — the Triton pieces both slot kernels share (record_ptr, swiglu, sum_picks, GEMV_MAX_PAIRS)
quant_cpu   — the CPU expert FFN on quantized records (torch's int4 kernel, else dequantize per call)
native      — the engine's own C++ kernels for a one-sequence CPU decode step (4-bit and 8-bit GEMVs, the whole
              quantized expert, a layer's attention half, norms, routing, and a matmul and expert FFN for every
              GGML type a GGUF holds), built with g++ at first use
quant_triton — dequant-fused Triton GEMV (decode) and grouped GEMM (prefill) on quantized records
triton_glm5 — glm5_next's own fused CUDA decode kernels (mHC, KDA, MLA over the latent, the DSA indexer's scores)
"""
from __future__ import annotations

import os


def import_triton():
    """(triton, triton.language), or (None, None) where no Triton kernel can run: Triton is imported only for a
    torch built with CUDA (or ROCm), or with TRITON_INTERPRET=1 (its interpreter on CPU tensors: the tests). On a
    CPU-only torch every Triton path is off anyway (they need a CUDA device or the interpreter), and importing
    triton there only costs memory: 54 MB of the CPU demo server's RSS (its libtriton.so and modules; measured
    with bench/demo_memory.py's store), for kernels nothing calls."""
    import torch
    if not (torch.version.cuda or getattr(torch.version, "hip", None) or os.environ.get("TRITON_INTERPRET") == "1"):
        return None, None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None, None
    return triton, tl
