"""Quantized expert records: weight-only, group-wise along the input dimension, scales inside the record.

records    — the byte layouts (int8, int4 from float checkpoints; GGUF's own q8_0, q4_1, q4_k blocks),
             pack (quantize / keep GGUF bytes) and the plain torch dequantization every kernel is held to
gguf       — reading expert tensors' raw blocks from a GGUF file
"""
