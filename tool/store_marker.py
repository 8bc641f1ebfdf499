"""`.kiln-prepared.json`: what a published store was built from, and what its metadata hashed to then.

`tool prepare` writes it into the staged store once the plan's verify step has passed, just before the
store is published by rename:

    {"recipe": ID, "inputs": sha256 of the recipe's weights/runtime/prepare step,
     "metadata": {"experts/manifest.json": sha256, "model/config.json": sha256, ...}}

`inputs` says whether the store is still the recipe's (tool.prepare rebuilds it otherwise). `metadata`
holds the sha256 of every JSON file in the store (the expert store's manifest, the converted model's
kiln-files.json, its config and tokenizer files; whatever a container's prepare wrote): these say how
every other byte is read and what it must hash to, so an edited one (records swapped together with their
hashes, a manifest rewritten with its sidecar) is found here even when it is self-consistent. The bulk
data is covered by those manifests, which the verify step checks. Any runtime, no engine knowledge.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

NAME = ".kiln-prepared.json"
MAX_MARKER_BYTES = 16 << 20


@dataclass
class Marker:
    recipe: str
    inputs: str
    metadata: dict[str, str] | None          # None: written by a tool from before metadata was recorded


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def metadata_files(store: Path) -> list[str]:
    """Every JSON file under `store` (relative POSIX paths, sorted), the marker itself excluded; links and
    special files are not followed (the store's verify step reads what they point to, if anything)."""
    out = []
    for dirpath, _, filenames in os.walk(store, followlinks=False):
        for name in filenames:
            p = Path(dirpath) / name
            if name.endswith(".json") and p.is_file() and not p.is_symlink():
                rel = p.relative_to(store).as_posix()
                if rel != NAME:
                    out.append(rel)
    return sorted(out)


def hash_metadata(store: Path) -> dict[str, str]:
    return {rel: _sha256(store / rel) for rel in metadata_files(store)}


def write(staged: Path, recipe_id: str, inputs: str) -> Marker:
    m = Marker(recipe_id, inputs, hash_metadata(staged))
    tmp = staged / f"{NAME}.tmp"
    tmp.write_text(json.dumps(m.__dict__, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, staged / NAME)
    return m


def read(store: Path) -> Marker | None:
    """The marker, or None where there is none or it cannot be read as one (a store from before markers,
    or one the units prepared without `tool prepare`)."""
    try:
        with open(store / NAME, "rb") as f:
            raw = json.loads(f.read(MAX_MARKER_BYTES))
    except (OSError, ValueError, RecursionError):
        return None
    if type(raw) is not dict or type(raw.get("inputs")) is not str:
        return None
    meta = raw.get("metadata")
    if meta is not None and not (type(meta) is dict and all(type(k) is str and type(v) is str for k, v in meta.items())):
        meta = {}                           # unreadable: every file then reads as not recorded
    return Marker(str(raw.get("recipe", "")), raw["inputs"], meta)


def check(store: Path, marker: Marker) -> list[str]:
    """Each metadata file that is missing, changed or new since the store was prepared, as one line."""
    if marker.metadata is None:
        return []
    now = metadata_files(store)
    problems = [f"{store / rel}: not in the store any more (recorded in {NAME} when it was prepared)"
                for rel in sorted(set(marker.metadata) - set(now))]
    problems += [f"{store / rel}: not there when the store was prepared ({NAME} does not record it)"
                 for rel in now if rel not in marker.metadata]
    for rel in now:
        want = marker.metadata.get(rel)
        if want is None:
            continue
        try:
            got = _sha256(store / rel)
        except OSError as e:
            problems.append(f"{store / rel}: unreadable ({e.strerror or e})")
            continue
        if got != want:
            problems.append(f"{store / rel}: sha256 {got[:16]}… is not the {want[:16]}… recorded in {NAME} when "
                            f"the store was prepared (edited since)")
    return sorted(problems)
