"""`tool prepare`, run as the console script: the plan's prepare step (`engine pack-store`) in staging, the plan's
verify step (`engine verify-store`, O_DIRECT) on the result, publish by rename. Real engine, real files; the
weights are a tiny random Mixtral checkpoint (tests/fixtures/tiny_models.py) placed where `tool fetch` puts them.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("nix-instantiate") is None, reason="plans are compiled by Nix")

REPO = Path(__file__).resolve().parents[1]
TOOL = str(Path(sys.executable).parent / "tool")
RECIPE = REPO / "tests" / "fixtures" / "recipes-e2e" / "tiny-moe.kiln.1k.json"
TINY = json.loads(RECIPE.read_text())


def tool(*args, env) -> subprocess.CompletedProcess:
    return subprocess.run([TOOL, *args], capture_output=True, text=True, env=env, timeout=180, cwd=REPO)


@pytest.fixture
def setup(tiny_checkpoint, tmp_path):
    recipes = tmp_path / "recipes" / "cpu" / "any"
    recipes.mkdir(parents=True)
    shutil.copy(RECIPE, recipes / RECIPE.name)
    state = tmp_path / "state"
    shutil.copytree(tiny_checkpoint("mixtral"), state / "models" / TINY["weights"]["dirname"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env["KILN_RECIPES"] = str(tmp_path / "recipes")
    return env, state, state / "stores" / TINY["store"]["dirname"]


def snapshot(store: Path) -> dict[str, bytes]:
    return {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file()}


def test_prepare_publishes_a_verified_store_then_skips_then_force_rebuilds(setup):
    env, state, store = setup
    r = tool("prepare", "tiny-moe", "--state-dir", str(state), env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"tiny-moe: prepared: {store}: prepared, verified and published (")
    assert sorted(p.name for p in (store / "experts").iterdir()) == ["experts.bin", "manifest.json", "manifest.sha256"]
    assert [p.name for p in (state / "stores").iterdir()] == [store.name]        # no staging left
    first = snapshot(store)

    again = tool("prepare", "tiny-moe", "--state-dir", str(state), "--json", env=env)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["status"] == "skipped"
    assert snapshot(store) == first

    inode = (store / "experts" / "experts.bin").stat().st_ino
    forced = tool("prepare", "tiny-moe", "--state-dir", str(state), "--force", env=env)
    assert forced.returncode == 0 and " prepared: " in forced.stdout, forced.stderr
    assert (store / "experts" / "experts.bin").stat().st_ino != inode            # a new store, renamed in
    assert snapshot(store)["experts/experts.bin"] == first["experts/experts.bin"]
    assert [p.name for p in (state / "stores").iterdir()] == [store.name]


def test_a_store_built_from_other_inputs_is_rebuilt_not_reused(setup):
    """The store records what it was built from; a recipe whose prepare step changed (here: the record
    order) gets a new store even though the old one still verifies."""
    env, state, store = setup
    assert tool("prepare", "tiny-moe", "--state-dir", str(state), env=env).returncode == 0
    marker = json.loads((store / ".kiln-prepared.json").read_text())
    assert marker["recipe"] == "tiny-moe" and len(marker["inputs"]) == 64
    assert json.loads((store / "experts" / "manifest.json").read_text())["order"] == "rows"

    path = Path(env["KILN_RECIPES"]) / "cpu" / "any" / RECIPE.name
    data = json.loads(path.read_text())
    data["steps"]["prepare"]["commands"][-1] += ["--order", "cols"]
    path.write_text(json.dumps(data, indent=2) + "\n")
    r = tool("prepare", "tiny-moe", "--state-dir", str(state), env=env)
    assert r.returncode == 0, r.stderr
    assert "prepared, verified and published (rebuilt: the published store was built from other inputs" in r.stdout
    assert json.loads((store / "experts" / "manifest.json").read_text())["order"] == "cols"
    assert json.loads((store / ".kiln-prepared.json").read_text())["inputs"] != marker["inputs"]
    assert json.loads(tool("prepare", "tiny-moe", "--state-dir", str(state), "--json", env=env).stdout)["status"] == "skipped"


def test_a_recipe_whose_store_size_understates_what_prepare_wrote_is_told(setup):
    """store.size_bytes is the disk need preflight checks; prepare measures what it wrote and says when the
    recipe understates it (the store is still published: the recipe's claim, not the store, is wrong)."""
    env, state, store = setup
    fine = tool("prepare", "tiny-moe", "--state-dir", str(state), env=env)
    assert fine.returncode == 0 and "note:" not in fine.stdout, fine.stdout
    used = sum(f.stat().st_size for f in store.rglob("*") if f.is_file()) - (store / ".kiln-prepared.json").stat().st_size
    path = Path(env["KILN_RECIPES"]) / "cpu" / "any" / RECIPE.name
    data = json.loads(path.read_text())
    data["store"]["size_bytes"] = 4096
    path.write_text(json.dumps(data, indent=2) + "\n")
    r = tool("prepare", "tiny-moe", "--state-dir", str(state), "--force", env=env)
    assert r.returncode == 0, r.stderr
    assert (f"prepared, verified and published; note: it takes {used} bytes, more than the recipe's store.size_bytes "
            "4096 (the disk need preflight checks): raise it") in r.stdout, r.stdout


def test_a_failing_prepare_leaves_the_published_store_as_it_was(setup):
    env, state, store = setup
    assert tool("prepare", "tiny-moe", "--state-dir", str(state), env=env).returncode == 0
    before = snapshot(store)
    (state / "models" / TINY["weights"]["dirname"] / "model.safetensors").write_bytes(b"not a safetensors file")
    r = tool("prepare", "tiny-moe", "--state-dir", str(state), "--force", env=env)
    assert r.returncode != 0
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("tool: tiny-moe: prepare: `engine pack-store` exited ")
    assert snapshot(store) == before
    assert [p.name for p in (state / "stores").iterdir()] == [store.name]


def test_a_tampered_published_store_is_refused_not_silently_rebuilt(setup):
    env, state, store = setup
    assert tool("prepare", "tiny-moe", "--state-dir", str(state), env=env).returncode == 0
    data = store / "experts" / "experts.bin"
    with open(data, "r+b") as f:
        f.seek(4096 + 7)
        b = f.read(1)
        f.seek(4096 + 7)
        f.write(bytes([b[0] ^ 0x55]))
    r = tool("prepare", "tiny-moe", "--state-dir", str(state), env=env)
    assert r.returncode == 8, r.stderr
    assert r.stderr.startswith(f"tool: {store}: the published store no longer verifies (") and r.stderr.count("\n") == 1
    assert r.stderr.rstrip().endswith("`tool prepare tiny-moe --force` rebuilds it")
    fixed = tool("prepare", "tiny-moe", "--state-dir", str(state), "--force", env=env)
    assert fixed.returncode == 0, fixed.stderr


def test_no_weights_is_one_line(setup):
    env, state, store = setup
    shutil.rmtree(state / "models")
    r = tool("prepare", "tiny-moe", "--state-dir", str(state), env=env)
    assert r.returncode == 1
    assert r.stderr == (f"tool: {state / 'models' / TINY['weights']['dirname']}: no weights to prepare from "
                        f"(run `tool fetch tiny-moe`)\n")
    assert not store.exists()


# ---------------------------------------------------------------- killed outright: no orphan, never no store

def alive(pid: int) -> bool:
    """Running, not a zombie (an orphan killed in a container whose init does not reap stays a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_sigkill_of_prepare_kills_its_child(setup, tmp_path):
    """A real `tool prepare`, SIGKILLed while its step runs: the step's process dies with it. The step is the
    real engine behind a 60-second sleep (KILN_ENGINE_BIN), so without PR_SET_PDEATHSIG it would surely still
    be running when we look."""
    env, state, store = setup
    pidfile = tmp_path / "child.pid"
    wrapper = tmp_path / "engine"
    wrapper.write_text(f"#!{sys.executable}\nimport os, sys, time\n"
                       f"open({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
                       f"time.sleep(60)\nos.execv({str(Path(sys.executable).parent / 'engine')!r}, sys.argv)\n")
    wrapper.chmod(0o755)
    proc = subprocess.Popen([TOOL, "prepare", "tiny-moe", "--state-dir", str(state)], cwd=REPO,
                            env={**env, "KILN_ENGINE_BIN": str(wrapper)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not pidfile.exists() or not pidfile.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        child = int(pidfile.read_text())
        assert alive(child)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        gone_by = time.monotonic() + 5
        while alive(child) and time.monotonic() < gone_by:
            time.sleep(0.05)
        assert not alive(child), "the step's process outlived the killed tool"
    finally:
        proc.kill()
        proc.communicate()
        if pidfile.exists() and pidfile.read_text() and alive(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)
    assert not store.exists()                               # nothing published by a killed run


# publish() killed by a real SIGKILL at each point between its steps, in a process of its own, on real
# directories. `exchange` is renameat2(RENAME_EXCHANGE) on this filesystem; "aside-*" make it refuse (EINVAL,
# as on a filesystem without it) to reach the move-aside way.
KILLER = r"""
import errno, os, signal, sys
from pathlib import Path
import tool.prepare as p
stores, point = Path(sys.argv[1]), sys.argv[2]
staged = stores / f"{p.STAGING_PREFIX}{os.getpid()}" / "store"
staged.mkdir(parents=True)
(staged / "data").write_text("new")
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
real_exchange, real_rename, renames = p.exchange, os.rename, []
def exchange(a, b):
    if point.startswith("aside"):
        raise OSError(errno.EINVAL, "no RENAME_EXCHANGE here")
    real_exchange(a, b)
    if point == "after-exchange":
        die()
def rename(a, b):
    real_rename(a, b)
    renames.append(b)
    if point == f"aside-after-rename-{len(renames)}":
        die()
p.exchange, os.rename = exchange, rename
if point == "before-publish":
    die()
p.publish(staged, stores / "store")
"""


@pytest.mark.parametrize("point,after_kill", [
    ("before-publish", "old"), ("after-exchange", "new"), ("aside-after-rename-1", None), ("aside-after-rename-2", "new"),
    ("completes", "new"),
])
def test_a_kill_at_each_point_of_publish_leaves_a_whole_store(point, after_kill, tmp_path):
    from tool.prepare import remove_stale_staging, restore_aside
    stores = tmp_path / "stores"
    final = stores / "store"
    final.mkdir(parents=True)
    (final / "data").write_text("old")
    r = subprocess.run([sys.executable, "-c", KILLER, str(stores), point], capture_output=True, text=True,
                       cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert r.returncode == (0 if point == "completes" else -signal.SIGKILL), r.stderr
    # right after the kill: a whole store at `final`, old or new, except in the middle of the move-aside way
    assert ((final / "data").read_text() if final.exists() else None) == after_kill
    # what the next `tool prepare` does first: the old store back if it was aside, the leftovers gone
    restore_aside(final)
    remove_stale_staging(stores)
    assert (final / "data").read_text() == ("old" if after_kill in ("old", None) else "new")
    assert [q.name for q in stores.iterdir()] == ["store"]


def test_exchange_swaps_two_directories_in_one_step(tmp_path):
    from tool.prepare import exchange
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_text("a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("b")
    exchange(tmp_path / "a", tmp_path / "b")
    assert [(tmp_path / n / "x").read_text() for n in "ab"] == ["b", "a"]
    with pytest.raises(OSError):
        exchange(tmp_path / "a", tmp_path / "missing")


def test_prepare_restores_a_store_left_aside_by_a_killed_run(setup):
    """The move-aside way killed between its renames left no store, only `.<name>.old-<pid>`: the next
    prepare puts it back (verified, skipped) instead of rebuilding, and sweeps the dead run's staging."""
    env, state, store = setup
    assert tool("prepare", "tiny-moe", "--state-dir", str(state), env=env).returncode == 0
    inode = (store / "experts" / "experts.bin").stat().st_ino
    dead = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True).stdout.strip()
    store.rename(store.with_name(f".{store.name}.old-{dead}"))
    (state / "stores" / f".staging-{dead}" / store.name).mkdir(parents=True)
    r = tool("prepare", "tiny-moe", "--state-dir", str(state), "--json", env=env)
    assert r.returncode == 0 and json.loads(r.stdout)["status"] == "skipped", r.stderr
    assert (store / "experts" / "experts.bin").stat().st_ino == inode
    assert [p.name for p in (state / "stores").iterdir()] == [store.name]


def test_the_marker_records_the_manifests_sha256_and_an_edited_manifest_is_not_skipped(setup):
    """Issue 12 (7): the store manifest's own sha256 is kept beside the inputs hash. A manifest edited with its
    sidecar rewritten to match (here: the record order relabelled, which no hash of the records can see)
    passes `engine verify-store`, but not the skip."""
    import hashlib
    env, state, store = setup
    assert tool("prepare", "tiny-moe", "--state-dir", str(state), env=env).returncode == 0
    manifest = store / "experts" / "manifest.json"
    marker = json.loads((store / ".kiln-prepared.json").read_text())
    assert marker["metadata"] == {"experts/manifest.json": hashlib.sha256(manifest.read_bytes()).hexdigest()}

    doc = json.loads(manifest.read_text())
    doc["order"] = "cols"
    text = (json.dumps(doc) + "\n").encode()
    manifest.write_bytes(text)
    (store / "experts" / "manifest.sha256").write_text(f"{hashlib.sha256(text).hexdigest()}  manifest.json\n")
    r = tool("prepare", "tiny-moe", "--state-dir", str(state), env=env)
    assert r.returncode == 8 and r.stderr.count("\n") == 1, r.stdout + r.stderr
    assert r.stderr.startswith(f"tool: {store}: the published store no longer verifies ({manifest}: sha256 ")
    assert "recorded in .kiln-prepared.json when the store was prepared (edited since)" in r.stderr


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")   # the dropped interrupt: the case
def test_a_ctrl_c_that_lands_in_the_fork_still_stops_the_step(tmp_path):
    """CI met it: a SIGINT that arrived while `tool up` forked its prepare step raised inside logging's after-fork
    hook, where Python prints the exception and drops it; the step ran to its end and the tool exited 0. Simulated
    here as that landing: tool.errors.interrupt (the SIGINT handler) called from an after-fork hook, once, around a
    real child that would sleep for a minute. The step stops at once, its child with it."""
    from tool import errors, prepare
    armed = [True]

    def swallowed_ctrl_c():
        if armed[0]:
            armed[0] = False
            errors.interrupt()
    os.register_at_fork(after_in_parent=swallowed_ctrl_c)      # cannot be unregistered: it fires once
    t0 = time.monotonic()
    try:
        with open(tmp_path / "step.log", "a") as log, pytest.raises(KeyboardInterrupt):
            prepare.run_command(["sleep", "61.5"], dict(os.environ), log, "a step")
    finally:
        armed[0] = False
        errors._interrupted.clear()                              # this process goes on to other tests
    assert time.monotonic() - t0 < 20                            # not the child's minute
    assert subprocess.run(["pgrep", "-f", "sleep 61.5"], capture_output=True).returncode == 1   # no child left
