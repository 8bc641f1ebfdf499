"""What a started server leaves behind (RunRecord): <state>/run/<id>.json, written by the runners, read by
`tool down` / `tool status` and by `tool up` before it starts another."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tool.atomic import write_json


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
