"""Where Kiln's directories are (Dirs): the state directory and its children, from flags, the environment or the
default. Every command resolves them here.

nix/lib resolves the same directories for the units (stateDir and its children): the default below is
this language's one copy of it. What lives in them is each owner's: run records (tool.run_record), weights
(tool.weights), stores (tool.prepare), evidence (tool.checks.evidence).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

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

    def env(self) -> dict[str, str]:
        """The same directories as the KILN_* variables resolve() reads (what a child, e.g. a unit's `tool fetch`,
        resolves them from)."""
        return {"KILN_STATE_DIR": str(self.state), "KILN_MODELS_DIR": str(self.models),
                "KILN_STORE_DIR": str(self.stores), "KILN_EVIDENCE_DIR": str(self.evidence)}
