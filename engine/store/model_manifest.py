"""A converted model directory's manifest: every file the server reads, with its size and sha256.

`engine convert` and `engine synth` build a checkpoint (safetensors, config.json, tokenizer files,
generation config, chat template) that exists nowhere else, so no fetch marker covers it: they write
kiln-files.json in their staging directory before it is published, with its own sha256 in
kiln-files.sha256 (engine.store.manifest_file). `engine verify-model` re-hashes every file against it;
`engine serve` checks the cheap part (every file there with its size, nothing extra) before it loads.

    {"format_version": 1, "files": [{"path": "config.json", "bytes": 1234, "sha256": "<hex>"}, ...]}

Paths are relative, sorted, unique, inside the directory; a file the manifest does not list is an
error too (a stray safetensors shard would be read by a glob). Exit 8 for every mismatch, naming the file.
"""
from __future__ import annotations

import hashlib
import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from engine.errors import EngineError, Exit
from engine.store import manifest_file

NAME = "kiln-files.json"
SIDECAR = "kiln-files.sha256"
FORMAT_VERSION = 1
MAX_FILES = 10_000
MAX_BYTES = 16 << 20
_HEX64 = re.compile(r"[0-9a-f]{64}")
_OWN = {NAME, SIDECAR}
REPAIR = "rebuild it (`tool prepare <recipe> --force`)"


@dataclass(frozen=True)
class Entry:
    path: str
    bytes: int
    sha256: str


@dataclass
class ModelManifest:
    dir: Path
    files: list[Entry]
    sha256: str                 # of kiln-files.json itself


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _walk(root: Path) -> tuple[list[str], list[str]]:
    """(regular files, anything else) under `root`, as relative POSIX paths; the manifest pair excluded.
    Symlinks and special files are never followed or opened: they are reported as what they are."""
    files, odd = [], []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel = Path(dirpath).relative_to(root)
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = (rel / name).as_posix()
            if p in _OWN:
                continue
            st = os.lstat(os.path.join(dirpath, name))
            (files if stat.S_ISREG(st.st_mode) else odd).append(p)
    return sorted(files), sorted(odd)


def write(model_dir: str | os.PathLike, *, threads: int = 4) -> ModelManifest:
    """Hash every file of `model_dir` (a staging directory, before it is published) into kiln-files.json."""
    root = Path(model_dir)
    files, odd = _walk(root)
    if odd:
        raise EngineError(f"{root / odd[0]}: not a regular file; a model directory holds only files", Exit.INTEGRITY)
    with ThreadPoolExecutor(max(1, min(threads, len(files)))) as pool:          # hashlib drops the GIL
        digests = list(pool.map(lambda p: _sha256(root / p), files))
    entries = [Entry(p, (root / p).stat().st_size, d) for p, d in zip(files, digests)]
    doc = {"format_version": FORMAT_VERSION, "files": [e.__dict__ for e in entries]}
    digest = manifest_file.write_with_sidecar(root / NAME, doc)
    return ModelManifest(root, entries, digest)


def _garbled(path: Path, why: str) -> EngineError:
    return EngineError(f"{path}: garbled ({why}; {REPAIR})", Exit.INTEGRITY)


def load(model_dir: str | os.PathLike) -> ModelManifest:
    """kiln-files.json once its sidecar agrees and every entry is exact (types, a safe relative path, sorted
    and unique). A directory without one is exit 3: nothing says what it should hold."""
    root = Path(model_dir)
    path = root / NAME
    if not root.is_dir():
        raise EngineError(f"{root}: no such model directory", Exit.BAD_MODEL)
    raw, digest = manifest_file.read_checked(path, max_bytes=MAX_BYTES, repair=REPAIR,
                                             missing="no manifest of this model's files: not converted by "
                                                     "this engine, or converted before it wrote one; " + REPAIR)
    if type(raw) is not dict or set(raw) != {"format_version", "files"}:
        raise _garbled(path, "not an object of exactly format_version and files")
    if type(raw["format_version"]) is not int or raw["format_version"] != FORMAT_VERSION:
        raise _garbled(path, f"format_version {raw['format_version']!r} is not {FORMAT_VERSION}")
    rows = raw["files"]
    if type(rows) is not list or not 0 < len(rows) <= MAX_FILES:
        raise _garbled(path, f"files is not a list of 1..{MAX_FILES} entries")
    entries: list[Entry] = []
    for i, row in enumerate(rows):
        if type(row) is not dict or set(row) != {"path", "bytes", "sha256"}:
            raise _garbled(path, f"files[{i}] is not an object of exactly path, bytes and sha256")
        p, n, h = row["path"], row["bytes"], row["sha256"]
        if type(p) is not str or not _safe(p):
            raise _garbled(path, f"files[{i}].path {str(p)[:80]!r} is not a plain relative path inside the directory")
        if type(n) is not int or not 0 <= n < 1 << 50:
            raise _garbled(path, f"files[{i}].bytes {str(n)[:40]} is not a file size")
        if type(h) is not str or not _HEX64.fullmatch(h):
            raise _garbled(path, f"files[{i}].sha256 is not 64 lowercase hex digits")
        if entries and p <= entries[-1].path:
            raise _garbled(path, f"files[{i}].path {p!r} is not after {entries[-1].path!r} (sorted, unique)")
        entries.append(Entry(p, n, h))
    return ModelManifest(root, entries, digest)


def _safe(p: str) -> bool:
    pp = PurePosixPath(p)
    return (0 < len(p) <= 255 and p == pp.as_posix() and not pp.is_absolute() and p not in _OWN
            and all(part not in ("", ".", "..") for part in pp.parts) and "\\" not in p
            and all(c.isprintable() for c in p))


@dataclass(frozen=True)
class Problem:
    path: str
    what: str

    def __str__(self) -> str:
        return f"{self.path}: {self.what}"


def check_sizes(m: ModelManifest) -> list[Problem]:
    """The cheap part (stat only): every listed file there as a regular file of its size, nothing else there."""
    files, odd = _walk(m.dir)
    listed = {e.path for e in m.files}
    problems = [Problem(p, "not listed in the manifest (extra file)") for p in files if p not in listed]
    problems += [Problem(p, "not a regular file (a link or special file)") for p in odd if p not in listed]
    present = set(files)
    for e in m.files:
        if e.path not in present:
            why = "a link or special file, not the file that was written" if e.path in odd else "missing"
            problems.append(Problem(e.path, why))
            continue
        size = (m.dir / e.path).stat().st_size
        if size != e.bytes:
            problems.append(Problem(e.path, f"{size} bytes, the manifest says {e.bytes} "
                                            f"({'truncated' if size < e.bytes else 'grown'})"))
    return sorted(problems, key=lambda p: p.path)


def verify(m: ModelManifest, *, threads: int = 4) -> list[Problem]:
    """check_sizes, then the sha256 of every file whose size is right."""
    problems = check_sizes(m)
    named = {p.path for p in problems}
    todo = [e for e in m.files if e.path not in named]
    with ThreadPoolExecutor(max(1, min(threads, len(todo) or 1))) as pool:
        got = list(pool.map(lambda e: _sha256(m.dir / e.path), todo))
    problems += [Problem(e.path, f"sha256 {d[:16]}… is not the {e.sha256[:16]}… the manifest records")
                 for e, d in zip(todo, got) if d != e.sha256]
    return sorted(problems, key=lambda p: p.path)


def refusal(m: ModelManifest, problems: list[Problem]) -> EngineError:
    """One line naming the first problem (all of them are printed above it by the CLI)."""
    more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
    return EngineError(f"{m.dir / problems[0].path}: {problems[0].what}{more}; {REPAIR}", Exit.INTEGRITY)


def check_for_serving(model_dir: str | os.PathLike) -> ModelManifest | None:
    """What `engine serve` checks before loading a converted model: the manifest and its sidecar, every file
    there with its size, nothing extra (milliseconds; the full sha256 is the verify step's, which the serve
    unit requires). A checkpoint without one (Hugging Face weights, checked by `tool fetch`'s marker) is None."""
    if not (Path(model_dir) / NAME).exists() and not (Path(model_dir) / SIDECAR).exists():
        return None
    m = load(model_dir)
    problems = check_sizes(m)
    if problems:
        raise refusal(m, problems)
    return m
