"""Write a plan's units, the files its steps mount, and its tmpfiles.d rules under a root, atomically.

All or nothing: every file is first written to a temp name beside its target; then all are
renamed into place. If anything fails, the files renamed so far are put back as they were
(an earlier version restored from a hard-linked backup, a new one removed) and every temp is
removed, so the root is left exactly as it was.
"""
from __future__ import annotations

import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tool.errors import NotWritable

SYSTEM_UNIT_DIR = "etc/systemd/system"
USER_UNIT_DIR = ".config/systemd/user"
SYSTEM_TMPFILES_DIR = "etc/tmpfiles.d"
USER_TMPFILES_DIR = ".config/user-tmpfiles.d"


@dataclass
class Output:
    path: Path          # absolute, under the root
    data: bytes
    mode: int


def outputs(plan: dict, root: Path, user: bool = False) -> list[Output]:
    """Every file the plan asks for, placed under `root` (units, mounted files, tmpfiles rules)."""
    unit_dir = root / (USER_UNIT_DIR if user else SYSTEM_UNIT_DIR)
    out = [Output(unit_dir / name, text.encode(), 0o644) for name, text in sorted(plan["units"].items())]
    for host_path, f in sorted(plan["files"].items()):
        out.append(Output(root / host_path.lstrip("/"), f["content"].encode(), int(f["mode"], 8)))
    tmpfiles = root / (USER_TMPFILES_DIR if user else SYSTEM_TMPFILES_DIR) / f"kiln-{plan['id']}.conf"
    out.append(Output(tmpfiles, ("\n".join(plan["tmpfiles"]) + "\n").encode(), 0o644))
    return out


def _stage(o: Output) -> Path:
    """Write one file to a temp name in its target's directory (same filesystem, so rename is atomic)."""
    o.path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=o.path.parent, prefix=f".{o.path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(o.data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, o.mode)
    except BaseException:
        os.unlink(tmp)
        raise
    return Path(tmp)


def _backup(path: Path) -> Path | None:
    """A hard link to the current version of `path` (if any), so a failed publish can restore it."""
    if not path.exists():
        return None
    while True:                          # a fresh name each try: os.link refuses an existing one
        bak = path.parent / f".{path.name}.{secrets.token_hex(6)}.bak"
        try:
            os.link(path, bak)
            return bak
        except FileExistsError:
            continue


def write_all(files: list[Output]) -> list[Path]:
    """Stage all, then rename all; on any failure restore what was there and remove every temp."""
    staged: list[tuple[Output, Path]] = []
    backups: dict[Path, Path | None] = {}
    published: list[Output] = []
    try:
        for o in files:
            staged.append((o, _stage(o)))
        for o, _ in staged:
            backups[o.path] = _backup(o.path)
        for o, tmp in staged:
            os.replace(tmp, o.path)
            published.append(o)
    except BaseException as e:              # Ctrl-C between renames must roll back too
        for o in reversed(published):
            bak = backups.get(o.path)
            try:
                if bak is not None:
                    os.replace(bak, o.path)
                else:
                    os.unlink(o.path)
            except OSError:
                pass
        for o, tmp in staged:
            _unlink_quietly(tmp)
        for bak in backups.values():
            if bak is not None:
                _unlink_quietly(bak)
        if not isinstance(e, OSError):
            raise
        where = getattr(e, "filename", None) or "the root"
        raise NotWritable(f"{where}: cannot write ({e.strerror or e}); nothing was changed") from None
    for bak in backups.values():
        if bak is not None:
            _unlink_quietly(bak)
    return [o.path for o in files]


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def materialise(plan: dict, root: str | os.PathLike, user: bool = False) -> list[Path]:
    """Write everything `plan` names under `root`; returns the paths written."""
    root = Path(root).absolute()
    if root.exists() and not root.is_dir():
        raise NotWritable(f"{root}: not a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NotWritable(f"{root}: cannot create ({e.strerror or e})") from None
    if not os.access(root, os.W_OK):
        raise NotWritable(f"{root}: not writable by this user")
    return write_all(outputs(plan, root, user))
