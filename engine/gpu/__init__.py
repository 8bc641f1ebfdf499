"""The engine's CUDA fast path: GPU-resident and offloaded expert providers over the slot-indexed
kernels (engine.kernels.triton_moe), and CUDA-graph decode. Everything here computes the same function as
engine.experts.moe_reference (within bf16 rounding) and falls back to it where Triton is absent."""
