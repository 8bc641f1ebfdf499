"""Container runtime: the Docker daemon (DOCKER_HOST respected), the pinned image, GPU access, memlock.

memlock is probed, not assumed: a throwaway container is created with the recipe's
`--ulimit memlock=…` and an entrypoint that does not exist. runc sets rlimits before it execs, so
"error setting rlimit" means the daemon refuses the ulimit, and "no such file" means it accepted it.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field

from tool.images import present_by_digest, short
from tool.preflight.checks import CheckResult, failed, passed, warned
from tool.preflight.hostroot import HostRoot

DEFAULT_SOCKET = "/var/run/docker.sock"
PROBE_ENTRYPOINT = "/kiln-preflight-memlock-probe"


@dataclass
class Docker:
    host: str
    client: object | None = None
    version: str | None = None
    info: dict = field(default_factory=dict)
    error: str | None = None

    @property
    def reachable(self) -> bool:
        return self.client is not None


def connect(timeout: float = 5) -> Docker:
    """The daemon named by DOCKER_HOST (else the default socket), pinged; never raises."""
    host = os.environ.get("DOCKER_HOST") or f"unix://{DEFAULT_SOCKET}"
    if host.startswith("unix://") and not os.path.exists(host[len("unix://"):]):
        return Docker(host, error=f"no socket at {host[len('unix://'):]}")  # skip importing the SDK for nothing
    try:
        import docker

        client = docker.DockerClient(base_url=host, timeout=timeout)
        version = client.version().get("Version")
        info = client.info()
    except Exception as e:
        return Docker(host, error=str(e).splitlines()[0][:200])
    return Docker(host, client, version, info)


def close(d: Docker) -> None:
    if d.client is not None:
        d.client.close()


def check(recipe: dict, d: Docker, root: HostRoot) -> tuple[list[CheckResult], CheckResult]:
    """(docker.* and gpu.container-access checks, the mem.memlock check for the container)."""
    image = recipe["runtime"]["container"]["image"]
    image_check, present = check_image(image, d)
    out = [check_daemon(d), image_check]
    if int(recipe["hardware"].get("gpu_count", 0)) > 0:
        out.append(check_gpu_access(d, root))
    return out, check_memlock(recipe, d, root, image if present else None)


def check_daemon(d: Docker) -> CheckResult:
    if d.reachable:
        cg = d.info.get("CgroupVersion")
        return passed("docker.daemon", f"Docker {d.version} answers on {d.host}" + (f" (cgroup v{cg}, {d.info.get('CgroupDriver')} driver)" if cg else ""))
    installed = shutil.which("dockerd") or shutil.which("docker")
    if installed:
        # The recipe's units order themselves after docker.service, so a stopped daemon is started with them.
        return warned("docker.daemon", f"no Docker daemon answers on {d.host} ({d.error}); docker is installed ({installed}): start it (systemctl start docker)")
    return failed("docker.daemon", f"no Docker daemon on {d.host} ({d.error}) and no docker installed; the recipe runs in a container")


def check_image(image: str, d: Docker) -> tuple[CheckResult, bool]:
    """Present only by digest (tool.images), asked through the Docker SDK."""
    if not d.reachable:
        return warned("docker.image", f"{image}: not checked (no Docker daemon)"), False
    import docker

    try:
        img = d.client.images.get(image)
    except docker.errors.ImageNotFound:
        return warned("docker.image", f"{image}: not yet pulled (tool up pulls it by digest)"), False
    except docker.errors.APIError as e:
        return warned("docker.image", f"{image}: the daemon could not say ({e.explanation or e})"), False
    if present_by_digest(img.attrs.get("RepoDigests"), image):
        return passed("docker.image", f"{short(image)} present locally by digest (image {img.id[:19]})"), True
    return warned("docker.image", f"{image}: a local image answers to it but carries no matching RepoDigest; tool up pulls it by digest"), False


def cdi_specs(root: HostRoot) -> list[str]:
    """CDI spec files that name NVIDIA GPUs (nvidia-ctk cdi generate writes /etc/cdi/nvidia.yaml)."""
    found = []
    for d in ("/etc/cdi", "/var/run/cdi"):
        try:
            names = sorted(os.listdir(root.path(d)))
        except OSError:
            continue
        for n in names:
            text = root.read(f"{d}/{n}") or ""
            if "nvidia.com/gpu" in text:
                found.append(f"{d}/{n}")
    return found


def daemon_json(root: HostRoot) -> dict:
    try:
        return json.loads(root.read("/etc/docker/daemon.json") or "{}")
    except ValueError:
        return {}


def check_gpu_access(d: Docker, root: HostRoot) -> CheckResult:
    runtimes = set((d.info.get("Runtimes") or {}).keys()) if d.reachable else set(daemon_json(root).get("runtimes", {}))
    where = "docker info Runtimes" if d.reachable else "/etc/docker/daemon.json runtimes"
    if "nvidia" in runtimes:
        return passed("gpu.container-access", f"the nvidia runtime is in {where}: --gpus works")
    specs = cdi_specs(root)
    if specs:
        return passed("gpu.container-access", f"CDI spec {', '.join(specs)} names nvidia.com/gpu")
    have = ", ".join(sorted(runtimes)) or "none"
    return failed("gpu.container-access", f"no nvidia runtime in {where} ({have}) and no CDI spec in /etc/cdi or /var/run/cdi: --gpus would fail (install nvidia-container-toolkit)")


def check_memlock(recipe: dict, d: Docker, root: HostRoot, pinned: str | None) -> CheckResult:
    want = recipe["runtime"]["container"].get("ulimits", {}).get("memlock")
    if not want:
        return passed("mem.memlock", "the recipe asks no memlock ulimit")
    flag = f"--ulimit memlock={want}"
    defaults = daemon_json(root).get("default-ulimits", {}).get("memlock")
    default_text = f"daemon default-ulimits memlock {defaults.get('Soft')}:{defaults.get('Hard')}" if defaults else "no memlock in the daemon's default-ulimits"
    if not d.reachable:
        return warned("mem.memlock", f"{flag} not probed (no Docker daemon); {default_text}")
    image = pinned or next((t for img in d.client.images.list() for t in img.tags[:1]), None)
    if image is None:
        return warned("mem.memlock", f"{flag} not probed (no local image to start a probe container); {default_text}")
    verdict, reason = probe_ulimit(d.client, image, want)
    if verdict is True:
        return passed("mem.memlock", f"the daemon accepts {flag} (probed with a throwaway container)")
    if verdict is False:
        return failed("mem.memlock", f"the daemon refuses {flag}: {reason} (the pinned RAM tier cannot be registered)")
    return warned("mem.memlock", f"{flag} not probed: {reason}")


def probe_ulimit(client, image: str, want: str) -> tuple[bool | None, str]:
    import docker
    from docker.types import Ulimit

    soft, _, hard = want.partition(":")
    ulimit = Ulimit(name="memlock", soft=int(soft), hard=int(hard or soft))
    try:
        c = client.containers.create(image, entrypoint=[PROBE_ENTRYPOINT], network_mode="none",
                                     ulimits=[ulimit], labels={"kiln.preflight": "memlock-probe"})
    except docker.errors.APIError as e:
        return None, f"could not create a probe container ({e.explanation or e})"
    try:
        c.start()
        return True, "started"
    except docker.errors.APIError as e:
        msg = str(e.explanation or e)
        if "rlimit" in msg:  # runc: "... error setting rlimit type 8: operation not permitted: unknown"
            return False, msg[msg.rfind("error setting rlimit"):].removesuffix(": unknown")
        if "no such file" in msg or "not found" in msg:
            return True, "accepted"
        return None, msg[:200]
    finally:
        try:
            c.remove(force=True)
        except docker.errors.APIError:
            pass
