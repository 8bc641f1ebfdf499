"""Write files so that nothing is ever half-written: temp name in the same directory, fsync, rename."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from tool.errors import NotWritable


def write_bytes(path: str | os.PathLike, data: bytes, mode: int = 0o644) -> Path:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise NotWritable(f"{path.parent}: cannot write here ({e.strerror or e})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise NotWritable(f"{path}: cannot write ({e.strerror or e})") from None
        raise
    return path


def write_text(path: str | os.PathLike, text: str, mode: int = 0o644) -> Path:
    return write_bytes(path, text.encode(), mode)


def write_json(path: str | os.PathLike, obj, mode: int = 0o644) -> Path:
    return write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n", mode)
