"""--record: append one proof line to the recipe file, atomically, keeping its JSON layout
(indent 2, non-ASCII kept, trailing newline)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tool import atomic
from tool.errors import KilnError, RecipeError


def proof_line(evidence: dict, evidence_sha256: str, gpu: str) -> dict:
    gates = evidence["gates"]
    speed = gates.get("speed") or {}
    return {
        "date": evidence["started_at"][:10],
        "gpu": gpu,
        "gates_passed": [g for g, r in gates.items() if r.get("passed")],
        "decode_tps": speed.get("decode_tps"),
        "prefill_tps": speed.get("prefill_tps"),
        "evidence_sha256": evidence_sha256,
        "by": "kiln",
    }


def append_proof(recipe_path: str | Path, line: dict, expected_sha256: str) -> None:
    """Refuses when the file changed since the run read it: the evidence names that content's hash."""
    path = Path(recipe_path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise RecipeError(f"{path}: cannot read ({e.strerror or e})") from None
    if hashlib.sha256(raw).hexdigest() != expected_sha256:
        raise KilnError(f"{path}: changed since the check read it; proof line not recorded")
    data = json.loads(raw)
    proof = data.setdefault("proof", [])
    if not isinstance(proof, list):
        raise RecipeError(f"{path}::$.proof: is not a list; proof line not recorded")
    proof.append(line)
    atomic.write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n",
                      mode=path.stat().st_mode & 0o777)
