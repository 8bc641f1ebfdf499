"""`tool prepare`: run a recipe's prepare step in staging, verify the result, publish it by rename.

The plan is compiled a second time with the store directory moved to `<stores>/.staging-<pid>`, so
every command (the engine's argv, or the `docker run` with its -v mounts) writes there and nothing
else changes. The plan's verify step then runs on the staged store; only a verified store is renamed
to `<stores>/<dirname>`. A failure or Ctrl-C removes the staging and leaves the published store (or
none) as it was. A published store that no longer verifies is refused, not silently rebuilt: it was
verified once, so something changed it (`--force` rebuilds it).

Every published store holds `.kiln-prepared.json` (tool.store_marker), the sha256 of what it was built from
(the recipe's weights, runtime and prepare step): a store built from other inputs — an older recipe, say
one whose prepare now packs another record order — is rebuilt, not reused because it still verifies. The
marker also records the sha256 of the store's manifests (every JSON file in it) as they were verified,
and `tool verify` (so this skip too) checks them: a manifest edited since, even one that agrees with its
own sidecar, fails like a corrupted record. A store whose marker predates that record is rebuilt.
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tool.errors import (Exit, IntegrityError, KilnError, MissingDependency, NotWritable, child_exit, last_line,
                         raise_if_interrupted)
from tool.pids import pid_alive
from tool.plan import compile_plan, plan_options
from tool.programs import child_env
from tool import store_marker
from tool.state import Dirs
from tool.store_verify import StoreReport, verify_store

STAGING_PREFIX = ".staging-"
PR_SET_PDEATHSIG = 1    # <linux/prctl.h>
AT_FDCWD = -100         # <fcntl.h>
RENAME_EXCHANGE = 2     # <linux/fs.h>
INPUTS_MARKER = store_marker.NAME


@dataclass
class PrepareResult:
    status: str             # prepared | skipped | none
    store: Path | None
    detail: str
    seconds: float = 0.0



def _die_with_parent(parent: int):
    """preexec_fn: the child gets SIGKILL when the tool dies, however it dies (SIGKILL included), so a
    killed `tool prepare` leaves no pack-store writing into a staging directory nobody will publish.
    PR_SET_PDEATHSIG fires when the spawning thread exits: run_command is called from the main thread."""
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl: nobody will wait for us
            os._exit(1)
    return preexec


def run_command(argv: list[str], env: dict, log, what: str, container: str | None = None) -> None:
    """Run one step command, output appended to `log`; a one-line KilnError when it fails.

    Ctrl-C stops the child too (it may sit in another process group when the tool runs under a test or a
    unit), and a container it started is removed, so an interrupt leaves nothing running. If the tool is
    killed outright the child is killed with it (PR_SET_PDEATHSIG); a container, which lives in the docker
    daemon, is removed by the next run before it starts its own."""
    if container:
        try:
            subprocess.run([argv[0], "rm", "--force", container], capture_output=True, stdin=subprocess.DEVNULL)
        except OSError:
            pass  # no docker client: the Popen below says so
    try:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent(os.getpid()) if sys.platform == "linux" else None)
    except OSError as e:
        raise MissingDependency(f"{what}: cannot run {argv[0]} ({e.strerror or e})") from None
    try:
        raise_if_interrupted()          # a Ctrl-C during the fork itself is swallowed there (tool.errors.interrupt)
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


def exchange(a: Path, b: Path) -> None:
    """Swap two paths in one step: renameat2(RENAME_EXCHANGE). OSError (EINVAL, ENOSYS) where the kernel,
    the filesystem or the C library cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)  # glibc >= 2.28
    if renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not in this C library", str(a))
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a))


def _aside(final: Path, pid: int) -> Path:
    return final.with_name(f".{final.name}.old-{pid}")


def publish(staged: Path, final: Path) -> None:
    """Put the staged store at `final` so that a kill at any instant leaves a whole store there.

    No store yet: one rename. A store there: exchanged with the staged one in one step (renameat2), so
    `final` is the old store until the instant it is the new one; the old one, now at the staged path,
    is removed with the staging directory (or, after a kill, by the next run's stale-staging sweep).
    Where the filesystem cannot exchange, the old store is moved aside, the new renamed in, the old
    removed: a kill between the two renames leaves the old one aside, and `restore_aside` (run first by
    every prepare) puts it back."""
    try:
        if not os.path.lexists(final):
            os.rename(staged, final)
            return
        try:
            exchange(staged, final)
            return
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
        old = _aside(final, os.getpid())
        os.rename(final, old)
        try:
            os.rename(staged, final)
        except OSError:
            os.rename(old, final)
            raise
    except OSError as e:
        raise NotWritable(f"{final}: cannot publish ({e.strerror or e})") from None
    shutil.rmtree(old, ignore_errors=True)


def restore_aside(final: Path) -> None:
    """After a kill mid-publish (the move-aside way): the old store back where it was if no store is there,
    and left-over old stores of dead runs removed."""
    for old in sorted(final.parent.glob(f".{final.name}.old-*")):
        try:
            pid = int(old.name.rsplit("-", 1)[1])
        except ValueError:
            continue
        if pid == os.getpid() or pid_alive(pid):
            continue
        if not os.path.lexists(final):
            try:
                os.rename(old, final)
                continue
            except OSError:
                pass
        shutil.rmtree(old, ignore_errors=True)


def size_note(recipe, staged: Path) -> str:
    """Where what prepare wrote exceeds the recipe's store.size_bytes (the disk need preflight counts): a note
    naming both, so the recipe can be corrected; empty when it fits."""
    declared = (recipe.get("store") or {}).get("size_bytes")
    used = sum(f.stat().st_size for f in staged.rglob("*") if f.is_file() and not f.is_symlink())
    if declared is None or used <= declared:
        return ""
    return (f"; note: it takes {used} bytes, more than the recipe's store.size_bytes {declared} "
            f"(the disk need preflight checks): raise it")


def inputs_hash(recipe) -> str:
    """What a prepared store is a function of: the weights, the runtime (image, program) and the prepare step."""
    inputs = {k: recipe.get(k) for k in ("weights", "runtime")} | {"prepare": (recipe.get("steps") or {}).get("prepare")}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def prepare(recipe, dirs: Dirs, force: bool = False, log=None, plan: dict | None = None) -> PrepareResult:
    """Skip, build-verify-publish, or refuse; see the module docstring. `plan`: the caller's, compiled
    for `dirs` (tool up has one); the staging plan is always compiled here."""
    t0 = time.monotonic()
    plan = plan or compile_plan(recipe, plan_options(dirs))
    step = plan["steps"].get("prepare")
    final = Path(plan["paths"]["store"]) if plan["paths"].get("store") else None
    if step is None or final is None:
        return PrepareResult("none", final, "the recipe has no prepare step")

    # what a run killed outright left: an old store aside (put back), staging dirs (removed)
    if final.parent.is_dir():
        restore_aside(final)
    remove_stale_staging(dirs.stores)
    inputs = inputs_hash(recipe)
    marker = store_marker.read(final) if final.exists() else None
    rebuilt = ""
    if final.exists() and not force and (marker is None or marker.inputs != inputs):
        rebuilt = " (rebuilt: the published store was built from other inputs than the recipe's now)"
    elif final.exists() and not force and marker.metadata is None:
        rebuilt = " (rebuilt: the published store was prepared before its manifests' sha256 were recorded)"
    elif final.exists() and not force:
        report = verify_published(recipe, dirs, plan)
        if report.status in ("ok", "none"):
            return PrepareResult("skipped", final, f"{final}: already prepared and verified", time.monotonic() - t0)
        if report.status == "failed":
            raise IntegrityError(f"{final}: the published store no longer verifies ({report.detail}); "
                                 f"`tool prepare {recipe.id} --force` rebuilds it")
        raise KilnError(f"{final}: cannot verify the published store: {report.detail}", report.exit_code or Exit.FAILED)

    staging_root = dirs.stores / f"{STAGING_PREFIX}{os.getpid()}"
    staged_plan = compile_plan(recipe, {**plan_options(dirs), "storeDir": str(staging_root)})
    staged = Path(staged_plan["paths"]["store"])
    env = child_env(staged_plan["steps"]["prepare"].get("env"))
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
        note = size_note(recipe, staged)
        store_marker.write(staged, recipe.id, inputs)      # the manifests' sha256 as verified, beside the inputs
        publish(staged, final)
    finally:
        shutil.rmtree(staging_root, ignore_errors=True)
    return PrepareResult("prepared", final, f"{final}: prepared, verified and published{rebuilt}{note}",
                         time.monotonic() - t0)
