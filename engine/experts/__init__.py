"""The expert core: what the models and the expert tiers agree on, one module per job.

layout     — the record layout (ExpertLayout: rows/cols orders, quantized records, ALIGN, DTYPES, order_for)
reference  — the reference arithmetic every provider and kernel is held to (expert_ffn, moe_reference)
provider   — the provider contract (ExpertProvider: every hook the models, graphs, loader and scheduler call)

The providers are in engine.tiers (with the CPU waves they share, engine.tiers.waves), their kernels in
engine.kernels. The package's public names are re-exported here for code written against the one-file module.
"""
from __future__ import annotations

from engine.experts.layout import ALIGN, DTYPES, ORDERS, ExpertLayout, order_for
from engine.experts.provider import ExpertProvider, Predictor
from engine.experts.reference import expert_ffn, moe_reference

__all__ = ["ALIGN", "DTYPES", "ORDERS", "ExpertLayout", "ExpertProvider", "Predictor", "expert_ffn",
           "moe_reference", "order_for"]
