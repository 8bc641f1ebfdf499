"""The engine's exact MoE models, one file per architecture; shared layers in common.py."""
from __future__ import annotations

from engine.models.common import MoEModel
from engine.models.glm4_moe import Glm4Moe
from engine.models.glm5_next import Glm5Next
from engine.models.mixtral import Mixtral
from engine.models.qwen3_moe import Qwen3Moe

MODELS: dict[str, type[MoEModel] | type[Glm5Next]] = {"qwen3_moe": Qwen3Moe, "glm4_moe": Glm4Moe, "mixtral": Mixtral,
                                                       "glm5_next": Glm5Next}


def model_class(arch: str) -> type[MoEModel] | type[Glm5Next]:
    """The model of a checkpoint's architecture (ModelConfig.arch); KeyError for one the engine lacks."""
    return MODELS[arch]
