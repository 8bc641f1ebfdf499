"""is_alive() callbacks for servers Kiln starts itself (a child process today; units and containers
build theirs the same way): the reason names the exit code, a likely OOM kill and the last log lines."""
from __future__ import annotations

import signal
import subprocess
from collections import deque
from pathlib import Path


def exit_reason(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        oom = " (OOM-killed?)" if -code == signal.SIGKILL else ""
        return f"killed by {name}{oom}"
    if code == 137:     # 128 + SIGKILL: how docker and shells report the OOM killer
        return "exited with code 137 (SIGKILL: OOM-killed?)"
    return f"exited with code {code}"


def log_tail(path: str | Path | None, lines: int = 5) -> list[str]:
    if not path:
        return []
    try:
        with open(path, errors="replace") as f:
            return [l.rstrip("\n") for l in deque(f, maxlen=lines)]
    except OSError:
        return []


def process_liveness(proc: subprocess.Popen, log_path: str | Path | None = None, tail: int = 5):
    """An is_alive() for a child process whose output goes to log_path."""
    def is_alive():
        code = proc.poll()
        if code is None:
            return True
        last = log_tail(log_path, tail)
        return f"the server {exit_reason(code)}" + (f"; last log lines: {' | '.join(last)}" if last else "")
    return is_alive
