"""checkpoint → staging store → verified → published by rename.

The store is built in a hidden staging directory beside the target, written with O_DIRECT
into a preallocated file, fsynced, re-read with O_DIRECT and hashed, a sample byte-compared
with the checkpoint, and only then swapped into place (renameat2 RENAME_EXCHANGE, so the old
store stays whole until that instant). Any failure removes the staging directory; a SIGKILL
leaves only a hidden `.NAME.staging-PID-*` that the next pack removes. Records stream through
two aligned chunk buffers (packing one while the other is written), never the whole checkpoint.
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import queue
import random
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from engine.checkpoint import Checkpoint
from engine.model_source import open_checkpoint
from engine import interrupts
from engine.errors import EngineError, Exit
from engine.store.source import record_source
from engine.store import manifest as mf
from engine.store import manifest_file
from engine.store.odirect import aligned_buffer, open_direct, pread_full, probe, pwrite_full
from engine.store.verify import hash_records

CHUNK = 32 << 20
SAMPLE = 16


@dataclass
class PackResult:
    store: Path
    records: int
    bytes: int
    write_seconds: float
    verify_seconds: float
    sampled: int

    @property
    def write_gbps(self) -> float:
        return self.bytes / max(self.write_seconds, 1e-9) / 1e9

    @property
    def verify_gbps(self) -> float:
        return self.bytes / max(self.verify_seconds, 1e-9) / 1e9


def pack_store(model_dir: str | os.PathLike, store_dir: str | os.PathLike, *, dtype: torch.dtype | None = None,
               order: str = "rows", readers: int | None = None, progress: Callable[[str, int], None] | None = None,
               sample: int = SAMPLE, quant: str = "none", gguf: str | os.PathLike | None = None) -> PackResult:
    """Pack `model_dir`'s routed experts into `store_dir` in record `order` (engine.experts: rows for the GPU,
    cols for CPU serving). quant: "none" (float records in `dtype`), "int8"/"int4" (quantized here,
    deterministically), "gguf" (the `gguf` file's own expert blocks). progress(phase, n_bytes): phase
    'write' | 'verify'."""
    ck = open_checkpoint(model_dir)
    layout, make = record_source(ck, dtype=dtype, order=order, quant=quant, gguf=gguf)
    store_dir = Path(os.path.abspath(store_dir))
    parent = store_dir.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EngineError(f"{parent}: cannot create ({e.strerror})", Exit.IO) from None
    if store_dir.exists() and any(store_dir.iterdir()) and not (store_dir / mf.MANIFEST).exists():
        raise EngineError(f"{store_dir}: exists and is not a Kiln expert store; refusing to replace it", Exit.IO)
    probe(parent)
    _remove_stale_staging(parent, store_dir.name)

    plan = mf.plan_offsets(ck.moe_layers, ck.n_experts, layout.record_bytes)
    total = len(plan) * layout.record_bytes
    staging = Path(tempfile.mkdtemp(dir=parent, prefix=f".{store_dir.name}.staging-{os.getpid()}-"))
    try:
        os.chmod(staging, 0o755)      # mkdtemp makes it 0700; the published store is read by a service user
        data = staging / mf.DATA
        t0 = time.perf_counter()
        digests = _write_records(ck, layout, plan, data, total, progress, make)
        t_write = time.perf_counter() - t0

        t0 = time.perf_counter()
        reread = hash_records(data, [o for _, _, o in plan], layout.record_bytes, readers=readers,
                              on_bytes=(lambda n: progress("verify", n)) if progress else None)
        t_verify = time.perf_counter() - t0
        for (l, e, o), want, got in zip(plan, digests, reread):
            if want != got:
                raise EngineError(f"{data}: layer {l} expert {e} offset {o} reads back differently than "
                                  f"written (sha256)", Exit.INTEGRITY)
        sampled = _compare_sample(layout, plan, data, sample, make)

        publish_store(staging, store_dir, config_hash=ck.config_hash(), arch=ck.arch, layout=layout,
                      experts=ck.n_experts, plan=plan, digests=digests, layer_types=_layer_types(ck, layout, make))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return PackResult(store_dir, len(plan), total, t_write, t_verify, sampled)


def _layer_types(ck: Checkpoint, layout, make) -> list[list[str]] | None:
    """A ggml: store's per-layer record types for its manifest, as the records made say them (their headers)."""
    q = layout.quantized
    if not (q and q.mixed):
        return None
    return [list(q.record_types(make(l, 0))) for l in ck.moe_layers]


def publish_store(staging: Path, store_dir: Path, *, config_hash: str, arch: str, layout, experts: int,
                  plan: list[tuple[int, int, int]], digests: list[str],
                  layer_types: list[list[str]] | None = None) -> mf.Manifest:
    """The last step of every store build (pack-store, engine synth): the manifest and its sha256 sidecar
    into the verified staging dir, fsync, then publish by rename."""
    m = mf.Manifest(config_hash=config_hash, arch=arch, moe_layers=sorted({l for l, _, _ in plan}),
                    experts_per_layer=experts, hidden=layout.hidden, intermediate=layout.intermediate,
                    dtype=str(layout.dtype).removeprefix("torch."), record_bytes=layout.record_bytes,
                    total_bytes=len(plan) * layout.record_bytes,
                    records=[mf.Record(l, e, o, d) for (l, e, o), d in zip(plan, digests)],
                    created=datetime.now(timezone.utc).isoformat(timespec="seconds"), order=layout.order,
                    quant=layout.quant, layer_types=layer_types)
    m.sha256 = manifest_file.write_with_sidecar(staging / mf.MANIFEST, m.to_json())
    _fsync_dir(staging)
    _publish(staging, store_dir)
    return m


def _write_records(ck: Checkpoint, layout, plan, data: Path, total: int, progress, make=None) -> list[str]:
    """Stream records into `data` (O_DIRECT, preallocated); returns each record's sha256 as written."""
    rb = layout.record_bytes
    per_chunk = max(1, CHUNK // rb)
    fd = open_direct(data, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            os.posix_fallocate(fd, 0, total)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                free = shutil.disk_usage(data.parent).free
                raise EngineError(f"{data.parent}: the store needs {total} bytes, {free} free", Exit.IO) from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):   # no fallocate: plain writes still work
                raise EngineError(f"{data}: cannot preallocate ({e.strerror})", Exit.IO) from None
        free_bufs: queue.Queue = queue.Queue()
        for _ in range(3):
            free_bufs.put(aligned_buffer(per_chunk * rb))
        full: queue.Queue = queue.Queue()
        failed: list[BaseException] = []
        digests: list[str] = [""] * len(plan)

        def writer():
            # Hashing here (hashlib drops the GIL) overlaps it with packing the next chunk.
            while True:
                item = full.get()
                if item is None:
                    return
                buf, first, count = item
                try:
                    if not failed:
                        view = memoryview(buf)
                        for i in range(count):
                            digests[first + i] = hashlib.sha256(view[i * rb:(i + 1) * rb]).hexdigest()
                        pwrite_full(fd, view[:count * rb], plan[first][2])
                        view.release()
                        if progress:
                            progress("write", count * rb)
                except BaseException as e:
                    failed.append(e)
                free_bufs.put(buf)

        w = threading.Thread(target=writer, name="store-writer", daemon=True)
        w.start()
        try:
            for start in range(0, len(plan), per_chunk):
                part = plan[start:start + per_chunk]
                buf = free_bufs.get()
                if failed:
                    break
                flat = torch.frombuffer(buf, dtype=torch.uint8)
                for i, (l, e, _) in enumerate(part):
                    if layout.quantized:        # quantized records are made whole (small: a quarter of the bytes)
                        flat[i * rb:(i + 1) * rb].copy_(make(l, e))
                    else:
                        pack_into(layout, flat[i * rb:(i + 1) * rb], *ck.expert(l, e))
                del flat
                full.put((buf, start, len(part)))
        finally:
            full.put(None)
            w.join()
        if failed:
            e = failed[0]
            if isinstance(e, OSError):
                raise EngineError(f"{data}: write failed ({e.strerror or e})", Exit.IO) from None
            raise e
        os.fsync(fd)
        return digests
    finally:
        os.close(fd)


def pack_into(layout, dst: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
    """ExpertLayout.pack written straight into `dst` (record_bytes of uint8, reused, so the padding
    is zeroed explicitly): no per-record allocation. The sample compare checks it against pack()."""
    rec = dst.view(layout.dtype)
    g, u, d = layout.views(rec)
    g.copy_(gate)
    u.copy_(up)
    d.copy_(down)
    rec[3 * layout.matrix_elems:].zero_()


def _compare_sample(layout, plan, data: Path, n: int, make) -> int:
    """Byte-compare the first, the last and random records (read with O_DIRECT) with a fresh pack of the
    checkpoint (make(l, e): the record as bytes)."""
    picks = sorted({0, len(plan) - 1} | set(random.Random().sample(range(len(plan)), min(n, len(plan)))))
    fd = open_direct(data)
    buf = aligned_buffer(layout.record_bytes)
    try:
        for i in picks:
            l, e, o = plan[i]
            pread_full(fd, buf, o)
            want = make(l, e).view(torch.uint8).numpy().tobytes()
            if buf[:len(want)] != want:
                raise EngineError(f"{data}: layer {l} expert {e} offset {o} differs from the checkpoint", Exit.INTEGRITY)
    finally:
        buf.close()
        os.close(fd)
    return len(picks)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2); False where the libc or filesystem cannot."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except AttributeError:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _publish(staging: Path, store_dir: Path) -> None:
    interrupts.check()          # not after a Ctrl-C or kill that Python dropped on the way (engine.interrupts)
    if store_dir.exists():
        if _exchange(staging, store_dir):
            shutil.rmtree(staging, ignore_errors=True)        # staging now holds the old store
        else:
            old = store_dir.with_name(f".{store_dir.name}.old-{os.getpid()}")
            os.rename(store_dir, old)
            os.rename(staging, store_dir)
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(staging, store_dir)
    _fsync_dir(store_dir.parent)


def _remove_stale_staging(parent: Path, name: str) -> None:
    """Staging dirs of packs that were killed (their pid is gone) are garbage; live ones are left alone."""
    for p in parent.glob(f".{name}.staging-*"):
        try:
            pid = int(p.name.removeprefix(f".{name}.staging-").split("-")[0])
        except ValueError:
            continue
        if not _alive(pid):
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
