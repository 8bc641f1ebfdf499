"""CPU lists in the kernel's format ('0-3,8,10-11'), as cgroups, sysfs, systemd's CPUAffinity= and docker's
--cpuset-cpus write them. The engine parses its --cpu-layout with its own copy (engine.tiers.readers):
`tool` and `engine` never import each other.
"""
from __future__ import annotations


def parse_cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' → {0,1,2,3,8,10,11} (the kernel's cpulist format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def format_cpulist(cpus) -> str:
    """{0,1,2,3,8} → '0-3,8'."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)
