"""A Hugging Face model repo at one pinned commit: its files' digests from the Hub, and the files themselves.

Digests come from `HfApi.model_info(repo, revision=<40 hex>, files_metadata=True)`: every LFS file has
its sha256 and size (the LFS object id), every other file its git blob id (sha1 of "blob <size>\\0" + bytes)
and size. Both are checked after download, so no file is taken on trust. Downloads go through
`hf_hub_download(local_dir=...)`, which resumes a dropped connection mid-file (HTTP Range) and keeps
completed files across runs, so an interrupted fetch starts again where it stopped, file by file.

Works with huggingface_hub 1.x (what nixpkgs ships in 2026; HTTP through httpx) and 2.x (through
httpx2): the one thing that differs for us is which library's HTTPError a dropped connection raises,
and that is read off huggingface_hub's own HfHubHTTPError (`transport_errors`), never imported by name.

The token is huggingface_hub's own: $HF_TOKEN or the stored `hf auth login` token. It is never an argument
of ours, so it stays off argv, and nothing here prints headers.
"""
from __future__ import annotations

import errno
import re
from dataclasses import dataclass
from pathlib import Path

from tool.errors import IntegrityError, KilnError, NetworkError, StorageError
from tool.weights import Mismatch, git_blob_sha1, sha256_file

COMMIT = re.compile(r"^[0-9a-f]{40}$")
RESUME_ATTEMPTS = 5         # connections dropped mid-file, resumed within one run


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    sha256: str | None       # LFS files
    blob_id: str | None      # git object id; what non-LFS files are checked by


def transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTPError base class of the HTTP library this huggingface_hub talks through (httpx for 1.x,
    httpx2 for 2.x): HfHubHTTPError derives from it, and connection failures raise its other subclasses."""
    from huggingface_hub.errors import HfHubHTTPError

    bases = tuple(c for c in HfHubHTTPError.__mro__[1:] if c.__name__ == "HTTPError" and c is not OSError)
    return bases or (HfHubHTTPError,)


def _hub_errors(repo: str, revision: str, e: Exception) -> KilnError:
    """One line per way the Hub can refuse; the token itself never appears."""
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    if isinstance(e, GatedRepoError):
        return NetworkError(f"{repo}: gated; accept its terms on the Hub and set HF_TOKEN (or `hf auth login`)")
    if isinstance(e, RevisionNotFoundError):
        return NetworkError(f"{repo}@{revision}: the Hub has no such revision")
    if isinstance(e, RepositoryNotFoundError):
        return NetworkError(f"{repo}: no such repo on the Hub, or it is private (set HF_TOKEN or `hf auth login`)")
    if isinstance(e, OfflineModeIsEnabled):
        return NetworkError(f"{repo}: HF_HUB_OFFLINE is set; unset it to fetch")
    if isinstance(e, HfHubHTTPError):
        status = e.response.status_code if e.response is not None else "?"
        return NetworkError(f"{repo}@{revision[:12]}: the Hub answered HTTP {status}")
    return NetworkError(f"{repo}: cannot reach the Hub ({type(e).__name__}: {str(e).splitlines()[0][:160]})")


def remote_files(repo: str, revision: str) -> list[RemoteFile]:
    """Every file of `repo` at the commit `revision`, with the Hub's digests; the Hub must confirm the commit."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if not COMMIT.match(revision):
        raise IntegrityError(f"{repo}: revision {revision!r} is not a pinned commit (40 hex digits)")
    try:
        info = HfApi().model_info(repo, revision=revision, files_metadata=True)
    except (HfHubHTTPError, OfflineModeIsEnabled, *transport_errors(), OSError) as e:
        raise _hub_errors(repo, revision, e) from None
    if info.sha != revision:
        raise IntegrityError(f"{repo}: asked for commit {revision}, the Hub answered for {info.sha}")
    out = []
    for s in info.siblings or []:
        if s.size is None:
            raise IntegrityError(f"{repo}@{revision[:12]}: the Hub gave no size for {s.rfilename}")
        if s.lfs is not None:
            out.append(RemoteFile(s.rfilename, int(s.lfs.size), s.lfs.sha256, s.blob_id))
        elif s.blob_id:
            out.append(RemoteFile(s.rfilename, int(s.size), None, s.blob_id))
        else:
            raise IntegrityError(f"{repo}@{revision[:12]}: the Hub gave no digest for {s.rfilename}")
    return sorted(out, key=lambda f: f.name)


def download(repo: str, revision: str, f: RemoteFile, local_dir: Path, bar_factory=None) -> Path:
    """One file into local_dir at the pinned commit (resumed within the run on a dropped connection)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    transport = transport_errors()
    try:
        for attempt in range(1, RESUME_ATTEMPTS + 1):
            try:
                return Path(hf_hub_download(repo, f.name, revision=revision, local_dir=local_dir,
                                            tqdm_class=bar_factory))
            except transport as e:
                # huggingface_hub 2.x resumes a dropped connection itself; 1.x raises, leaving the partial
                # file, which the next call continues with an HTTP Range request.
                if isinstance(e, HfHubHTTPError) or attempt == RESUME_ATTEMPTS:
                    raise
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise StorageError(f"{local_dir}: disk full while fetching {f.name} ({f.size} bytes)") from None
        if isinstance(e, (HfHubHTTPError, OfflineModeIsEnabled)):
            raise _hub_errors(repo, revision, e) from None
        if "Consistency check failed" in str(e):
            raise IntegrityError(f"{f.name}: the download ended at the wrong size (expected {f.size} bytes); "
                                 f"run again to resume") from None
        raise StorageError(f"{local_dir / f.name}: cannot write ({e.strerror or e})") from None
    except (HfHubHTTPError, OfflineModeIsEnabled, *transport) as e:
        raise _hub_errors(repo, revision, e) from None


def check(path: Path, f: RemoteFile, progress=None) -> tuple[str, list[Mismatch]]:
    """(sha256 of the bytes, mismatches against the Hub's size and digest)."""
    size = path.stat().st_size
    if size != f.size:
        return "", [Mismatch(f.name, "size", str(f.size), str(size))]
    digest = sha256_file(path, progress)
    if f.sha256 is not None:
        return digest, ([] if digest == f.sha256 else [Mismatch(f.name, "sha256", f.sha256, digest)])
    blob = git_blob_sha1(path)
    return digest, ([] if blob == f.blob_id else [Mismatch(f.name, "git blob", f.blob_id or "", blob)])
