"""Memory: RAM vs the recipe, the cgroup that will enforce its cap, swap, and the memlock limit it will get."""
from __future__ import annotations

import os
import resource

from tool.preflight.checks import CheckResult, failed, gib, passed, warned
from tool.preflight.hostroot import HostRoot


def memory_cap(recipe: dict) -> tuple[int | None, str]:
    """The cap that will apply to the recipe's processes and where it is set."""
    rt = recipe["runtime"]
    if rt["kind"] == "container":
        cap = rt.get("container", {}).get("memory_bytes")
        return cap, "docker --memory"
    cap = rt.get("llama_cpp" if rt["kind"] == "llama-cpp" else "native", {}).get("memory_max_bytes")
    return cap, "systemd MemoryMax="


def check(recipe: dict, root: HostRoot, memlock: CheckResult | None = None) -> list[CheckResult]:
    """`memlock` comes from the Docker probe for container recipes (tool.preflight.container)."""
    info = root.meminfo()
    out = [check_total(recipe, info), check_available(recipe, info), check_cgroup(recipe, root), check_swap(recipe, root, info)]
    out.append(memlock if memlock is not None else check_memlock_native(recipe, root))
    return out


def check_total(recipe: dict, info: dict) -> CheckResult:
    need = recipe["hardware"].get("min_host_ram_bytes", 0)
    have = info.get("MemTotal")
    if have is None:
        return failed("mem.total", f"{gib(need)} of RAM needed; /proc/meminfo has no MemTotal")
    return (passed if have >= need else failed)("mem.total", f"{gib(need)} of RAM needed; MemTotal is {gib(have)}")


def check_available(recipe: dict, info: dict) -> CheckResult:
    cap, where = memory_cap(recipe)
    need, what = (cap, f"the {gib(cap)} cap ({where})") if cap else (recipe["hardware"].get("min_host_ram_bytes", 0), "the recipe")
    have = info.get("MemAvailable", 0)
    return (passed if have >= need else failed)("mem.available", f"{gib(need)} free RAM needed for {what}; MemAvailable is {gib(have)}")


def check_cgroup(recipe: dict, root: HostRoot) -> CheckResult:
    cap, where = memory_cap(recipe)
    container = recipe["runtime"]["kind"] == "container"
    cap_text = f"the {gib(cap)} cap ({where})" if cap else "no memory cap (the recipe sets none)"
    if root.cgroup2_mounted():
        controllers = (root.read("/sys/fs/cgroup/cgroup.controllers") or "").split()
        if "memory" in controllers:
            return passed("mem.cgroup", f"cgroup v2 with the memory controller: {cap_text} will be enforced")
        return warned("mem.cgroup", f"cgroup v2 without the memory controller (cgroup.controllers: {' '.join(controllers) or 'empty'}): {cap_text} will not be enforced")
    v1_memory = any(m.fstype == "cgroup" and "memory" in m.options for m in root.mounts())
    if not cap:
        return passed("mem.cgroup", f"{'cgroup v1 (hybrid)' if v1_memory else 'no cgroup v2'}; {cap_text}")
    # Without cgroup v2 the service still runs; what changes is who enforces the cap, if anyone.
    if v1_memory and container:
        return warned("mem.cgroup", f"cgroup v1 (hybrid), not v2: docker enforces {cap_text} through the v1 memory controller; the recipe was measured under cgroup v2")
    if v1_memory:
        return warned("mem.cgroup", f"cgroup v1 (hybrid), not v2: {cap_text} needs the unified hierarchy at /sys/fs/cgroup, so it will not be enforced")
    return warned("mem.cgroup", f"no cgroup memory controller mounted: {cap_text} will not be enforced")


def check_swap(recipe: dict, root: HostRoot, info: dict) -> CheckResult:
    lines = (root.read("/proc/swaps") or "").splitlines()[1:]
    devices = [ln.split()[0] for ln in lines if ln.split()]
    total = info.get("SwapTotal", 0)
    off = "--memory-swap = --memory" if recipe["runtime"]["kind"] == "container" else "MemorySwapMax=0"
    if devices or total:
        return warned("mem.swap", f"swap is on ({gib(total)} on {', '.join(devices) or 'unknown devices'}); the recipe turns it off inside its cap ({off})")
    return passed("mem.swap", f"swap is off; the recipe keeps it off inside its cap ({off})")


def memlock_hard_limit(root: HostRoot) -> int | None:
    """RLIMIT_MEMLOCK hard limit in bytes (None = unlimited): live on the real host, /proc/self/limits in a tree."""
    if root.is_real:
        hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
        return None if hard == resource.RLIM_INFINITY else hard
    for line in (root.read("/proc/self/limits") or "").splitlines():
        if line.startswith("Max locked memory"):
            hard = line[len("Max locked memory"):].split()[1]
            return None if hard == "unlimited" else int(hard)
    return None


def can_raise_memlock() -> str | None:
    """Try, in a throwaway child, to raise RLIMIT_MEMLOCK to unlimited: None if it can, else the reason.

    A forked child so this process keeps its limits; it is what PID 1 or a container runtime needs
    to do for LimitMEMLOCK=infinity / --ulimit memlock=-1, and it fails without CAP_SYS_RESOURCE.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no Python cleanup, just the answer down the pipe
        try:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            os.write(w, b"")
            os._exit(0)
        except (OSError, ValueError) as e:   # ValueError: "not allowed to raise maximum limit"
            os.write(w, (getattr(e, "strerror", None) or str(e)).encode()[:200])
            os._exit(1)
        except BaseException:
            os._exit(2)
    os.close(w)
    reason = os.read(r, 256).decode(errors="replace")
    os.close(r)
    _, status = os.waitpid(pid, 0)
    return None if os.waitstatus_to_exitcode(status) == 0 else (reason or "refused")


def check_memlock_native(recipe: dict, root: HostRoot) -> CheckResult:
    native = recipe["runtime"].get("native", {})
    want = native.get("memlock")
    if not want:
        return passed("mem.memlock", "the recipe asks no memlock limit")
    hard = memlock_hard_limit(root)
    hard_text = "unlimited" if hard is None else f"{hard // 1024} KiB"
    if hard is None:
        return passed("mem.memlock", f"LimitMEMLOCK={want} can be honoured: the RLIMIT_MEMLOCK hard limit here is unlimited")
    if not root.is_real:
        return warned("mem.memlock", f"LimitMEMLOCK={want}: the RLIMIT_MEMLOCK hard limit is {hard_text}; raising it is probed only on the real host")
    reason = can_raise_memlock()
    if reason is None:
        return passed("mem.memlock", f"LimitMEMLOCK={want} can be honoured: RLIMIT_MEMLOCK (hard {hard_text}) could be raised to unlimited")
    # Pinned host memory only matters when a GPU registers it; a CPU engine runs without it.
    on_gpu = native.get("device", "cuda") != "cpu"
    detail = f"LimitMEMLOCK={want} cannot be honoured: RLIMIT_MEMLOCK hard limit is {hard_text} and raising it fails ({reason})"
    return failed("mem.memlock", detail) if on_gpu else warned("mem.memlock", detail + "; the CPU engine pins no memory")
