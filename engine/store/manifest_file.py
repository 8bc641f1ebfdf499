"""The bytes of a manifest file: written with its own sha256 beside it, read back bounded and checked.

A manifest says what every other byte must hash to, so only a second record can say whether the manifest
itself was edited after it was written (two records swapped together with their hashes, say). The sidecar
(`manifest.json` → `manifest.sha256`, in sha256sum's format, so `sha256sum -c manifest.sha256` checks it
too) is written by the same step right after the manifest, inside the staging directory that is then
published by rename; `tool prepare` records the same digest again in its marker.

Reading is bounded before anything is trusted: the file's size, JSON nesting, integer length, duplicate
keys and NaN are one-line integrity failures (exit 8), never a RecursionError or a 5,000-digit int.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from engine.errors import EngineError, Exit

MAX_INT_DIGITS = 20                 # every count, size and offset fits in 64 bits
_LINE = re.compile(r"([0-9a-f]{64})  (\S+)\n?")


def sidecar_of(path: Path) -> Path:
    """manifest.json → manifest.sha256 (beside it)."""
    return path.with_suffix(".sha256")


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_with_sidecar(path: Path, doc: dict) -> str:
    """`doc` as compact JSON to `path`, then its sha256 to the sidecar; returns the digest. Both go into a
    staging directory that is published by rename, so neither is ever seen half-written."""
    data = (json.dumps(doc, separators=(",", ":")) + "\n").encode()
    digest = hashlib.sha256(data).hexdigest()
    _write_durably(path, data)
    _write_durably(sidecar_of(path), f"{digest}  {path.name}\n".encode())
    return digest


def read_checked(path: Path, *, max_bytes: int, repair: str, missing: str) -> tuple[object, str]:
    """(parsed JSON, sha256) of the manifest at `path`, once its size is bounded and its sidecar agrees.
    `missing`: the reason when the manifest itself is absent (exit 3: not this kind of directory);
    `repair`: what rebuilds it, for every integrity failure (exit 8)."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise EngineError(f"{path}: missing ({missing})", Exit.BAD_MODEL) from None
    except IsADirectoryError:
        raise EngineError(f"{path}: a directory, not a manifest ({repair})", Exit.INTEGRITY) from None
    except OSError as e:
        raise EngineError(f"{path}: unreadable ({e.strerror or e})", Exit.INTEGRITY) from None
    if len(data) > max_bytes:
        raise EngineError(f"{path}: larger than {max_bytes} bytes, more than any manifest this engine writes "
                          f"({repair})", Exit.INTEGRITY)
    digest = check_sidecar(path, data, repair)
    return parse_bounded(path, data, repair), digest


def check_sidecar(path: Path, data: bytes, repair: str) -> str:
    """The sha256 of `data` (the bytes read from `path`) must be the one its sidecar records; returns it."""
    side = sidecar_of(path)
    try:
        with open(side, "rb") as f:
            text = f.read(200).decode("ascii")
    except FileNotFoundError:
        raise EngineError(f"{side}: missing, so nothing proves {path.name} is as written ({repair})",
                          Exit.INTEGRITY) from None
    except (OSError, UnicodeDecodeError) as e:
        raise EngineError(f"{side}: unreadable ({getattr(e, 'strerror', None) or e}; {repair})", Exit.INTEGRITY) from None
    m = _LINE.fullmatch(text)
    if m is None or m.group(2) != path.name:
        raise EngineError(f"{side}: not one sha256 line for {path.name} ({repair})", Exit.INTEGRITY)
    digest = hashlib.sha256(data).hexdigest()
    if digest != m.group(1):
        raise EngineError(f"{path}: sha256 {digest[:16]}… is not the {m.group(1)[:16]}… recorded in {side.name} "
                          f"(edited after it was written; {repair})", Exit.INTEGRITY)
    return digest


def _bounded_int(s: str) -> int:
    digits = len(s.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {digits} digits (at most {MAX_INT_DIGITS})")
    return int(s)


def _no_constant(s: str):
    raise ValueError(f"{s} is not a number a manifest holds")


def _unique_keys(pairs: list) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {dup!r} appears twice in one object")
    return d


def parse_bounded(path: Path, data: bytes, repair: str):
    try:
        return json.loads(data.decode("utf-8"), parse_int=_bounded_int, parse_constant=_no_constant,
                          object_pairs_hook=_unique_keys)
    except RecursionError:
        raise EngineError(f"{path}: garbled (nested deeper than JSON parsing allows; {repair})", Exit.INTEGRITY) from None
    except UnicodeDecodeError as e:
        raise EngineError(f"{path}: garbled (not UTF-8 at byte {e.start}; {repair})", Exit.INTEGRITY) from None
    except json.JSONDecodeError as e:
        raise EngineError(f"{path}: garbled ({e.msg} at line {e.lineno} column {e.colno}; {repair})",
                          Exit.INTEGRITY) from None
    except ValueError as e:
        raise EngineError(f"{path}: garbled ({e}; {repair})", Exit.INTEGRITY) from None
