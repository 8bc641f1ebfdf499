"""`tool materialise`: every unit of every recipe passes real `systemd-analyze verify` (system
and --user), files land byte for byte with their mode, and writing is all or nothing.

systemd-analyze verify reports a missing executable, so ExecStart= must name real programs:
the venv's own `tool` and `engine`, and a docker client where one is installed.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tool import materialise as mat
from tool import plan as plans, recipes
from tool.cli import main
from tool.errors import NotWritable
from tool.recipes import index

REPO = Path(__file__).resolve().parent.parent
RECIPE_IDS = sorted(index())
BIN = Path(sys.executable).parent
DOCKER = shutil.which("docker") or "/usr/bin/docker"

pytestmark = [
    pytest.mark.skipif(shutil.which("nix-instantiate") is None, reason="Nix is not installed"),
    pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"),
]


def real_bins(tmp_path: Path) -> list[str]:
    """Options pointing ExecStart= at executables that exist here."""
    docker = DOCKER
    if not os.access(docker, os.X_OK):            # no docker client: a stand-in, so verify sees a program
        docker = str(tmp_path / "docker")
        Path(docker).write_text("#!/bin/sh\nexit 0\n")
        os.chmod(docker, 0o755)
    llama = {}
    for name in ("llama-server", "rpc-server"):      # llama.cpp's, where scripts/build-llama-cpp.sh built them
        built = REPO / ".kiln" / "cache" / "llama.cpp" / "bin" / name
        llama[name] = str(built) if os.access(built, os.X_OK) else str(tmp_path / name)
        if not os.access(llama[name], os.X_OK):
            Path(llama[name]).write_text("#!/bin/sh\nexit 0\n")
            os.chmod(llama[name], 0o755)
    return [f"--tool-bin={BIN / 'tool'}", f"--engine-bin={BIN / 'engine'}", f"--docker-bin={docker}",
            f"--llama-server-bin={llama['llama-server']}", f"--rpc-server-bin={llama['rpc-server']}"]


def materialise_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(["materialise", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def verify(unit_dir: Path, user: bool) -> str:
    units = sorted(str(p) for p in unit_dir.glob("*.service"))
    assert units
    env = dict(os.environ)
    cmd = ["systemd-analyze"]
    with tempfile.TemporaryDirectory(prefix="xdg-") as short:
        if user:
            # The user manager needs a runtime dir, and its sockets' paths must fit AF_UNIX's 108 bytes: under
            # pytest-xdist tmp_path is long enough that the host's gpg-agent-browser.socket fails to parse there.
            os.chmod(short, 0o700)
            env["XDG_RUNTIME_DIR"] = short
            cmd.append("--user")
        proc = subprocess.run(cmd + ["verify", "--man=no", *units], capture_output=True, text=True, env=env)
    # verify exits 0 on unknown keys too (it only warns), so any output at all is a failure.
    return f"rc={proc.returncode} {proc.stdout}{proc.stderr}".strip()


@pytest.mark.parametrize("recipe_id", RECIPE_IDS)
@pytest.mark.parametrize("user", [False, True], ids=["system", "user"])
def test_every_unit_passes_systemd_analyze_verify(recipe_id, user, tmp_path, capsys):
    root = tmp_path / "root"
    flags = ["--user"] if user else []
    code, out, err = materialise_cli(capsys, recipe_id, "--root", str(root), "--state-dir", str(tmp_path / "state"),
                                     *flags, *real_bins(tmp_path))
    assert (code, err) == (0, "")
    unit_dir = root / (".config/systemd/user" if user else "etc/systemd/system")
    written = out.splitlines()
    assert sorted(str(p) for p in unit_dir.glob("*.service")) == sorted(w for w in written if w.endswith(".service"))
    assert verify(unit_dir, user) == "rc=0"


FLEET_HOSTS = [(rid, host) for rid in RECIPE_IDS for host, spec in (recipes.load(rid).data.get("fleet") or {}).get(
    "hosts", {}).items() if spec["role"] == "worker"]


@pytest.mark.parametrize("recipe_id, host", FLEET_HOSTS)
@pytest.mark.parametrize("user", [False, True], ids=["system", "user"])
def test_every_fleet_workers_units_pass_systemd_analyze_verify(recipe_id, host, user, tmp_path, capsys):
    """A fleet's worker units (rpc-server; a Ray worker's container), as `tool materialise --host` writes them on
    that host: only its own, and systemd accepts every key (IPAddressAllow=/IPAddressDeny= included)."""
    root = tmp_path / "root"
    flags = ["--user"] if user else []
    code, out, err = materialise_cli(capsys, recipe_id, "--host", host, "--root", str(root),
                                     "--state-dir", str(tmp_path / "state"), *flags, *real_bins(tmp_path))
    assert (code, err) == (0, "")
    unit_dir = root / (".config/systemd/user" if user else "etc/systemd/system")
    names = sorted(p.name for p in unit_dir.glob("*.service"))
    assert names and all(n.startswith(f"kiln-{recipe_id}-{host}") for n in names)
    assert verify(unit_dir, user) == "rc=0"


def test_verify_catches_a_bad_unit(tmp_path):
    """Guards the test above: a key systemd 252 does not know is reported."""
    (tmp_path / "kiln-bad.service").write_text(f"[Service]\nExecStart={BIN / 'tool'}\nRestartSteps=3\n")
    assert "RestartSteps" in verify(tmp_path, False)


def test_files_land_byte_for_byte_with_their_mode(tmp_path, capsys):
    code, out, _ = materialise_cli(capsys, "glm-5.3", "--root", str(tmp_path))
    assert code == 0
    script = tmp_path / "var/lib/kiln/files/glm-5.3/glm-5.3.vllm.320k.4x.yml"
    recipe = recipes.load("glm-5.3")
    assert script.read_bytes() == recipe["files"]["glm-5.3.vllm.320k.4x.yml"]["content"].encode()
    assert stat.S_IMODE(script.stat().st_mode) == 0o555
    assert str(script) in out.splitlines()
    tmpfiles = (tmp_path / "etc/tmpfiles.d/kiln-glm-5.3.conf").read_text()
    assert "d /var/lib/kiln/files/glm-5.3 0755 root root -" in tmpfiles
    assert not list(tmp_path.rglob(".*.tmp")) and not list(tmp_path.rglob(".*.bak"))


def test_a_failed_rename_leaves_the_root_as_it_was(tmp_path, monkeypatch):
    plan = plans.compile_plan(recipes.load("glm-5.3-flash"), {"uid": 960, "gid": 960})
    unit_dir = tmp_path / "etc/systemd/system"
    unit_dir.mkdir(parents=True)
    earlier = unit_dir / "kiln-glm-5.3-flash-fetch.service"     # renamed second: must come back
    earlier.write_text("earlier version\n")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

    real_replace = os.replace
    calls = {"n": 0}

    def failing_third_rename(src, dst):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device", str(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(mat.os, "replace", failing_third_rename)
    with pytest.raises(NotWritable) as e:
        mat.materialise(plan, tmp_path)
    assert "No space left on device" in e.value.message and "nothing was changed" in e.value.message
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before                      # nothing new, earlier file restored, no temps or backups


def test_unwritable_root_is_one_line_exit_5(tmp_path, capsys):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    code, out, err = materialise_cli(capsys, "glm-5.3", "--root", str(not_a_dir / "sub"))
    assert code == 5 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"tool: {not_a_dir / 'sub'}: cannot create")


def test_rematerialise_replaces_units_in_place(tmp_path, capsys):
    assert materialise_cli(capsys, "smollm2-135m", "--root", str(tmp_path), "--port", "8100")[0] == 0
    assert materialise_cli(capsys, "smollm2-135m", "--root", str(tmp_path), "--port", "8200")[0] == 0
    serve = (tmp_path / "etc/systemd/system/kiln-smollm2-135m.service").read_text()
    assert "--port 8200" in serve and "--port 8100" not in serve
    assert not list(tmp_path.rglob(".*.tmp"))
