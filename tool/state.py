"""Kiln's shared state on disk: where its directories are (Dirs) and what a started server leaves behind
(RunRecord, pid_alive). Every command reads them from here; the runners write the records.

nix/lib resolves the same directories for the units (stateDir and its children): the default below is
this language's one copy of it.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tool.atomic import write_json
from tool.programs import program

DEFAULT_STATE_DIR = Path("/var/lib/kiln")


@dataclass(frozen=True)
class Dirs:
    """Kiln's directories: the flags, else --state-dir's children, else KILN_* variables, else /var/lib/kiln."""
    state: Path
    models: Path
    stores: Path
    evidence: Path
    run: Path

    @classmethod
    def resolve(cls, state_dir=None, models_dir=None, store_dir=None, evidence_dir=None) -> "Dirs":
        env = os.environ.get
        state = Path(state_dir or env("KILN_STATE_DIR") or DEFAULT_STATE_DIR).absolute()

        def pick(flag, var, name):
            if flag:
                return Path(flag).absolute()
            if not state_dir and env(var):      # an explicit --state-dir wins over the environment
                return Path(env(var)).absolute()
            return state / name
        return cls(state=state, models=pick(models_dir, "KILN_MODELS_DIR", "models"),
                   stores=pick(store_dir, "KILN_STORE_DIR", "stores"),
                   evidence=pick(evidence_dir, "KILN_EVIDENCE_DIR", "evidence"), run=state / "run")

    def plan_options(self) -> dict:
        """The nix/lib options that put the plan's paths here, and its programs beside this Python."""
        return {"stateDir": str(self.state), "modelsDir": str(self.models), "storeDir": str(self.stores),
                "engineBin": program("engine"), "toolBin": program("tool")}

    def env(self) -> dict[str, str]:
        """KILN_* for child processes (a unit's `tool fetch` reads the same)."""
        return {"KILN_STATE_DIR": str(self.state), "KILN_MODELS_DIR": str(self.models),
                "KILN_STORE_DIR": str(self.stores), "KILN_EVIDENCE_DIR": str(self.evidence)}


@dataclass
class RunRecord:
    """What `tool up` started, so `tool down` / `tool status` can find it: <state>/run/<id>.json."""
    id: str
    runner: str                     # foreground | systemd
    runtime: str                    # native | container
    endpoint: str                   # http://127.0.0.1:PORT/v1
    port: int
    pid: int | None = None          # the child (foreground): its own process group and session
    unit: str | None = None         # systemd
    container: str | None = None    # docker's --name, for `docker stop`
    docker: str | None = None       # the docker client the argv names
    relay_pid: int | None = None    # the loopback relay into a container's netns (see tool.runners.relay)
    log: str | None = None
    started_at: str | None = None
    recipe_path: str | None = None
    extra: dict = field(default_factory=dict)

    @staticmethod
    def path(run_dir: Path, rid: str) -> Path:
        return Path(run_dir) / f"{rid}.json"

    def save(self, run_dir: Path) -> Path:
        return write_json(self.path(run_dir, self.id), asdict(self))

    @classmethod
    def load(cls, run_dir: Path, rid: str) -> "RunRecord | None":
        try:
            data = json.loads(cls.path(run_dir, rid).read_text())
        except (OSError, ValueError):
            return None
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)

    @classmethod
    def all(cls, run_dir: Path) -> list["RunRecord"]:
        out = []
        for p in sorted(Path(run_dir).glob("*.json")) if Path(run_dir).is_dir() else []:
            r = cls.load(run_dir, p.stem)
            if r is not None:
                out.append(r)
        return out

    def forget(self, run_dir: Path) -> None:
        self.path(run_dir, self.id).unlink(missing_ok=True)


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
