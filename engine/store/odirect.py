"""O_DIRECT plumbing: the probe, page-aligned buffers and full-length pread/pwrite.

O_DIRECT needs the buffer address, the file offset and the length aligned to the logical
block size; 4 KiB covers every NVMe/SSD in practice. Anonymous mmaps are page aligned, so
an arena carved into 4 KiB-multiple slots gives aligned buffers with no extra copies.
"""
from __future__ import annotations

import errno
import mmap
import os
import secrets
from pathlib import Path

from engine.errors import EngineError, Exit
from engine.experts.layout import ALIGN


def fstype(path: str | os.PathLike) -> str:
    """Filesystem type of the mount holding `path` (longest mount-point prefix in /proc/self/mountinfo)."""
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mnt = left.split()[4].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, right.split()[0]
    except OSError:
        pass
    return kind


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Zeroed, page-aligned (hence 4 KiB-aligned) anonymous memory of nbytes rounded up to ALIGN."""
    return mmap.mmap(-1, max(ALIGN, -(-nbytes // ALIGN) * ALIGN), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def pread_full(fd: int, buf, offset: int) -> int:
    """Fill `buf` (a writable buffer) from `offset`; a short file is an error, never a silent partial read."""
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise EOFError(f"file ends at {offset + done}, expected {len(view) - done} more bytes")
        done += n
    return done


def pwrite_full(fd: int, buf, offset: int) -> int:
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        done += os.pwritev(fd, [view[done:]], offset + done)
    return done


def refused(path, e: OSError | None = None) -> EngineError:
    return EngineError(f"{path}: the filesystem refuses O_DIRECT (fstype {fstype(path)})", Exit.IO)


def probe(directory: str | os.PathLike) -> None:
    """Write then read back one aligned block with O_DIRECT in a temp file inside `directory`.

    A read-only directory (a store mounted :ro for serving) is probed by reading the first block
    of a file already there instead. EINVAL anywhere means the filesystem refuses O_DIRECT.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise EngineError(f"{directory}: not a directory", Exit.IO)
    buf = aligned_buffer(ALIGN)
    pattern = secrets.token_bytes(64) * (ALIGN // 64)
    buf[:] = pattern
    tmp = directory / f".odirect-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as e:
        tmp.unlink(missing_ok=True)      # Linux creates the file before it rejects O_DIRECT
        if e.errno == errno.EINVAL:
            raise refused(directory, e) from None
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return _probe_read_only(directory, e)
        raise EngineError(f"{directory}: cannot create an O_DIRECT probe file ({e.strerror})", Exit.IO) from None
    try:
        pwrite_full(fd, buf, 0)
        back = aligned_buffer(ALIGN)
        pread_full(fd, back, 0)
        if back[:] != pattern:
            raise EngineError(f"{directory}: an O_DIRECT block read back differs from what was written", Exit.IO)
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise refused(directory, e) from None
        raise EngineError(f"{directory}: O_DIRECT probe failed ({e.strerror})", Exit.IO) from None
    finally:
        os.close(fd)
        tmp.unlink(missing_ok=True)


def _probe_read_only(directory: Path, why: OSError) -> None:
    candidates = [p for p in sorted(directory.iterdir()) if p.is_file() and p.stat().st_size >= ALIGN]
    if not candidates:
        raise EngineError(f"{directory}: cannot write an O_DIRECT probe file ({why.strerror}) "
                          f"and holds no file to probe by reading", Exit.IO)
    buf = aligned_buffer(ALIGN)
    try:
        fd = os.open(candidates[0], os.O_RDONLY | os.O_DIRECT)
        try:
            pread_full(fd, buf, 0)
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise refused(directory, e) from None
        raise EngineError(f"{candidates[0]}: O_DIRECT read probe failed ({e.strerror})", Exit.IO) from None


def open_direct(path: str | os.PathLike, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """os.open with O_DIRECT; EINVAL becomes the one-line 'refuses O_DIRECT' error."""
    try:
        return os.open(path, flags | os.O_DIRECT, mode)
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise refused(Path(path).parent, e) from None
        raise EngineError(f"{path}: cannot open ({e.strerror})", Exit.IO) from None
