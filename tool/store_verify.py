"""Verify a recipe's prepared store by running its plan's verify step, as the units would.

The plan (compiled by nix/lib) holds the step's argv and env: `engine verify-store --store …` for native
recipes, a `docker run …` for container ones. A container step runs only when a docker engine answers;
otherwise the report says it was not run and why, rather than pretending.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tool.errors import Exit, KilnError, child_exit, last_line


@dataclass
class StoreReport:
    status: str                 # ok | failed | not prepared | not run | none
    detail: str
    exit_code: Exit = Exit.OK

    def as_dict(self) -> dict:
        return {"status": self.status, "detail": self.detail}


def stores_dir(option=None) -> Path:
    """--store-dir, else $KILN_STORE_DIR, else $KILN_STATE_DIR/stores, else /var/lib/kiln/stores (as nix/lib)."""
    from tool.state import Dirs
    return Dirs.resolve(store_dir=option).stores


def engine_bin() -> str:
    from tool.programs import program
    return program("engine")



def docker_reachable(docker: str) -> str | None:
    """None when a docker engine answers, else why not."""
    if not (shutil.which(docker) or Path(docker).exists()):
        return f"{docker} not installed"
    try:
        r = subprocess.run([docker, "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                           timeout=20)
    except subprocess.TimeoutExpired:
        return "docker info timed out"
    return None if r.returncode == 0 else last_line(r.stderr or r.stdout)


def verify_store(recipe, models: Path, stores: Path, plan: dict | None = None) -> StoreReport:
    """Run the plan's verify step on the published store; `plan`, when the caller has compiled it
    for these directories already, saves an evaluation."""
    if plan is None:
        from tool.plan import compile_plan
        try:
            plan = compile_plan(recipe, {"modelsDir": str(models), "storeDir": str(stores), "engineBin": engine_bin()})
        except KilnError as e:
            return StoreReport("not run", f"cannot compile the plan: {e.message}")
    step = plan["steps"].get("verify")
    store = (plan.get("paths") or {}).get("store")
    if not step or not store:
        return StoreReport("none", "the recipe has no prepared store")
    if not Path(store).is_dir():
        return StoreReport("not prepared", f"{store}: not prepared (run `tool prepare {recipe.id}`)", Exit.FAILED)
    env = {**os.environ, **{k: str(v) for k, v in (step.get("env") or {}).items()}}
    for argv in step["commands"]:
        if plan["runtime"] == "container":
            why = docker_reachable(argv[0])
            if why is not None:
                return StoreReport("not run", f"container verify step not run: docker is not reachable ({why})")
        try:
            r = subprocess.run(argv, env=env, capture_output=True, text=True)
        except OSError as e:
            return StoreReport("not run", f"{argv[0]}: cannot run ({e.strerror or e})", Exit.MISSING_DEP)
        if r.returncode != 0:
            return StoreReport("failed", last_line(r.stderr or r.stdout), child_exit(r.returncode))
    return StoreReport("ok", f"{store}: {last_line(r.stdout) if r.stdout.strip() else 'verified'}")
