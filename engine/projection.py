"""Projection: a dense weight of the model (attention, shared MLP, lm_head), held the way its device multiplies it
fastest. The routed experts are not Projections: they are records (engine.experts)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class Projection:
    """One of the model's own weights, [out, in] as the checkpoint has it, held the way its device
    multiplies fastest. On the CPU: transposed ([in, out], contiguous) — the orientation torch's BLAS
    streams at about twice the bandwidth for a one-row GEMV — and a one-row GEMV goes out as two column
    halves in one batched matmul: two intra-op threads share it, and each half runs sequentially, so the
    result has the same bits on one thread or several (a lone GEMV may be split by the BLAS itself, in
    another summation order: see engine.kernels.cpu.single_ffn). Every element is the dot product a sequential matmul
    computes (bitwise: tests/engine/test_speed_paths.py). Elsewhere: F.linear, as given."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.cpu = weight.device.type == "cpu"
        self.weight = weight.t().contiguous() if self.cpu else weight      # CPU: [in, out]
        out, size = self.out_features, weight.element_size()
        self.halves = self.cpu and out % 2 == 0 and (out // 2 * size) % 64 == 0   # each half's outputs 64-byte aligned

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.cpu:
            return F.linear(x, self.weight, self.bias)
        if self.bias is not None:                # the bias added inside the GEMM, rounded once (as F.linear)
            return torch.addmm(self.bias, x.reshape(-1, self.in_features), self.weight).view(*x.shape[:-1], -1)
        if self.halves and x.numel() == x.shape[-1] and torch.get_num_threads() >= 2:
            n = self.out_features // 2
            y = torch.bmm(x.reshape(1, 1, -1).expand(2, 1, -1), self.weight.view(-1, 2, n).transpose(0, 1))
            return y.reshape(*x.shape[:-1], self.out_features)               # [2, 1, out/2] -> one row
        return torch.matmul(x, self.weight)
