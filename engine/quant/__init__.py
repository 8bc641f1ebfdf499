"""Quantized expert records: weight-only, group-wise along the input dimension, scales inside the record.

ggml       — GGML's tensor types (F32 … IQ4_XS: every type a standard GGUF uses), their block sizes and the
             plain dequantization (gguf's own) the per-type kernels are held to
records    — the byte layouts (int8, int4 from float checkpoints; GGUF's own q8_0, q4_1, q4_k blocks; ggml:
             records whose three matrices each keep their own GGML type), pack (quantize / keep GGUF bytes) and
             the plain dequantization every kernel is held to
gguf       — reading expert tensors' raw blocks from a GGUF file
tensors    — a GGUF tensor as the engine holds it: the entry a GGUF model loader calls for dense weights (kept
             blocks on the CPU, else dequantized once) and for expert layouts and records
"""
