"""Which program a Kiln step runs: the console scripts beside this Python, overridable per program."""
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


def llama_cpp_program(name: str) -> str:
    """llama.cpp's `llama-server` / `rpc-server` (runtime llama-cpp): $KILN_LLAMA_SERVER_BIN / $KILN_RPC_SERVER_BIN,
    else scripts/build-llama-cpp.sh's build in this checkout, else what PATH finds."""
    if override := os.environ.get(f"KILN_{name.upper().replace('-', '_')}_BIN"):
        return override
    built = REPO_ROOT / ".kiln" / "cache" / "llama.cpp" / "bin" / name
    return str(built) if built.is_file() else (shutil.which(name) or name)
