"""Whether a process Kiln started (a server, a relay, another run's staging) still runs."""
from __future__ import annotations

import os
from pathlib import Path


def pid_alive(pid: int | None) -> bool:
    """Running and not a zombie (a detached child whose parent never reaped it still has a pid)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")
