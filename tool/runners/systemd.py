"""The systemd runner: the plan's units materialised under / and the serve unit started.

Only where systemd is the service manager (sd_booted: /run/systemd/system exists); anywhere else
it refuses in one line and names the foreground runner. The units' own ExecStartPost runs the
load gate, so `systemctl start` returns once the server answered a real completion.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tool.errors import KilnError, MissingDependency, last_line
from tool.materialise import materialise
from tool.run_record import RunRecord

BOOTED_MARK = Path("/run/systemd/system")


def pid1() -> str:
    try:
        return Path("/proc/1/comm").read_text().strip()
    except OSError:
        return "?"


def unusable() -> str | None:
    """None when systemctl can start units here, else why not (one line)."""
    if shutil.which("systemctl") is None:
        return "systemctl is not installed"
    if not BOOTED_MARK.is_dir():
        return f"systemd is not the service manager here (PID 1 is {pid1()}, no {BOOTED_MARK})"
    return None


def systemctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["systemctl", *args], capture_output=True, text=True)



def start(plan: dict, root: str | os.PathLike = "/") -> RunRecord:
    """Materialise every unit under `root`, daemon-reload, start the serve unit (it pulls in the chain)."""
    why = unusable()
    if why:
        raise MissingDependency(f"--runner systemd: {why}; use --runner foreground")
    materialise(plan, root)
    for args in (("daemon-reload",), ("start", plan["steps"]["serve"]["unit"])):
        r = systemctl(*args)
        if r.returncode != 0:
            raise KilnError(f"systemctl {' '.join(args)}: {last_line(r.stderr or r.stdout)}")
    port = int(plan["options"]["port"])
    return RunRecord(id=plan["id"], runner="systemd", runtime=plan["runtime"],
                     endpoint=plan["endpoint"], port=port, unit=plan["steps"]["serve"]["unit"])


def is_alive(unit: str):
    """An is_alive() for a unit: its ActiveState, and on failure its Result, exit status and journal tail."""
    def check():
        r = systemctl("show", unit, "--property=ActiveState,Result,ExecMainStatus,ExecMainCode")
        props = dict(l.split("=", 1) for l in r.stdout.splitlines() if "=" in l)
        if props.get("ActiveState") in ("active", "activating", "reloading"):
            return True
        j = subprocess.run(["journalctl", "-u", unit, "-n", "20", "--no-pager", "-o", "cat"],
                           capture_output=True, text=True)
        tail = " | ".join(l for l in j.stdout.splitlines() if l.strip())
        return (f"{unit} is {props.get('ActiveState', '?')} (result {props.get('Result', '?')}, "
                f"status {props.get('ExecMainStatus', '?')})" + (f"; last log lines: {tail}" if tail else ""))
    return check


def stop(record: RunRecord) -> str:
    r = systemctl("stop", record.unit)
    if r.returncode != 0:
        raise KilnError(f"systemctl stop {record.unit}: {last_line(r.stderr or r.stdout)}")
    return "stopped (systemctl stop)"
