"""Which program a Kiln step runs: the console scripts beside this Python, overridable per program."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def program(name: str) -> str:
    """$KILN_<NAME>_BIN, else the console script installed beside this Python (the venv's `engine`),
    else what PATH finds."""
    if override := os.environ.get(f"KILN_{name.upper()}_BIN"):
        return override
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)
