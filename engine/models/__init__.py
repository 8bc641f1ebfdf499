"""The engine's exact MoE models, one file per architecture; shared layers in common.py."""
from __future__ import annotations

from engine.models.common import MoEModel


def model_class(arch: str) -> type[MoEModel] | type:
    if arch == "qwen3_moe":
        from engine.models.qwen3_moe import Qwen3Moe as cls
    elif arch == "glm4_moe":
        from engine.models.glm4_moe import Glm4Moe as cls
    elif arch == "glm5_next":
        from engine.models.glm5_next import Glm5Next as cls
    elif arch == "mixtral":
        from engine.models.mixtral import Mixtral as cls
    else:
        raise KeyError(arch)
    return cls
