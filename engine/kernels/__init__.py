"""Compute kernels, one room per device: the experts' arithmetic is engine.experts' (moe_reference), these
compute it faster where they run.

cpu         — batched GEMVs over records where they lie (pair_ffn, single_ffn) and the compute-thread policy
triton_moe  — slot-indexed Triton kernels for CUDA (their interpreter runs them on CPU tensors in the tests)
quant_cpu   — the CPU expert FFN on quantized records (torch's int4 kernel, else dequantize per call)
native      — the engine's own C++ kernels for a one-sequence CPU decode step (4-bit and 8-bit GEMVs, the whole
              quantized expert, a layer's attention half, norms, routing), built with g++ at first use
quant_triton — dequant-fused Triton GEMV (decode) and grouped GEMM (prefill) on quantized records
"""
