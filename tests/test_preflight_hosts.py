"""tool.preflight on constructed /proc and /sys trees (tests/fixtures/hosts): hosts this machine is not.

What a tree cannot hold is still real here: statvfs and the O_DIRECT probe run on real temp dirs,
the port bind on this machine's loopback. The GPU is a test double (a scripted nvidia-smi in the
tree's bin/), since no GPU can exist here.
"""
from __future__ import annotations

import copy
import json
import socket

import pytest
from click.testing import CliRunner

from tests.fixtures import hosts
from tool import preflight as pf
from tool.cli import cli
from tool.preflight import cpu, gpu
from tool.cpulist import format_cpulist, parse_cpulist
from tool.preflight.hostroot import HostRoot
from tool.recipes import load


def recipe(rid: str) -> dict:
    return copy.deepcopy(load(rid, validate=False).data)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def small(r: dict) -> dict:
    """The same recipe with sizes that fit a temp dir here and a port nobody holds: what a tree cannot fake."""
    r["weights"]["size_bytes"] = 10**6
    if r.get("store"):
        r["store"]["size_bytes"] = 10**6
    r["serve"]["port"] = free_port()
    return r


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """Build a host tree; its bin/ (the nvidia-smi double, if any) goes first on PATH; no Docker daemon."""
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-docker.sock")
    monkeypatch.delenv("HF_TOKEN", raising=False)

    def make(builder, **kw) -> pf.Host:
        root = builder(tmp_path / "host", **kw)
        monkeypatch.setenv("PATH", f"{root / 'bin'}:/usr/bin:/bin:/usr/sbin:/sbin")
        return pf.Host(root=HostRoot(root), models_dir=tmp_path / "models", store_dir=tmp_path / "stores", use_nvml=False)
    return make


def by_id(results):
    return {c.id: c for c in results}


def not_passing(results):
    return {c.id: c.status for c in results if c.status != "pass"}


def test_epyc_3090_is_go_for_glm_flash_apart_from_what_a_tree_cannot_hold(tree):
    host = tree(hosts.epyc_3090)
    results = pf.run(recipe("glm-5.3-flash"), host)
    got = by_id(results)
    # Not constructible: the real disk here (~80 GB) is smaller than 242.6 GB; no Docker daemon; nothing fetched.
    assert not_passing(results) == {"disk.models.free": "fail", "disk.store.free": "fail", "mem.memlock": "warn",
                                    "docker.daemon": "warn", "docker.image": "warn", "weights.present": "warn"}
    assert "242.6 GB needed (models 125.3 GB + store 117.3 GB)" in got["disk.store.free"].detail
    assert got["cpu.layout"].detail == "this cpuset (0-39) holds the recipe's layout (lane 2-23, main 24, controller 25, readers 26-39)"
    assert got["disk.store.device"].detail.startswith("store on md0 (over nvme0n1 nvme1n1 nvme2n1 nvme3n1, NVMe)")
    assert got["disk.store.fstype"].detail.startswith("store on xfs on /")
    assert got["gpu.count"].detail == "1 × RTX 3090 needed; 1 via nvidia-smi: GPU 0 NVIDIA GeForce RTX 3090 (24.0 GiB, 23.6 GiB free)"
    assert got["gpu.driver"].detail == "NVIDIA driver ≥ 610.57 needed; this host has 610.57"
    assert got["gpu.container-access"].detail == "CDI spec /etc/cdi/nvidia.yaml names nvidia.com/gpu"
    assert got["mem.cgroup"].detail == "cgroup v2 with the memory controller: the 55.0 GiB cap (docker --memory) will be enforced"
    # With sizes that fit this disk, the EPYC host is a go.
    assert pf.verdict(pf.run(small(recipe("glm-5.3-flash")), host)) == "go"


def test_laptop_is_no_go_naming_gpu_cpus_and_ram(tree):
    results = pf.run(small(recipe("glm-5.3-flash")), tree(hosts.laptop))
    fails = {c.id for c in results if c.status == "fail"}
    assert fails == {"cpu.count", "mem.total", "mem.available", "gpu.count", "gpu.vram", "gpu.driver", "gpu.compute",
                     "gpu.container-access"}
    got = by_id(results)
    assert got["cpu.count"].detail == ("40 logical CPUs needed (CPU layout lane 2-23, main 24, controller 25, readers 26-39); "
                                       "this cpuset has 8 (0-7)")
    assert got["mem.total"].detail == "60.0 GiB of RAM needed; MemTotal is 16.0 GiB"
    assert got["gpu.count"].detail == "1 × RTX 3090 needed; found none (nvidia-smi: not on PATH)"
    assert got["cpu.layout"].status == "warn"
    assert "derived: lane 0-2, main 3, controller 4, readers 5-7" in got["cpu.layout"].detail
    assert got["disk.store.device"].detail.startswith("store on nvme0n1 (NVMe)")   # the partition's disk


def test_laptop_runs_the_cpu_default(tree):
    results = pf.run(small(recipe("smollm2-135m")), tree(hosts.laptop))
    assert pf.verdict(results) == "go"
    assert by_id(results)["mem.memlock"].status == "warn"     # 8 MiB hard limit; the CPU engine pins nothing


def test_swap_on_warns(tree):
    got = by_id(pf.run(small(recipe("glm-5.3-flash")), tree(hosts.epyc_3090, swap=True)))
    assert got["mem.swap"].status == "warn"
    assert got["mem.swap"].detail == ("swap is on (8.0 GiB on /dev/nvme0n1p3); the recipe turns it off inside its cap "
                                      "(--memory-swap = --memory)")


def test_old_cpu_on_cgroup_v1(tree):
    host = tree(hosts.old_cpu_v1)
    got = by_id(pf.run(small(recipe("glm-5.3-flash")), host))
    assert got["cpu.features"].status == "fail"
    assert got["cpu.features"].detail == "CPU features avx2 fma f16c needed; /proc/cpuinfo lacks avx2 fma f16c"
    assert got["mem.cgroup"].status == "warn" and "docker enforces the 55.0 GiB cap" in got["mem.cgroup"].detail
    assert got["disk.store.device"].status == "warn" and "sda (not NVMe, rotational)" in got["disk.store.device"].detail
    native = by_id(pf.run(small(recipe("smollm2-135m")), host))
    assert native["mem.cgroup"].status == "warn"
    assert "the 6.0 GiB cap (systemd MemoryMax=) needs the unified hierarchy" in native["mem.cgroup"].detail


def test_cgroup_v2_without_memory_controller_warns(tree):
    host = tree(hosts.epyc_3090)
    (host.root.root / "sys/fs/cgroup/cgroup.controllers").write_text("cpuset cpu io pids\n")
    c = by_id(pf.run(small(recipe("glm-5.3-flash")), host))["mem.cgroup"]
    assert (c.status, c.detail) == ("warn", "cgroup v2 without the memory controller (cgroup.controllers: cpuset cpu io pids): "
                                    "the 55.0 GiB cap (docker --memory) will not be enforced")


def test_cpu_quota_counts_against_the_cpuset(tree):
    host = tree(hosts.epyc_3090)
    (host.root.root / "sys/fs/cgroup/cpu.max").write_text("800000 100000\n")
    c = by_id(pf.run(small(recipe("glm-5.3-flash")), host))["cpu.count"]
    assert c.status == "fail" and c.detail.endswith("this cpuset has 40 (0-39), and its cgroup's cpu.max allows 8 CPUs of time")


def test_gpu_double_too_small_too_old_too_early(tree):
    host = tree(hosts.epyc_3090)
    hosts.nvidia_smi(host.root.root, "0, NVIDIA GeForce RTX 2080 Ti, 11264, 11000, 535.104.05, 7.5\n")
    got = by_id(pf.run(small(recipe("glm-5.3-flash")), host))
    assert got["gpu.count"].status == "pass"
    assert got["gpu.vram"].detail == "23.0 GiB VRAM per GPU needed on 1 GPU(s); GPU 0 has 11.0 GiB"
    assert got["gpu.driver"].detail == "NVIDIA driver ≥ 610.57 needed; this host has 535.104.05"
    assert got["gpu.compute"].detail == "compute capability ≥ 8.6 needed; GPU 0 7.5"
    assert {got[i].status for i in ("gpu.vram", "gpu.driver", "gpu.compute")} == {"fail"}


def test_gpu_busy_warns_and_unreported_compute_warns():
    report = gpu.parse_smi("0, NVIDIA GeForce RTX 3090, 24576, 4000, 615.10, [N/A]\n")
    got = by_id(gpu.check(recipe("glm-5.3-flash"), report))
    assert got["gpu.vram"].status == "warn" and "GPU 0 has 3.9 GiB free" in got["gpu.vram"].detail
    assert got["gpu.compute"].status == "warn"
    assert got["gpu.driver"].status == "pass"


def test_driver_versions_compare_numerically():
    assert gpu.version_tuple("1000.1") > gpu.version_tuple("999.99")
    assert gpu.version_tuple("610.57") >= gpu.version_tuple("610.57")
    assert gpu.version_tuple("580.65.06") < gpu.version_tuple("610.57")
    four = recipe("glm-5.3")
    report = gpu.parse_smi("".join(f"{i}, NVIDIA RTX PRO 6000 Blackwell, 97887, 97000, 580.9, 12.0\n" for i in range(4)))
    assert by_id(gpu.check(four, report))["gpu.driver"].status == "fail"   # 580.9 < 580.65.06 as numbers, not strings


def test_cpulist_round_trip():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert format_cpulist({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"


def test_layout_derivation_reproduces_the_measured_layout_and_scales():
    layout = recipe("glm-5.3-flash")["hardware"]["cpu"]["layout"]
    assert cpu.derive_layout(set(range(40)), layout) == layout
    assert cpu.derive_layout(set(range(32)), layout) == {"lane": "1-17", "main": "18", "controller": "19", "readers": "20-31"}
    assert cpu.derive_layout(set(range(4)), layout) == {"lane": "0", "main": "1", "controller": "2", "readers": "3"}
    assert cpu.derive_layout({0, 1}, layout) is None
    # The derived layout uses the set's own CPUs, even when they are not contiguous.
    derived = cpu.derive_layout(set(range(8, 24)) | {40, 41}, layout)
    assert set().union(*(parse_cpulist(v) for v in derived.values())) <= set(range(8, 24)) | {40, 41}


def test_cli_json_on_a_tree_is_go_and_exits_0(tree, tmp_path):
    host = tree(hosts.epyc_3090)
    f = tmp_path / "flash.json"
    f.write_text(json.dumps(small(recipe("glm-5.3-flash"))))
    res = CliRunner().invoke(cli, ["preflight", str(f), "--json", "--host-root", str(host.root.root),
                                   "--models-dir", str(host.models_dir), "--store-dir", str(host.store_dir)])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert list(out) == ["recipe", "verdict", "checks"]
    assert (out["recipe"], out["verdict"]) == ("glm-5.3-flash", "go")
    assert all(list(c) == ["id", "status", "detail"] for c in out["checks"])


def test_cli_human_on_laptop_is_no_go_fails_first(tree, tmp_path):
    host = tree(hosts.laptop)
    f = tmp_path / "flash.json"
    f.write_text(json.dumps(small(recipe("glm-5.3-flash"))))
    res = CliRunner().invoke(cli, ["preflight", str(f), "--host-root", str(host.root.root),
                                   "--models-dir", str(host.models_dir), "--store-dir", str(host.store_dir)])
    assert res.exit_code == 1
    lines = [ln.rstrip() for ln in res.output.splitlines()]
    statuses = [ln.split()[0] for ln in lines[2:-1]]
    assert statuses == sorted(statuses, key=["fail", "warn", "pass"].index)
    assert lines[-1].startswith("no-go: glm-5.3-flash — 8 fail, ")
    assert lines[-1].endswith("; fix what fails above")


def test_list_on_laptop(tree):
    host = tree(hosts.laptop)
    res = CliRunner().invoke(cli, ["list", "--json", "--host-root", str(host.root.root),
                                   "--models-dir", str(host.models_dir), "--store-dir", str(host.store_dir)])
    assert res.exit_code == 0, res.output
    rows = {r["id"]: r for r in json.loads(res.output)}
    assert rows["smollm2-135m"]["fits"] is True
    flash = rows["glm-5.3-flash"]
    assert flash["fits"] is False
    assert {f["id"] for f in flash["why_not"]} == {"cpu.count", "mem.total", "gpu.count", "gpu.vram", "disk.models.free", "disk.store.free"}
    assert flash["proof"] == {"date": "2026-10-09", "gates": ["load", "chat", "reasoning", "tools", "context", "speed"],
                              "gates_passed": ["load", "chat", "reasoning", "tools", "context", "speed"], "decode_tps": 20.0}
    fits = CliRunner().invoke(cli, ["list", "--fits", "--json", "--host-root", str(host.root.root),
                                    "--models-dir", str(host.models_dir), "--store-dir", str(host.store_dir)])
    assert [r["id"] for r in json.loads(fits.output)] == [i for i, r in sorted(rows.items()) if r["fits"]]
    human = CliRunner().invoke(cli, ["list", "--host-root", str(host.root.root), "--models-dir", str(host.models_dir),
                                     "--store-dir", str(host.store_dir)])
    flash_line = next(ln for ln in human.output.splitlines() if ln.startswith("glm-5.3-flash "))
    assert "6/6 gates · 20 tok/s" in flash_line and flash_line.rstrip().endswith("no: CPUs, RAM, GPUs, VRAM, disk")


def test_daemon_json_nvidia_runtime_counts_when_the_daemon_is_down(tree):
    from tool.preflight import container

    host = tree(hosts.laptop)
    d = container.connect()
    assert container.check_gpu_access(d, host.root).status == "fail"
    (host.root.root / "etc/docker").mkdir(parents=True)
    (host.root.root / "etc/docker/daemon.json").write_text('{"runtimes": {"nvidia": {"path": "nvidia-container-runtime"}}}')
    c = container.check_gpu_access(d, host.root)
    assert (c.status, c.detail) == ("pass", "the nvidia runtime is in /etc/docker/daemon.json runtimes: --gpus works")


def test_unknown_weights_size_warns(tree):
    got = by_id(pf.run(recipe("glm-5.3"), tree(hosts.epyc_3090)))
    assert got["disk.models.free"].status == "warn"
    assert "the models size is not known until tool fetch reads it" in got["disk.models.free"].detail
    assert "disk.store.free" not in got          # no prepared store in a vLLM recipe
    assert {got[i].status for i in ("gpu.count", "gpu.vram", "gpu.compute")} == {"fail"}  # 1 × 3090 is not 4 × 96 GB
    assert got["gpu.driver"].status == "pass"                 # 610.57 ≥ 580.65.06
