"""The one door through which every preflight probe reads the host: /proc, /sys, mounts, cgroup files.

Tests hand the probes a constructed tree (a 40-CPU EPYC host, a laptop …) instead of "/", so the
same code that reads this machine reads theirs. Things that cannot live in a tree (statvfs, an
O_DIRECT write, a bind on 127.0.0.1, NVML) are probed on the real paths the caller names.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tool.cpulist import parse_cpulist


@dataclass(frozen=True)
class Mount:
    mount_point: str
    fstype: str
    source: str
    major_minor: str
    options: frozenset[str]          # per-mount options and the filesystem's super options together

    read_only: bool = False          # the per-mount "ro" (a bind mount can be ro over a rw filesystem)


@dataclass(frozen=True)
class HostRoot:
    root: Path = Path("/")

    @property
    def is_real(self) -> bool:
        """True when the probes look at this very machine (so live syscalls describe the same host)."""
        return self.root.resolve() == Path("/")

    def path(self, p: str) -> Path:
        return self.root / p.lstrip("/")

    def read(self, p: str) -> str | None:
        try:
            return self.path(p).read_text()
        except (OSError, UnicodeDecodeError):
            return None

    def exists(self, p: str) -> bool:
        return self.path(p).exists()

    # --- /proc -------------------------------------------------------------------------------
    def meminfo(self) -> dict[str, int]:
        """/proc/meminfo in bytes."""
        out: dict[str, int] = {}
        for line in (self.read("/proc/meminfo") or "").splitlines():
            key, _, rest = line.partition(":")
            fields = rest.split()
            if fields and fields[0].isdigit():
                out[key] = int(fields[0]) * (1024 if fields[1:2] == ["kB"] else 1)
        return out

    def mounts(self) -> list[Mount]:
        """/proc/self/mountinfo: later mounts shadow earlier ones on the same point."""
        out = []
        for line in (self.read("/proc/self/mountinfo") or "").splitlines():
            left, sep, right = line.partition(" - ")
            if not sep:
                continue
            lf, rf = left.split(), right.split()
            if len(lf) < 6 or len(rf) < 2:
                continue
            point = lf[4].replace("\\040", " ")
            opts = lf[5].split(",") + (rf[2].split(",") if len(rf) > 2 else [])
            out.append(Mount(point, rf[0], rf[1], lf[2], frozenset(opts), "ro" in lf[5].split(",")))
        return out

    def mount_of(self, path: str) -> Mount | None:
        """The mount holding `path` (a host path): the longest mount point that prefixes it, last one wins."""
        best = None
        for m in self.mounts():
            mp = m.mount_point
            if path == mp or path.startswith(mp.rstrip("/") + "/"):
                if best is None or len(mp) >= len(best.mount_point):
                    best = m
        return best

    def own_cgroup(self) -> tuple[str | None, dict[str, str]]:
        """(the cgroup v2 path, {v1 controller: path}) of this process, from /proc/self/cgroup."""
        v2, v1 = None, {}
        for line in (self.read("/proc/self/cgroup") or "").splitlines():
            parts = line.split(":", 2)
            if len(parts) != 3:
                continue
            if parts[0] == "0" and parts[1] == "":
                v2 = parts[2]
            else:
                for c in parts[1].split(","):
                    v1[c] = parts[2]
        return v2, v1

    def cgroup2_mounted(self) -> bool:
        """True when /sys/fs/cgroup itself is the unified (v2) hierarchy, not a v1/hybrid tmpfs of controllers."""
        m = self.mount_of("/sys/fs/cgroup")
        return m is not None and m.mount_point == "/sys/fs/cgroup" and m.fstype == "cgroup2"

    def cgroup_file(self, name: str) -> str | None:
        """A cgroup v2 interface file of this process's cgroup (falling back to the hierarchy root)."""
        v2, _ = self.own_cgroup()
        for base in ([v2] if v2 and v2 != "/" else []) + ["/"]:
            text = self.read(f"/sys/fs/cgroup{base.rstrip('/')}/{name}")
            if text is not None:
                return text
        return None

    def cpuset(self) -> set[int]:
        """CPUs this process may run on: sched_getaffinity on the real host, the cgroup's effective set in a tree."""
        if self.is_real:
            return set(os.sched_getaffinity(0))
        text = self.cgroup_file("cpuset.cpus.effective") or self.read("/sys/devices/system/cpu/online") or ""
        return parse_cpulist(text)

    def cpu_quota(self) -> float | None:
        """CPUs' worth of time the cgroup allows (cpu.max, or v1 cfs quota/period); None when unlimited."""
        text = self.cgroup_file("cpu.max")
        if text:
            fields = text.split() + ["100000"]
            return None if fields[0] == "max" else int(fields[0]) / int(fields[1])
        _, v1 = self.own_cgroup()
        base = v1.get("cpu")
        if base is not None:
            for d in (base.rstrip("/"), ""):
                q = self.read(f"/sys/fs/cgroup/cpu{d}/cpu.cfs_quota_us")
                p = self.read(f"/sys/fs/cgroup/cpu{d}/cpu.cfs_period_us")
                if q is not None and p is not None:
                    return int(q) / int(p) if int(q) > 0 else None
        return None
