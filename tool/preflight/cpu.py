"""CPU: features from /proc/cpuinfo, logical CPUs in this process's cpuset and cgroup, the recipe's layout."""
from __future__ import annotations

import os

from tool.preflight.checks import CheckResult, failed, passed, warned
from tool.cpulist import format_cpulist, parse_cpulist
from tool.preflight.hostroot import HostRoot

ROLES = ("lane", "main", "controller", "readers")


def cpu_flags(root: HostRoot) -> set[str]:
    for line in (root.read("/proc/cpuinfo") or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def machine(root: HostRoot) -> str | None:
    if root.is_real:
        return os.uname().machine
    text = root.read("/proc/sys/kernel/arch")
    return text.strip() if text else None


def layout_text(layout: dict[str, str]) -> str:
    return ", ".join(f"{role} {layout[role]}" for role in ROLES if role in layout)


def derive_layout(cpus: set[int], recipe_layout: dict[str, str]) -> dict[str, str] | None:
    """Spread the recipe's layout over another CPU set in the same proportions, as the seed engine does.

    The measured layout leaves the lowest CPUs to the host (0-1 of 40), then the CPU lane, one main
    thread, one controller, and the NVMe readers on the rest; a set of n CPUs keeps main and
    controller at one each and shares the other n-2 between host, lane and readers by the same ratio.
    None when the set is too small to give every role a CPU of its own.
    """
    sets = {role: parse_cpulist(recipe_layout[role]) for role in ROLES}
    if len(cpus) < 4 or any(not s for s in sets.values()):
        return None
    reserved_w = min(min(s) for s in sets.values())
    lane_w, readers_w = len(sets["lane"]), len(sets["readers"])
    total_w = reserved_w + lane_w + readers_w
    order = sorted(cpus)
    k = len(order) - 2
    reserved = k * reserved_w // total_w
    lane = max(1, round(k * lane_w / total_w))
    if k - reserved - lane < 1:          # readers need one CPU at least: take it from the host share, then the lane
        reserved = max(0, k - lane - 1)
        lane = k - reserved - 1
    cut = [reserved, reserved + lane, reserved + lane + 1, reserved + lane + 2]
    return {
        "lane": format_cpulist(order[cut[0]:cut[1]]),
        "main": format_cpulist(order[cut[1]:cut[2]]),
        "controller": format_cpulist(order[cut[2]:cut[3]]),
        "readers": format_cpulist(order[cut[3]:]),
    }


def check(recipe: dict, root: HostRoot) -> list[CheckResult]:
    cpu = recipe["hardware"].get("cpu", {})
    layout = cpu.get("layout")
    return [check_features(cpu, root), check_count(cpu, layout, root), check_layout(layout, root)]


def check_features(cpu: dict, root: HostRoot) -> CheckResult:
    want = list(cpu.get("features", []))
    arch, have_arch = cpu.get("arch"), machine(root)
    if arch and have_arch and arch != have_arch:
        return failed("cpu.features", f"{arch} CPU needed; this host is {have_arch}")
    if not want:
        return passed("cpu.features", f"no particular CPU features needed ({arch or 'any arch'})")
    flags = cpu_flags(root)
    missing = [f for f in want if f not in flags]
    if missing:
        return failed("cpu.features", f"CPU features {' '.join(want)} needed; /proc/cpuinfo lacks {' '.join(missing)}")
    return passed("cpu.features", f"CPU features {' '.join(want)} present in /proc/cpuinfo")


def logical_cpus(root: HostRoot) -> tuple[set[int], float | None]:
    return root.cpuset(), root.cpu_quota()


def check_count(cpu: dict, layout: dict | None, root: HostRoot) -> CheckResult:
    need = int(cpu.get("min_logical_cpus", 1))
    cpus, quota = logical_cpus(root)
    have = len(cpus)
    why = f" (CPU layout {layout_text(layout)})" if layout else ""
    quota_note = ""
    if quota is not None and quota < have:
        quota_note = f", and its cgroup's cpu.max allows {quota:g} CPUs of time"
        have = min(have, int(quota))
    detail = f"{need} logical CPUs needed{why}; this cpuset has {len(cpus)} ({format_cpulist(cpus)}){quota_note}"
    return (passed if have >= need else failed)("cpu.count", detail)


def check_layout(layout: dict | None, root: HostRoot) -> CheckResult:
    if not layout:
        return passed("cpu.layout", "the recipe pins no CPU layout")
    cpus = root.cpuset()
    wanted = set().union(*(parse_cpulist(layout[r]) for r in ROLES if r in layout))
    if wanted <= cpus:
        return passed("cpu.layout", f"this cpuset ({format_cpulist(cpus)}) holds the recipe's layout ({layout_text(layout)})")
    derived = derive_layout(cpus, layout)
    head = f"this cpuset ({format_cpulist(cpus)}) does not hold the recipe's layout ({layout_text(layout)})"
    if derived is None:
        return failed("cpu.layout", f"{head}, and {len(cpus)} CPUs are too few to derive one (lane, main, controller and readers need 4)")
    return warned("cpu.layout", f"{head}; derived: {layout_text(derived)} (speed with a derived layout is not measured)")
