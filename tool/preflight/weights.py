"""Weights: already fetched (at the pinned revision?) and a token when the repo needs one."""
from __future__ import annotations

import json
import os
from pathlib import Path

from tool.preflight.checks import CheckResult, failed, passed, warned

MARKER = ".kiln-weights.json"   # written by tool fetch after it verified every file: {"repo", "revision", ...}


def pin_of(weights: dict) -> tuple[str, str]:
    if weights.get("source") == "huggingface":
        return weights["repo"], weights["revision"]
    if weights.get("source") == "local":
        return weights["path"], weights["sha256"]
    return weights.get("package", weights.get("source", "?")), weights.get("version", "")


def check_present(recipe: dict, models_dir: Path) -> CheckResult:
    w = recipe["weights"]
    where = Path(models_dir) / w["dirname"]
    name, pin = pin_of(w)
    try:
        files = [p for p in where.iterdir() if p.name != MARKER] if where.is_dir() else []
    except OSError as e:
        return warned("weights.present", f"{where}: cannot be listed ({e.strerror})")
    if not files:
        return warned("weights.present", f"{name}@{pin[:12]} not yet fetched: {where} {'is empty' if where.is_dir() else 'does not exist'} (tool fetch downloads it)")
    try:
        marker = json.loads((where / MARKER).read_text())
    except FileNotFoundError:
        return warned("weights.present", f"{where} holds {len(files)} files but no {MARKER}: unverified (tool verify checks them against {name}@{pin[:12]})")
    except (OSError, ValueError) as e:
        return warned("weights.present", f"{where / MARKER} is unreadable ({e}); tool fetch rewrites it")
    got = (marker.get("repo") or marker.get("package") or marker.get("path"),
           marker.get("revision") or marker.get("version") or marker.get("sha256"))
    if got != (name, pin):
        return warned("weights.present", f"{where} holds {got[0]}@{str(got[1])[:12]}, the recipe pins {name}@{pin[:12]} (tool fetch fetches the pin)")
    return passed("weights.present", f"{name}@{pin[:12]} fetched in {where} ({len(files)} files, marker {MARKER})")


def hf_token() -> tuple[str | None, str]:
    """(token, where it came from): HF_TOKEN, else huggingface_hub's token file."""
    if os.environ.get("HF_TOKEN"):
        return os.environ["HF_TOKEN"], "HF_TOKEN"
    from huggingface_hub import constants

    path = Path(constants.HF_TOKEN_PATH)
    try:
        token = path.read_text().strip()
    except OSError:
        return None, ""
    return (token or None), str(path)


def check_token(recipe: dict) -> CheckResult:
    w = recipe["weights"]
    if w.get("source") != "huggingface":
        return passed("weights.token", f"{w.get('source')}: no token needed")
    token, where = hf_token()
    if token:
        return passed("weights.token", f"Hugging Face token present ({where}) for {w['repo']}")
    gated = w.get("gated")
    if gated:
        return failed("weights.token", f"{w['repo']} is gated: a Hugging Face token is needed (HF_TOKEN or `hf auth login`); none found")
    if gated is None:
        return passed("weights.token", f"no Hugging Face token; {w['repo']} is not marked gated, so none is expected (set HF_TOKEN if the Hub answers 401)")
    return passed("weights.token", f"{w['repo']} is public: no token needed")


def check(recipe: dict, models_dir: Path) -> list[CheckResult]:
    return [check_present(recipe, models_dir), check_token(recipe)]
