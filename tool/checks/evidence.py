"""The evidence file of one check run: what ran, where, against what, and every answer.

Written atomically (tool.atomic) to <evidence-dir>/<card>.<recipe>.<UTC timestamp>.json.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from tool import atomic

FORMAT = 1


def _nvidia_smi() -> list[dict]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total,driver_version,pci.bus_id",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4:
            name, mem, driver, bus = parts
            gpus.append({"name": name, "memory_mib": int(mem) if mem.isdigit() else mem,
                         "driver": driver, "pci_bus_id": bus})
    return gpus


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _ram_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def host_fingerprint() -> dict:
    gpus = _nvidia_smi()
    return {
        "gpus": gpus,
        "driver": gpus[0]["driver"] if gpus else None,
        "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "ram_bytes": _ram_bytes(),
        "os": platform.platform(),
        "python": platform.python_version(),
    }


def gpu_label(host: dict) -> str:
    """'RTX 3090', '4x NVIDIA RTX PRO 6000 Blackwell', or 'none' (the proof line's gpu)."""
    names = [g["name"] for g in host.get("gpus") or []]
    if not names:
        return "none"
    if len(set(names)) == 1:
        return names[0] if len(names) == 1 else f"{len(names)}x {names[0]}"
    return " + ".join(names)


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def file_name(recipe, when: datetime) -> str:
    card = (recipe.get("hardware") or {}).get("card", "any")
    return f"{card}.{recipe.id}.{when.strftime('%Y%m%dT%H%M%SZ')}.json"


def encode(evidence: dict) -> bytes:
    return (json.dumps(evidence, indent=2, ensure_ascii=False) + "\n").encode()


def write(evidence: dict, recipe, evidence_dir: str | os.PathLike, json_path: str | os.PathLike | None,
          when: datetime) -> tuple[list[Path], str]:
    """Write the evidence (same bytes) to the evidence dir and to json_path; → (paths, sha256)."""
    data = encode(evidence)
    paths = [atomic.write_bytes(Path(evidence_dir) / file_name(recipe, when), data)]
    if json_path is not None:
        paths.append(atomic.write_bytes(json_path, data))
    return paths, hashlib.sha256(data).hexdigest()
