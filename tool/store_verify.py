"""Verify a recipe's prepared store by running its plan's verify step, as the units would.

The plan (compiled by nix/lib) holds the step's argv and env: `engine verify-store --store …` for native
recipes, a `docker run …` for container ones. A container step runs only when a docker engine answers;
otherwise the report says it was not run and why, rather than pretending. A store `tool prepare` published
also has its manifests checked against the sha256 its marker recorded then (tool.store_marker).
"""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tool import store_marker
from tool.errors import Exit, KilnError, child_exit, last_line
from tool.plan import compile_plan, plan_options
from tool.programs import child_env
from tool.state import Dirs


def verify_exit(returncode: int) -> Exit:
    """A verify step's exit status read as ours (tool.errors.child_exit), except that a step saying no about
    the store itself (1: a bad record; 3: no manifest, or one of another model) is an integrity failure of
    the store, not a failed run or a bad recipe. A status outside the enum (docker's 125) stays a failure."""
    return Exit.INTEGRITY if returncode in (Exit.FAILED, Exit.BAD_RECIPE) else child_exit(returncode)


@dataclass
class StoreReport:
    status: str                 # ok | failed | not prepared | not run | none
    detail: str
    exit_code: Exit = Exit.OK

    def as_dict(self) -> dict:
        return {"status": self.status, "detail": self.detail}


def stores_dir(option=None) -> Path:
    """--store-dir, else $KILN_STORE_DIR, else $KILN_STATE_DIR/stores, else /var/lib/kiln/stores (as nix/lib)."""
    return Dirs.resolve(store_dir=option).stores



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
        try:
            plan = compile_plan(recipe, plan_options(Dirs.resolve(models_dir=models, store_dir=stores)))
        except KilnError as e:
            return StoreReport("not run", f"cannot compile the plan: {e.message}")
    step = plan["steps"].get("verify")
    store = (plan.get("paths") or {}).get("store")
    if not step or not store:
        return StoreReport("none", "the recipe has no prepared store")
    if not Path(store).is_dir():
        return StoreReport("not prepared", f"{store}: not prepared (run `tool prepare {recipe.id}`)", Exit.FAILED)
    # First, cheaply: the manifests as `tool prepare` verified them (a store the units prepared has no marker).
    marker = store_marker.read(Path(store))
    problems = store_marker.check(Path(store), marker) if marker else []
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        return StoreReport("failed", problems[0] + more, Exit.INTEGRITY)
    env = child_env(step.get("env"))
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
            why = last_line(r.stderr or r.stdout).removeprefix("engine: ")      # the reason, not who said it
            return StoreReport("failed", why, verify_exit(r.returncode))
    return StoreReport("ok", f"{store}: {last_line(r.stdout) if r.stdout.strip() else 'verified'}")
