"""The engine's CUDA fast path: slot-indexed expert kernels, GPU-resident and offloaded expert
providers, and CUDA-graph decode. Everything here computes the same function as
engine.experts.moe_reference (within bf16 rounding) and falls back to it where Triton is absent."""
