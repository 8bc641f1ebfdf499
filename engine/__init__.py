"""Kiln's MoE expert-offload engine: packed expert store → RAM tier → GPU slots, exact models, OpenAI server."""
