"""What a Kiln step's child runs: which program (the one home of the `engine` binary's path, and of `tool`'s and
docker's) and with which environment (the one home of the merge of this process's environment with a step's)."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from tool import REPO_ROOT


def program(name: str) -> str:
    """$KILN_<NAME>_BIN, else the console script installed beside this Python (the venv's `engine`),
    else what PATH finds."""
    if override := os.environ.get(f"KILN_{name.upper()}_BIN"):
        return override
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def use(name: str, path: str) -> None:
    """Run `path` as program `name` from now on (`tool up --engine-bin`): the override program() reads, set in the
    environment so that children which resolve programs themselves see the same one."""
    os.environ[f"KILN_{name.upper()}_BIN"] = str(path)


def child_env(*layers: dict | None) -> dict[str, str]:
    """This process's environment overlaid by each layer in turn (a plan step's env, the directories' KILN_*), every
    value a string: what a step's child runs with."""
    env = dict(os.environ)
    for layer in layers:
        env.update({k: str(v) for k, v in (layer or {}).items()})
    return env


def llama_cpp_program(name: str) -> str:
    """llama.cpp's `llama-server` / `rpc-server` (runtime llama-cpp): $KILN_LLAMA_SERVER_BIN / $KILN_RPC_SERVER_BIN,
    else scripts/build-llama-cpp.sh's build in this checkout, else what PATH finds."""
    if override := os.environ.get(f"KILN_{name.upper().replace('-', '_')}_BIN"):
        return override
    built = REPO_ROOT / ".kiln" / "cache" / "llama.cpp" / "bin" / name
    return str(built) if built.is_file() else (shutil.which(name) or name)
