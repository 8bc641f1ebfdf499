"""Preflight: every requirement of a recipe checked on this host, before anything is downloaded.

`run(recipe, host)` → CheckResults in topic order (cpu, mem, disk, gpu, docker, net, weights);
`fits(recipe, host, gpus)` → the fast subset `tool list` uses (no writes, no Docker).
Each topic module reads the host through host.root (tool.preflight.hostroot), so tests point
the same code at constructed /proc and /sys trees.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tool.preflight import container, cpu, gpu, memory, network, storage, weights
from tool.preflight.checks import FAIL, CheckResult, verdict
from tool.preflight.hostroot import HostRoot
from tool.state import DEFAULT_STATE_DIR, Dirs

__all__ = ["Host", "run", "fits", "verdict", "CheckResult"]


@dataclass
class Host:
    """What to probe: the tree to read, the dirs the recipe will use, where to find GPUs."""
    root: HostRoot = field(default_factory=HostRoot)
    models_dir: Path = DEFAULT_STATE_DIR / "models"
    store_dir: Path = DEFAULT_STATE_DIR / "stores"
    use_nvml: bool = True
    _gpus: gpu.GpuReport | None = None

    def gpus(self) -> gpu.GpuReport:
        if self._gpus is None:     # probed once per Host: tool list asks for every recipe
            self._gpus = gpu.probe(self.use_nvml)
        return self._gpus


def data_of(recipe) -> dict:
    return recipe.data if hasattr(recipe, "data") else recipe


def run(recipe, host: Host | None = None, serves_api: bool = True, reads_weights: bool = True) -> list[CheckResult]:
    """serves_api / reads_weights False: a fleet worker, which publishes no API port (its fleet port is
    tool.preflight.fleet's) and, running rpc-server, keeps no weights on its disk."""
    r, host = data_of(recipe), host or Host()
    out = cpu.check(r, host.root)
    memlock = None
    docker_checks: list[CheckResult] = []
    if r["runtime"]["kind"] == "container":
        d = container.connect()
        try:
            docker_checks, memlock = container.check(r, d, host.root)
        finally:
            container.close(d)
    out += memory.check(r, host.root, memlock)
    if reads_weights:
        out += storage.check(r, host.models_dir, host.store_dir, host.root)
    gpu_checks = gpu.check(r, host.gpus())
    access = [c for c in docker_checks if c.id.startswith("gpu.")]
    out += gpu_checks + access
    out += [c for c in docker_checks if not c.id.startswith("gpu.")]
    if serves_api:
        out += network.check(r)
    if reads_weights:
        out += weights.check(r, host.models_dir)
    return out


def fits(recipe, host: Host | None = None) -> list[CheckResult]:
    """The checks that decide whether the recipe fits this machine at all (GPU, VRAM, RAM, CPUs, disk)."""
    r, host = data_of(recipe), host or Host()
    c = r["hardware"].get("cpu", {})
    out = [cpu.check_features(c, host.root), cpu.check_count(c, c.get("layout"), host.root)]
    out.append(memory.check_total(r, host.root.meminfo()))
    out += gpu.check(r, host.gpus(), fast=True)
    out += storage.check(r, host.models_dir, host.store_dir, host.root, probes=False)
    return out


def failures(results: list[CheckResult]) -> list[CheckResult]:
    return [c for c in results if c.status == FAIL]


def host_from_env(models_dir=None, store_dir=None, root=None) -> Host:
    return Host(
        root=HostRoot(Path(root)) if root else HostRoot(),
        # The same resolution as every other command: flags, KILN_*_DIR, KILN_STATE_DIR, /var/lib/kiln.
        models_dir=Dirs.resolve(models_dir=models_dir).models,
        store_dir=Dirs.resolve(store_dir=store_dir).stores,
    )
