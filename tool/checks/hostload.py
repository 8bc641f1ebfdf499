"""How busy the checking host is: the evidence of every gate, and the speed gate's "inconclusive: host busy".

Three views, because each misleads alone:
- os.getloadavg(): what people know, but a 1-minute average that still holds the check's own timed work
  a minute later, so it is recorded, never judged;
- /proc/pressure/cpu "some" (Linux PSI): the share of wall time at least one runnable task waited for a
  CPU. Read as a delta of its `total` counter (microseconds) between two snapshots, it covers exactly the
  interval that was timed -- a server using every core is not "pressure"; anything else wanting a core
  while it decodes is;
- /proc/stat: the share of all CPUs' time that was not idle between two snapshots. Over a window in
  which neither the server nor the baseline works, that is the load other programs put on this host.
Where a file is missing (not Linux, PSI disabled) its figures are None, and nothing is judged on them.
This host's load can slow only what runs on it: runs_here() says whether an endpoint does.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

PSI_CPU = Path("/proc/pressure/cpu")
STAT = Path("/proc/stat")


def _psi(path: Path = PSI_CPU) -> dict | None:
    """{"some_avg10": %, "some_avg60": %, "some_total_us": int} or None."""
    try:
        for line in path.read_text().splitlines():
            kind, *fields = line.split()
            if kind == "some":
                kv = dict(f.split("=", 1) for f in fields)
                return {"some_avg10": float(kv["avg10"]), "some_avg60": float(kv["avg60"]),
                        "some_total_us": int(kv["total"])}
    except (OSError, ValueError, KeyError):
        pass
    return None


def _cpu_jiffies(path: Path = STAT) -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot, or None."""
    try:
        first = path.read_text().splitlines()[0].split()
        if first[0] != "cpu":
            return None
        v = [int(x) for x in first[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)            # idle + iowait
        total = sum(v[:8])                                   # guest time is already inside user/nice
        return total - idle, total
    except (OSError, ValueError, IndexError):
        return None


def snapshot() -> dict:
    """The instant's figures, cheap enough to take around every gate and every timed round."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    jiffies = _cpu_jiffies()
    return {"t": time.monotonic(), "loadavg": load, "logical_cpus": os.cpu_count(),
            "cpu_pressure": _psi(), "cpu_jiffies": list(jiffies) if jiffies else None}


def between(a: dict, b: dict) -> dict:
    """What happened between two snapshots: cpu_busy (0..1 of all CPUs), cpu_pressure_some (0..1 of
    wall time), the interval, and b's load averages."""
    dt = b["t"] - a["t"]
    out = {"interval_s": round(dt, 3), "loadavg": b["loadavg"], "cpu_busy": None, "cpu_pressure_some": None}
    if a["cpu_jiffies"] and b["cpu_jiffies"]:
        busy, total = (b["cpu_jiffies"][i] - a["cpu_jiffies"][i] for i in (0, 1))
        out["cpu_busy"] = round(busy / total, 3) if total > 0 else None
    if a["cpu_pressure"] and b["cpu_pressure"] and dt > 0:
        stalled_us = b["cpu_pressure"]["some_total_us"] - a["cpu_pressure"]["some_total_us"]
        out["cpu_pressure_some"] = round(min(1.0, stalled_us / 1e6 / dt), 3)
    return out


def public(snap: dict) -> dict:
    """A snapshot as the evidence keeps it (no monotonic clock, no raw counters)."""
    psi = snap.get("cpu_pressure") or {}
    return {"loadavg": snap["loadavg"], "logical_cpus": snap["logical_cpus"],
            "cpu_pressure_some_avg10": psi.get("some_avg10"), "cpu_pressure_some_avg60": psi.get("some_avg60")}


def idle_window(seconds: float, sleep=time.sleep) -> dict:
    """Sit still for `seconds` and say how busy the host was meanwhile: with the server and the baseline
    idle, that is everyone else's load."""
    a = snapshot()
    sleep(seconds)
    b = snapshot()
    return {**public(b), **between(a, b)}


def runs_here(url: str) -> bool:
    """Whether the server at `url` runs on this machine, where this machine's load can slow it: its host is a
    loopback address or one this machine holds (it can bind it). A name that does not resolve counts as here, so a
    doubt makes a busy host's verdict "inconclusive", never a pass."""
    host = urlsplit(url).hostname
    if not host:
        return True
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return True
    for family, _, _, _, sockaddr in found:
        ip = ipaddress.ip_address(sockaddr[0].split("%", 1)[0])
        if ip.is_loopback or ip.is_unspecified:
            return True
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.bind((sockaddr[0], 0, *sockaddr[2:]))       # EADDRNOTAVAIL: another machine's address
            return True
        except OSError:
            continue
    return False
