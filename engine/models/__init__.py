"""The engine's exact MoE models, one file per architecture; shared layers in common.py."""
from __future__ import annotations

from engine.models.common import MoEModel
from engine.models.glm4_moe import Glm4Moe
from engine.models.mixtral import Mixtral
from engine.models.qwen3_moe import Qwen3Moe

MODELS: dict[str, type[MoEModel]] = {"qwen3_moe": Qwen3Moe, "glm4_moe": Glm4Moe, "mixtral": Mixtral}


def model_class(arch: str) -> type[MoEModel]:
    """The model of a checkpoint's architecture (ModelConfig.arch); KeyError for one the engine lacks."""
    return MODELS[arch]
