"""The container checks against a real Docker engine this test starts (tests/fixtures/dockerd.py) and a
real registry on 127.0.0.1 (Debian's docker-registry), so an image can be present *by digest*.

Why a registry: the pin is `repo@sha256:<manifest digest>`, and a daemon only knows an image by that
digest (RepoDigests) when it pushed or pulled it through a registry; `docker import` gives an image ID
and a tag, never a RepoDigest. Matching by image ID or tag would accept an image that is not the pin.
"""
from __future__ import annotations

import copy
import shutil

import pytest

from tests.fixtures import hosts
from tests.fixtures.dockerd import dockerd, import_busybox, registry  # noqa: F401  (pytest fixtures)
from tool import preflight as pf
from tool.preflight import container, memory
from tool.preflight.hostroot import HostRoot
from tool.recipes import load

UNPULLED = "ghcr.io/sybil-solutions/glm53-flash-offload@sha256:" + "0" * 64


def recipe(image: str) -> dict:
    r = copy.deepcopy(load("glm-5.3-flash", validate=False).data)
    r["runtime"]["container"]["image"] = image
    return r


def by_id(results):
    return {c.id: c for c in results}


@pytest.fixture
def daemon(dockerd, monkeypatch):  # noqa: F811
    client, sock = dockerd
    monkeypatch.setenv("DOCKER_HOST", f"unix://{sock}")   # the checks find the daemon the way users point at one
    return client, sock


def test_daemon_without_images(daemon):
    client, sock = daemon
    for img in client.images.list():
        client.images.remove(img.id, force=True)
    d = container.connect()
    try:
        assert d.reachable
        checks, memlock = container.check(recipe(UNPULLED), d, HostRoot())
    finally:
        container.close(d)
    got = by_id(checks)
    assert got["docker.daemon"].status == "pass"
    assert got["docker.daemon"].detail.startswith(f"Docker {client.version()['Version']} answers on unix://{sock}")
    assert (got["docker.image"].status, got["docker.image"].detail) == ("warn", f"{UNPULLED}: not yet pulled (tool up pulls it by digest)")
    assert memlock.status == "warn" and memlock.detail.startswith("--ulimit memlock=-1:-1 not probed (no local image to start a probe container)")
    # This daemon has only runc: --gpus cannot work, and there is no CDI spec on this machine either.
    assert got["gpu.container-access"].status == "fail"
    assert "no nvidia runtime in docker info Runtimes (io.containerd.runc.v2, io.containerd.runtime.v1.linux, runc)" in got["gpu.container-access"].detail


def test_image_present_by_digest(daemon, registry):
    client, _ = daemon
    repo = f"{registry}/kiln/probe"
    import_busybox(client, repo, "v1")
    client.images.push(repo, tag="v1")
    digest = next(d for d in client.images.get(f"{repo}:v1").attrs["RepoDigests"] if d.startswith(repo)).split("@")[1]
    pinned = f"{repo}@{digest}"

    d = container.connect()
    try:
        checks, memlock = container.check(recipe(pinned), d, HostRoot())
        other = by_id(container.check(recipe(f"{repo}@sha256:{'1' * 64}"), d, HostRoot())[0])
    finally:
        container.close(d)
    got = by_id(checks)
    assert got["docker.image"].status == "pass"
    assert got["docker.image"].detail.startswith(f"{repo}@{digest[:19]}… present locally by digest")
    assert other["docker.image"].status == "warn" and "not yet pulled" in other["docker.image"].detail
    # memlock, probed with the pinned image: the daemon refuses exactly when a root process here cannot raise it.
    refused = memory.can_raise_memlock() is not None
    if refused:
        assert memlock.status == "fail"
        assert memlock.detail == ("the daemon refuses --ulimit memlock=-1:-1: error setting rlimit type 8: operation not permitted "
                                  "(the pinned RAM tier cannot be registered)")
    else:
        assert memlock.status == "pass"
    assert not client.containers.list(all=True, filters={"label": "kiln.preflight"})   # the probe container is gone


def test_a_tag_is_not_the_pin(daemon):
    client, _ = daemon
    import_busybox(client, "ghcr.io/sybil-solutions/glm53-flash-offload", "v4.6-nvme")
    r = load("glm-5.3-flash", validate=False).data
    d = container.connect()
    try:
        image, present = container.check_image(r["runtime"]["container"]["image"], d)
    finally:
        container.close(d)
    assert (image.status, present) == ("warn", False) and "not yet pulled" in image.detail


def test_cdi_spec_gives_gpu_access(daemon, tmp_path):
    root = hosts.epyc_3090(tmp_path / "host")
    d = container.connect()
    try:
        c = container.check_gpu_access(d, HostRoot(root))
    finally:
        container.close(d)
    assert (c.status, c.detail) == ("pass", "CDI spec /etc/cdi/nvidia.yaml names nvidia.com/gpu")


def test_whole_preflight_with_the_daemon(daemon, tmp_path):
    got = by_id(pf.run(recipe(UNPULLED), pf.Host(models_dir=tmp_path / "m", store_dir=tmp_path / "s")))
    assert got["docker.daemon"].status == "pass"
    assert got["docker.image"].status == "warn"
    assert got["mem.memlock"].status in {"pass", "fail"}     # probed for real with a local image this time


def test_unreachable_daemon_warns_when_docker_is_installed(monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/none.sock")
    d = container.connect()
    c = container.check_daemon(d)
    assert c.status == ("warn" if shutil.which("dockerd") or shutil.which("docker") else "fail")
    assert c.detail.startswith(f"no Docker daemon answers on unix://{tmp_path}/none.sock (no socket at {tmp_path}/none.sock)")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert container.check_daemon(d).status == "fail"
