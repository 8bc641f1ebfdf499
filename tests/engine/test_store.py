"""The packed expert store on real files: O_DIRECT pack, verify, corruption, interruption, refusal."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from engine.checkpoint import Checkpoint
from engine.cli import main
from engine.errors import EngineError
from engine.store import manifest as mf
from engine.store.pack import pack_store
from engine.store.verify import verify_store


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen3_moe")


@pytest.fixture()
def store(ckpt, tmp_path) -> Path:
    s = tmp_path / "store"
    pack_store(ckpt, s)
    return s


def run(argv, capsys) -> tuple[int, str, str]:
    capsys.readouterr()                      # drop what fixtures printed (transformers' save progress)
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


def test_pack_writes_aligned_records_equal_to_the_layout(ckpt, tmp_path, capsys):
    s = tmp_path / "store"
    rc, out, err = run(["pack-store", "--model", str(ckpt), "--store", str(s)], capsys)
    assert rc == 0, err
    assert out.startswith("packed 24 records") and "GB/s" in out
    assert sorted(os.listdir(s)) == ["experts.bin", "manifest.json"]
    ck = Checkpoint(ckpt)
    m = mf.load(s)
    layout = ck.layout()
    assert (m.config_hash, m.arch, m.moe_layers, m.experts_per_layer) == (ck.config_hash(), "qwen3_moe", [0, 1, 2], 8)
    assert m.record_bytes == layout.record_bytes and m.record_bytes % 4096 == 0
    assert m.total_bytes == (s / "experts.bin").stat().st_size == 24 * m.record_bytes
    data = (s / "experts.bin").read_bytes()
    for r in m.records:
        assert r.offset % 4096 == 0
        want = layout.pack(*ck.expert(r.layer, r.expert)).view(torch.uint8).numpy().tobytes()
        assert data[r.offset:r.offset + m.record_bytes] == want, (r.layer, r.expert)
    assert leftovers(tmp_path) == []


def test_pack_converts_dtype(ckpt, tmp_path, capsys):
    s = tmp_path / "bf16"
    rc, out, err = run(["pack-store", "-q", "--json", "--model", str(ckpt), "--store", str(s), "--dtype", "bfloat16"], capsys)
    assert rc == 0, err
    assert json.loads(out)["records"] == 24
    m = mf.load(s)
    ck = Checkpoint(ckpt)
    layout = ck.layout(torch.bfloat16)
    assert m.dtype == "bfloat16" and m.record_bytes == layout.record_bytes
    data = (s / "experts.bin").read_bytes()
    for r in m.records:
        want = layout.pack(*ck.expert(r.layer, r.expert)).view(torch.uint8).numpy().tobytes()
        assert data[r.offset:r.offset + m.record_bytes] == want, (r.layer, r.expert)


def test_pack_cols_order_for_cpu_serving(ckpt, tmp_path, capsys):
    """--order cols: every matrix transposed (the CPU's fast GEMV orientation), recorded in the manifest,
    verified like any store; the GPU refuses it by name before touching a device."""
    from engine.tiers import build_provider
    s = tmp_path / "cols"
    rc, out, err = run(["pack-store", "-q", "--model", str(ckpt), "--store", str(s), "--order", "cols"], capsys)
    assert rc == 0, err
    m, ck = mf.load(s), Checkpoint(ckpt)
    assert m.order == "cols" and json.loads((s / "manifest.json").read_text())["order"] == "cols"
    layout = ck.layout(order="cols")
    data = (s / "experts.bin").read_bytes()
    rows = (tmp_path / "rows")
    pack_store(ckpt, rows)
    assert mf.load(rows).order == "rows" and (rows / "experts.bin").read_bytes() != data
    for r in m.records:
        want = layout.pack(*ck.expert(r.layer, r.expert)).view(torch.uint8).numpy().tobytes()
        assert data[r.offset:r.offset + m.record_bytes] == want, (r.layer, r.expert)
        gate, up, down = ck.expert(r.layer, r.expert)
        rec = torch.frombuffer(bytearray(data[r.offset:r.offset + m.record_bytes]), dtype=layout.dtype)
        assert torch.equal(rec[:gate.numel() * 2].view(ck.hidden, -1), torch.cat([gate.t(), up.t()], dim=1))
    rc, out, err = run(["verify-store", "-q", "--store", str(s)], capsys)
    assert rc == 0 and "24 ok, 0 bad" in out, err
    assert build_provider(ck, s, ram_slots=4, readers=1).layout.order == "cols"     # the CPU reads either order
    with pytest.raises(EngineError, match=r"holds cols-order records, the GPU kernels read rows \(repack with "
                                          r"`engine pack-store --order rows`\)") as e:
        build_provider(ck, s, device="cuda")
    assert e.value.exit_code == 3


def test_a_manifest_from_before_orders_reads_as_rows(store):
    raw = json.loads((store / "manifest.json").read_text())
    del raw["order"]
    (store / "manifest.json").write_text(json.dumps(raw))
    assert mf.load(store).order == "rows"
    raw["order"] = "diagonal"
    (store / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(EngineError, match="garbled .*order 'diagonal'"):
        mf.load(store)


def test_verify_ok(store, capsys):
    rc, out, err = run(["verify-store", "-q", "--store", str(store)], capsys)
    assert rc == 0, err
    assert "24 ok, 0 bad" in out and "GB/s" in out


def test_verify_names_the_corrupted_record_and_exits_8(store, capsys):
    m = mf.load(store)
    victim = m.records[13]
    with open(store / "experts.bin", "r+b") as f:
        f.seek(victim.offset + 100)
        b = f.read(1)
        f.seek(victim.offset + 100)
        f.write(bytes([b[0] ^ 0x01]))
    rc, out, err = run(["verify-store", "-q", "--store", str(store)], capsys)
    assert rc == 8
    named = f"layer {victim.layer} expert {victim.expert} offset {victim.offset}"
    assert f"bad record: {named}" in err
    assert "23 ok, 1 bad" in out
    assert err.strip().splitlines()[-1].startswith(f"engine: {store}: 1 record(s) fail their sha256")


def test_wrong_size_missing_and_garbled_manifest(store, capsys):
    with open(store / "experts.bin", "ab") as f:
        f.write(b"\0" * 4096)
    rc, _, err = run(["verify-store", "--store", str(store)], capsys)
    assert (rc, err.count("\n")) == (8, 1) and "bytes, the manifest says" in err

    (store / "manifest.json").write_text('{"format_version": 1, "records": [')
    rc, _, err = run(["verify-store", "--store", str(store)], capsys)
    assert (rc, err.count("\n")) == (8, 1) and "manifest.json: garbled" in err

    (store / "manifest.json").unlink()
    rc, _, err = run(["verify-store", "--store", str(store)], capsys)
    assert (rc, err.count("\n")) == (3, 1) and "missing (not a Kiln expert store" in err


def test_verify_against_another_checkpoint_exits_3(store, tiny_checkpoint, capsys):
    other = tiny_checkpoint("qwen3_moe", layers=2)
    rc, _, err = run(["verify-store", "--store", str(store), "--model", str(other)], capsys)
    assert (rc, err.count("\n")) == (3, 1) and "packed from another checkpoint" in err


def test_pack_refuses_to_replace_a_non_store_directory(ckpt, tmp_path, capsys):
    d = tmp_path / "precious"
    d.mkdir()
    (d / "thesis.txt").write_text("keep me")
    rc, _, err = run(["pack-store", "--model", str(ckpt), "--store", str(d)], capsys)
    assert rc == 6 and "is not a Kiln expert store; refusing to replace it" in err
    assert (d / "thesis.txt").read_text() == "keep me"


@pytest.mark.parametrize("phase", ["write", "verify"])
def test_interrupted_pack_keeps_the_old_store(ckpt, store, phase):
    before = snapshot(store)

    def interrupt(p, n):
        if p == phase:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        pack_store(ckpt, store, progress=interrupt)
    assert snapshot(store) == before
    assert verify_store(store).bad == []
    assert leftovers(store.parent) == []


def test_interrupted_first_pack_publishes_nothing(ckpt, tmp_path):
    def boom(p, n):
        raise RuntimeError("disk on fire")
    with pytest.raises(RuntimeError):
        pack_store(ckpt, tmp_path / "new", progress=boom)
    assert os.listdir(tmp_path) == []


def test_repack_replaces_the_store_atomically(ckpt, store, tmp_path):
    old_created = mf.load(store).created
    (store / "manifest.json").touch()
    r = pack_store(ckpt, store, dtype=torch.bfloat16)
    assert r.records == 24 and mf.load(store).dtype == "bfloat16"
    assert verify_store(store).bad == [] and old_created  # the new store verifies
    assert leftovers(tmp_path) == []


def test_sigkill_mid_pack_leaves_the_old_store_and_next_pack_cleans_up(ckpt, store, tmp_path):
    before = snapshot(store)
    marker = tmp_path / "writing"
    script = textwrap.dedent(f"""
        import time, pathlib
        from engine.store.pack import pack_store
        def stall(phase, n):
            pathlib.Path({str(marker)!r}).touch()
            time.sleep(600)
        pack_store({str(ckpt)!r}, {str(store)!r}, progress=stall)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, "the packer died before writing"
            assert time.monotonic() < deadline, "the packer never started writing"
            time.sleep(0.05)
        staging = [p for p in tmp_path.iterdir() if p.name.startswith(".store.staging-")]
        assert len(staging) == 1 and (staging[0] / "experts.bin").exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert snapshot(store) == before and verify_store(store).bad == []
    pack_store(ckpt, store)                     # the killed pack's staging dir is garbage now
    assert leftovers(tmp_path) == []


def _can_mount_ramfs(path: Path) -> bool:
    path.mkdir(exist_ok=True)
    return subprocess.run(["mount", "-t", "ramfs", "ramfs", str(path)], capture_output=True).returncode == 0


def test_a_filesystem_that_refuses_o_direct_stops_pack_with_exit_6(ckpt, tmp_path, capsys):
    # ramfs has no direct-I/O support: open(O_DIRECT) fails with EINVAL on a real kernel.
    mnt = tmp_path / "ramfs"
    if not _can_mount_ramfs(mnt):
        pytest.skip("cannot mount ramfs here (needs root); the monkeypatched test below covers the path")
    try:
        rc, out, err = run(["pack-store", "--model", str(ckpt), "--store", str(mnt / "store")], capsys)
        assert rc == 6
        assert err == f"engine: {mnt}: the filesystem refuses O_DIRECT (fstype ramfs)\n"
        assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_o_direct_refused_on_open_stops_verify_with_exit_6(store, monkeypatch, capsys):
    # A double: a filesystem that refuses O_DIRECT may not be mountable here (needs root), so
    # os.open answers EINVAL for O_DIRECT exactly as such a kernel/filesystem does.
    real_open = os.open

    def refusing_open(path, flags, *a, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *a, **kw)
    monkeypatch.setattr(os, "open", refusing_open)
    rc, _, err = run(["verify-store", "--store", str(store)], capsys)
    assert rc == 6
    assert err.startswith(f"engine: {store}: the filesystem refuses O_DIRECT (fstype ") and err.count("\n") == 1


def test_missing_checkpoint_is_one_line_exit_3(tmp_path, capsys):
    rc, _, err = run(["pack-store", "--model", str(tmp_path / "nope"), "--store", str(tmp_path / "s")], capsys)
    assert rc == 3 and err.count("\n") == 1 and "config.json: missing" in err
