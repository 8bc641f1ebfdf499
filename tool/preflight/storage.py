"""Storage: where the weights and the store will live, free space per filesystem, fs type, O_DIRECT, device.

The dirs need not exist yet: their nearest existing ancestor is probed (that is the filesystem they
will be created on). Nothing is created beyond a temp probe file, which is removed at once.
"""
from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from tool.preflight.checks import CheckResult, failed, gb, passed, warned
from tool.preflight.hostroot import HostRoot, Mount

ALIGN = 4096
GOOD_FS = {"xfs", "ext4"}
# What each filesystem means for a store read with O_DIRECT (named in disk.store.fstype).
FS_MEANING = {
    "btrfs": "btrfs: copy-on-write and checksums; O_DIRECT on checksummed files may fall back to buffered I/O",
    "zfs": "ZFS: before OpenZFS 2.3 O_DIRECT is accepted but goes through the ARC (not direct)",
    "overlay": "overlayfs (a container layer): O_DIRECT reaches the upper filesystem only on recent kernels; bind-mount a host filesystem",
    "fuse": "FUSE: O_DIRECT works only if the daemon enables direct_io",
    "nfs": "NFS: O_DIRECT goes over the network; NVMe-speed reads are out of reach",
    "nfs4": "NFS: O_DIRECT goes over the network; NVMe-speed reads are out of reach",
    "cifs": "SMB: a network filesystem; NVMe-speed reads are out of reach",
    "tmpfs": "tmpfs: RAM-backed, so the store would occupy RAM; O_DIRECT only since Linux 6.6",
    "ramfs": "ramfs: RAM-backed with no size limit; it refuses O_DIRECT",
    "ext4": "ext4: O_DIRECT supported",
    "xfs": "xfs: O_DIRECT supported",
}


@dataclass
class Place:
    """One dir the recipe will use (the weights dir or the store dir) and the filesystem under it."""
    role: str                 # "models" | "store"
    base: Path                # the models dir or the store dir, as the user named it
    path: Path                # where the recipe's files go
    existing: Path | None     # nearest existing ancestor (or path itself)
    blocker: str | None       # why path cannot be created, if it cannot
    dev: int | None = None
    free: int | None = None
    read_only: bool = False
    mount: Mount | None = None

    @property
    def fs_text(self) -> str:
        return f"{self.mount.fstype} on {self.mount.mount_point}" if self.mount else "unknown filesystem"


def locate(role: str, base: Path, path: Path, root: HostRoot) -> Place:
    path = Path(os.path.abspath(path))
    probe = path
    try:
        while not probe.exists():     # False for ENOENT and for a path under a file (ENOTDIR)
            probe = probe.parent
    except OSError as e:
        return Place(role, base, path, None, f"cannot look at {probe}: {e.strerror}")
    place = Place(role, base, path, probe, None)
    if not probe.is_dir():
        place.blocker = f"{probe} is a file, not a directory"
        probe = probe.parent
    vfs = os.statvfs(probe)
    place.dev, place.free = os.stat(probe).st_dev, vfs.f_bavail * vfs.f_frsize
    place.read_only = bool(vfs.f_flag & os.ST_RDONLY)
    place.mount = root.mount_of(str(probe.resolve()))
    return place


def places(recipe: dict, models_dir: Path, store_dir: Path, root: HostRoot) -> list[Place]:
    out = [locate("models", Path(models_dir), Path(models_dir) / recipe["weights"]["dirname"], root)]
    if recipe.get("store"):
        out.append(locate("store", Path(store_dir), Path(store_dir) / recipe["store"]["dirname"], root))
    return out


def need_bytes(recipe: dict, place: Place) -> int | None:
    """Bytes still to be written there (0 when already done there; None when the size is not known yet)."""
    if place.role == "models":
        if (place.path / ".kiln-weights.json").is_file():
            return 0
        return recipe["weights"].get("size_bytes")
    store = recipe["store"]
    if store.get("files") and all((place.path / f).is_file() for f in store["files"]):
        return 0
    return store.get("size_bytes")


def check_free(recipe: dict, found: list[Place]) -> list[CheckResult]:
    """Free space per filesystem: two dirs on one filesystem add their needs (counted once)."""
    out = []
    what = {"models": f"weights {recipe['weights'].get('repo') or recipe['weights'].get('package', '')}".strip(), "store": "store"}
    for p in found:
        cid = f"disk.{p.role}.free"
        if p.free is None:
            out.append(failed(cid, f"{p.role} dir {p.base}: {p.blocker}"))
            continue
        sharing = [q for q in found if q.dev == p.dev]
        needs = {q.role: need_bytes(recipe, q) for q in sharing}
        if any(v is None for v in needs.values()):
            unknown = [r for r, v in needs.items() if v is None]
            out.append(warned(cid, f"{p.role} dir {p.base} ({p.fs_text}): the {' and '.join(unknown)} size is not known until tool fetch reads it; {gb(p.free)} free"))
            continue
        need = sum(needs.values())
        if len(sharing) > 1:
            parts = " + ".join(f"{r} {gb(v)}" for r, v in needs.items())
            detail = f"{p.role} dir {p.base} shares {p.fs_text} with the {' and '.join(r for r in needs if r != p.role)} dir: {gb(need)} needed ({parts}), {gb(p.free)} free"
        else:
            detail = f"{p.role} dir {p.base} ({p.fs_text}): {gb(need)} needed for the {what[p.role]}, {gb(p.free)} free"
        out.append((passed if p.free >= need else failed)(cid, detail))
    return out


def write_probe(directory: Path) -> str | None:
    """Create and remove a temp file: None if that works, else the reason (root bypasses modes, not ro/immutable)."""
    name = directory / f".kiln-preflight-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        return f"{e.strerror.lower()}" if e.strerror else str(e)
    os.close(fd)
    os.unlink(name)
    return None


def check_writable(p: Place) -> CheckResult:
    cid = f"disk.{p.role}.writable"
    if p.blocker:
        return failed(cid, f"{p.role} dir {p.base} cannot be created: {p.blocker}")
    verb = "written" if p.existing == p.path else "created"
    if p.read_only or (p.mount and p.mount.read_only):
        return failed(cid, f"{p.role} dir {p.base} cannot be {verb}: {p.existing} is on a read-only mount ({p.fs_text})")
    reason = write_probe(p.existing)
    if reason:
        return failed(cid, f"{p.role} dir {p.base} cannot be {verb}: creating a file in {p.existing} fails ({reason})")
    return passed(cid, f"{p.role} dir {p.base} can be {verb}: {p.existing} is writable ({p.fs_text})")


def check_fstype(recipe: dict, p: Place) -> CheckResult:
    want = recipe["store"].get("filesystems") or sorted(GOOD_FS)
    fs = p.mount.fstype if p.mount else "unknown"
    meaning = FS_MEANING.get(fs, FS_MEANING.get(fs.split(".")[0], f"{fs}: O_DIRECT support unknown"))
    if fuse := fs.startswith("fuse"):
        meaning = FS_MEANING["fuse"]
    if fs in want and not fuse:
        return passed("disk.store.fstype", f"store on {p.fs_text} ({meaning}); the recipe wants {' or '.join(want)}")
    return warned("disk.store.fstype", f"store on {p.fs_text}; the recipe wants {' or '.join(want)} — {meaning}")


def odirect_probe(directory: Path) -> tuple[bool | None, str]:
    """Write and read back one 4 KiB block with O_DIRECT: (True, how) / (False, refused) / (None, not probed)."""
    buf = mmap.mmap(-1, ALIGN)  # anonymous mmaps are page aligned, as O_DIRECT needs
    buf.write(secrets.token_bytes(64) * (ALIGN // 64))
    back = mmap.mmap(-1, ALIGN)
    name = directory / f".kiln-odirect-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as e:
        if e.errno == errno.EINVAL:
            # Some filesystems (ramfs) create the file and then refuse the open: the name is ours (O_EXCL, random).
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
            return False, "the filesystem refuses O_DIRECT (open: EINVAL)"
        return None, f"cannot create a probe file in {directory} ({e.strerror})"
    try:
        try:
            os.pwritev(fd, [buf], 0)
            os.preadv(fd, [back], 0)
        except OSError as e:
            if e.errno == errno.EINVAL:
                return False, "the filesystem refuses O_DIRECT (EINVAL on a 4 KiB-aligned write/read)"
            return None, f"O_DIRECT probe in {directory} failed: {e.strerror}"
        if buf[:] != back[:]:
            return False, "an O_DIRECT read returned other bytes than were written"
        return True, "a 4 KiB-aligned write and read with O_DIRECT succeeded"
    finally:
        os.close(fd)
        os.unlink(name)
        buf.close()
        back.close()


def check_odirect(p: Place) -> CheckResult:
    if p.blocker or p.existing is None:
        return warned("disk.store.odirect", f"not probed: {p.base} cannot be created ({p.blocker})")
    ok, how = odirect_probe(p.existing)
    target = f"in {p.existing} ({p.fs_text})"
    if ok is True:
        return passed("disk.store.odirect", f"{how} {target}")
    if ok is False:
        return failed("disk.store.odirect", f"{how} {target}")
    return warned("disk.store.odirect", f"not probed: {how}")


def block_device(root: HostRoot, major_minor: str) -> tuple[str, list[str]] | None:
    """(device name, its member devices) for a maj:min, read from /sys/dev/block (partitions → their disk)."""
    link = root.path(f"/sys/dev/block/{major_minor}")
    try:
        target = os.readlink(link)
    except OSError:
        return None
    name = os.path.basename(target)
    if root.exists(f"/sys/dev/block/{major_minor}/partition"):
        name = os.path.basename(os.path.dirname(target))
    try:
        slaves = sorted(os.listdir(root.path(f"/sys/block/{name}/slaves")))
    except OSError:
        slaves = []
    return name, slaves


def check_device(recipe: dict, p: Place, root: HostRoot) -> CheckResult:
    want_nvme = recipe["hardware"].get("disk", {}).get("nvme", False)
    gbps = recipe["store"].get("read_gbps_while_serving")
    speed = f" (measured at {gbps:g} GB/s store reads while serving)" if gbps else ""
    dev = block_device(root, p.mount.major_minor) if p.mount else None
    if dev is None:
        detail = f"store on {p.fs_text}: no block device behind it"
        return warned("disk.store.device", detail + f"; the recipe wants NVMe{speed}") if want_nvme else passed("disk.store.device", detail)
    name, members = dev
    disks = members or [name]
    nvme = all(d.startswith("nvme") for d in disks)
    rotational = any((root.read(f"/sys/block/{d}/queue/rotational") or "0").strip() == "1" for d in disks)
    kind = ("NVMe" if nvme else "not NVMe") + (", rotational" if rotational else "")
    what = f"{name} ({'over ' + ' '.join(members) + ', ' if members else ''}{kind})"
    if want_nvme and (not nvme or rotational):
        return warned("disk.store.device", f"store on {what}; the recipe wants NVMe{speed}, so decode may be slower")
    return passed("disk.store.device", f"store on {what}" + (f"; the recipe wants NVMe{speed}" if want_nvme else ""))


def check(recipe: dict, models_dir: Path, store_dir: Path, root: HostRoot, probes: bool = True) -> list[CheckResult]:
    """All storage checks; probes=False (tool list) leaves out the writes: writable and O_DIRECT."""
    found = places(recipe, models_dir, store_dir, root)
    out = check_free(recipe, found)
    if not probes:
        return out
    out += [check_writable(p) for p in found]
    store = next((p for p in found if p.role == "store"), None)
    if store is not None:
        out += [check_fstype(recipe, store), check_odirect(store), check_device(recipe, store, root)]
    return out
