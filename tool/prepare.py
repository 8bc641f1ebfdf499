"""`tool prepare`: run a recipe's prepare step in staging, verify the result, publish it by rename.

The plan is compiled a second time with the store directory moved to `<stores>/.staging-<pid>`, so
every command (the engine's argv, or the `docker run` with its -v mounts) writes there and nothing
else changes. The plan's verify step then runs on the staged store; only a verified store is renamed
to `<stores>/<dirname>`. A failure or Ctrl-C removes the staging and leaves the published store (or
none) as it was. A published store that no longer verifies is refused, not silently rebuilt: it was
verified once, so something changed it (`--force` rebuilds it).

Every published store holds `.kiln-prepared.json`, the sha256 of what it was built from (the recipe's
weights, runtime and prepare step): a store built from other inputs — an older recipe, say one whose
prepare now packs another record order — is rebuilt, not reused because it still verifies.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tool.errors import Exit, IntegrityError, KilnError, MissingDependency, NotWritable, child_exit, last_line
from tool.plan import compile_plan
from tool.state import Dirs, pid_alive
from tool.store_verify import StoreReport, verify_store

STAGING_PREFIX = ".staging-"
INPUTS_MARKER = ".kiln-prepared.json"


@dataclass
class PrepareResult:
    status: str             # prepared | skipped | none
    store: Path | None
    detail: str
    seconds: float = 0.0



def run_command(argv: list[str], env: dict, log, what: str, container: str | None = None) -> None:
    """Run one step command, output appended to `log`; a one-line KilnError when it fails.

    Ctrl-C stops the child too (it may sit in another process group when the tool runs under a test or a
    unit), and a container it started is removed, so an interrupt leaves nothing running."""
    try:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    except OSError as e:
        raise MissingDependency(f"{what}: cannot run {argv[0]} ({e.strerror or e})") from None
    try:
        rc = proc.wait()
    except BaseException:
        stop_child(proc)
        if container:
            subprocess.run([argv[0], "rm", "--force", container], capture_output=True)
        raise
    if rc != 0:
        tail = ""
        if hasattr(log, "name") and os.path.exists(log.name):
            log.flush()
            tail = last_line(Path(log.name).read_text(errors="replace")[-4000:])
        raise KilnError(f"{what}: `{Path(argv[0]).name} {argv[1] if len(argv) > 1 else ''}` exited {rc}: {tail}",
                        child_exit(rc))


def stop_child(proc: subprocess.Popen, timeout: float = 10) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)        # the engine stages its own writes and cleans up on SIGINT
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def open_log(dirs: Dirs, rid: str, what: str):
    """<state>/run/<id>.<what>.log, appended to: the engine's own output, for when a step fails."""
    try:
        dirs.run.mkdir(parents=True, exist_ok=True)
        return open(dirs.run / f"{rid}.{what}.log", "a")
    except OSError as e:
        raise NotWritable(f"{dirs.run}: cannot write the log ({e.strerror or e})") from None


def remove_stale_staging(stores: Path) -> None:
    """Staging dirs of runs that were killed outright (SIGKILL, power loss): their pid no longer runs."""
    if not stores.is_dir():
        return
    for p in stores.glob(f"{STAGING_PREFIX}*"):
        try:
            pid = int(p.name[len(STAGING_PREFIX):])
        except ValueError:
            continue
        if pid != os.getpid() and not pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)


def verify_published(recipe, dirs: Dirs, plan: dict | None = None) -> StoreReport:
    return verify_store(recipe, dirs.models, dirs.stores, plan)


def publish(staged: Path, final: Path) -> None:
    """Rename staged → final; an older final is moved aside first and removed only once the new one is in."""
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    try:
        if final.exists():
            os.replace(final, old)
        try:
            os.replace(staged, final)
        except OSError:
            if old.exists():
                os.replace(old, final)
            raise
    except OSError as e:
        raise NotWritable(f"{final}: cannot publish ({e.strerror or e})") from None
    shutil.rmtree(old, ignore_errors=True)


def inputs_hash(recipe) -> str:
    """What a prepared store is a function of: the weights, the runtime (image, program) and the prepare step."""
    inputs = {k: recipe.get(k) for k in ("weights", "runtime")} | {"prepare": (recipe.get("steps") or {}).get("prepare")}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def built_from(store: Path) -> str | None:
    """The inputs hash a published store records (None: none, or unreadable — a store from before markers)."""
    try:
        return json.loads((store / INPUTS_MARKER).read_text())["inputs"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def prepare(recipe, dirs: Dirs, force: bool = False, log=None, plan: dict | None = None) -> PrepareResult:
    """Skip, build-verify-publish, or refuse; see the module docstring. `plan`: the caller's, compiled
    for `dirs` (tool up has one); the staging plan is always compiled here."""
    t0 = time.monotonic()
    plan = plan or compile_plan(recipe, dirs.plan_options())
    step = plan["steps"].get("prepare")
    final = Path(plan["paths"]["store"]) if plan["paths"].get("store") else None
    if step is None or final is None:
        return PrepareResult("none", final, "the recipe has no prepare step")

    inputs = inputs_hash(recipe)
    rebuilt = ""
    if final.exists() and not force and built_from(final) != inputs:
        rebuilt = " (rebuilt: the published store was built from other inputs than the recipe's now)"
    elif final.exists() and not force:
        report = verify_published(recipe, dirs, plan)
        if report.status in ("ok", "none"):
            return PrepareResult("skipped", final, f"{final}: already prepared and verified", time.monotonic() - t0)
        if report.status == "failed":
            raise IntegrityError(f"{final}: the published store no longer verifies ({report.detail}); "
                                 f"`tool prepare {recipe.id} --force` rebuilds it")
        raise KilnError(f"{final}: cannot verify the published store: {report.detail}", report.exit_code or Exit.FAILED)

    remove_stale_staging(dirs.stores)
    staging_root = dirs.stores / f"{STAGING_PREFIX}{os.getpid()}"
    staged_plan = compile_plan(recipe, {**dirs.plan_options(), "storeDir": str(staging_root)})
    staged = Path(staged_plan["paths"]["store"])
    env = {**os.environ, **{k: str(v) for k, v in (staged_plan["steps"]["prepare"].get("env") or {}).items()}}
    container = f"kiln-{recipe.id}-prepare" if plan["runtime"] == "container" else None
    weights = Path(plan["paths"]["weights"])
    if not weights.is_dir():
        raise KilnError(f"{weights}: no weights to prepare from (run `tool fetch {recipe.id}`)")
    try:
        try:
            staged.mkdir(parents=True)
        except OSError as e:
            raise NotWritable(f"{dirs.stores}: cannot create the staging store ({e.strerror or e})") from None
        own_log = log is None
        log = log or open_log(dirs, recipe.id, "prepare")
        try:
            for argv in staged_plan["steps"]["prepare"]["commands"]:
                run_command(argv, env, log, f"{recipe.id}: prepare", container)
        finally:
            if own_log:
                log.close()
        report = verify_store(recipe, dirs.models, staging_root, staged_plan)
        if report.status not in ("ok", "none"):
            raise KilnError(f"{recipe.id}: the prepared store does not verify ({report.detail}); nothing published",
                            report.exit_code if report.exit_code != Exit.OK else Exit.INTEGRITY)
        (staged / INPUTS_MARKER).write_text(json.dumps({"recipe": recipe.id, "inputs": inputs}) + "\n")
        publish(staged, final)
    finally:
        shutil.rmtree(staging_root, ignore_errors=True)
    return PrepareResult("prepared", final, f"{final}: prepared, verified and published{rebuilt}",
                         time.monotonic() - t0)
