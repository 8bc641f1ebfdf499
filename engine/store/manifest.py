"""What a store holds: manifest.json beside experts.bin.

Records are laid out layer-major (layer l's experts 0..E-1, then the next MoE layer), each
exactly ExpertLayout.pack(gate, up, down) in the store dtype and record order (rows or cols,
engine.experts; a manifest without "order" is rows), padded to 4 KiB. "quant" names the record
scheme: "none" (float records in "dtype"; a manifest without it) or one of engine.quant.records.SCHEMES,
whose records are bytes (dtype "uint8") with their scales inside.

Exit codes of the one-line reasons: 3 the store does not belong here (missing, another
checkpoint), 8 integrity (garbled manifest, wrong file size).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from engine.errors import EngineError, Exit
from engine.experts import ALIGN, DTYPES, ORDERS, ExpertLayout
from engine.quant.records import SCHEMES

QUANTS = ("none", *SCHEMES)
QUANT_DTYPE = "uint8"           # the dtype of a quantized store's records: bytes

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DATA = "experts.bin"


@dataclass(frozen=True)
class Record:
    layer: int
    expert: int
    offset: int
    sha256: str


@dataclass
class Manifest:
    config_hash: str
    arch: str
    moe_layers: list[int]
    experts_per_layer: int
    hidden: int
    intermediate: int
    dtype: str
    record_bytes: int
    total_bytes: int
    records: list[Record]
    created: str
    format_version: int = FORMAT_VERSION
    order: str = "rows"
    quant: str = "none"
    _index: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        self._index = {(r.layer, r.expert): i for i, r in enumerate(self.records)}

    @property
    def layout(self) -> ExpertLayout:
        dtype = torch.uint8 if self.quant != "none" else DTYPES[self.dtype]
        return ExpertLayout(self.hidden, self.intermediate, dtype, self.order, self.quant)

    def record(self, layer: int, expert: int) -> Record:
        return self.records[self._index[(layer, expert)]]

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("_index")
        d["records"] = [[r.layer, r.expert, r.offset, r.sha256] for r in self.records]
        return {"format_version": d.pop("format_version"), **d}


def plan_offsets(moe_layers: list[int], experts: int, record_bytes: int) -> list[tuple[int, int, int]]:
    """(layer, expert, offset) of every record, in file order."""
    return [(l, e, (i * experts + e) * record_bytes) for i, l in enumerate(moe_layers) for e in range(experts)]


def load(store_dir: str | os.PathLike, *, check_size: bool = True) -> Manifest:
    store_dir = Path(store_dir)
    path = store_dir / MANIFEST
    if not store_dir.is_dir():
        raise EngineError(f"{store_dir}: no such store directory (run `engine pack-store`)", Exit.BAD_MODEL)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise EngineError(f"{path}: missing (not a Kiln expert store; run `engine pack-store`)", Exit.BAD_MODEL) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EngineError(f"{path}: garbled ({getattr(e, 'msg', e)})", Exit.INTEGRITY) from None
    try:
        if raw.get("format_version") != FORMAT_VERSION:
            raise EngineError(f"{path}: format_version {raw.get('format_version')!r} is not "
                              f"{FORMAT_VERSION} (repack with this engine)", Exit.BAD_MODEL)
        raw = dict(raw)
        raw["records"] = [Record(int(l), int(e), int(o), str(h)) for l, e, o, h in raw["records"]]
        m = Manifest(**raw)
        if m.quant not in QUANTS:
            raise ValueError(f"quant {m.quant!r} (known: {', '.join(QUANTS)})")
        if m.dtype not in (DTYPES if m.quant == "none" else (QUANT_DTYPE,)):
            raise ValueError(f"dtype {m.dtype!r} for quant {m.quant!r}")
        if m.order not in ORDERS:
            raise ValueError(f"order {m.order!r}")
        if m.record_bytes != m.layout.record_bytes or m.record_bytes % ALIGN:
            raise ValueError(f"record_bytes {m.record_bytes} != {m.layout.record_bytes} for its shape")
        if len(m.records) != len(m.moe_layers) * m.experts_per_layer:
            raise ValueError(f"{len(m.records)} records for {len(m.moe_layers)} layers x {m.experts_per_layer}")
        if m.total_bytes != len(m.records) * m.record_bytes:
            raise ValueError(f"total_bytes {m.total_bytes} != records x record_bytes")
    except EngineError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, AssertionError) as e:
        raise EngineError(f"{path}: garbled ({type(e).__name__}: {e})", Exit.INTEGRITY) from None
    if check_size:
        data = store_dir / DATA
        try:
            size = data.stat().st_size
        except FileNotFoundError:
            raise EngineError(f"{data}: missing (the manifest names {m.total_bytes} bytes)", Exit.INTEGRITY) from None
        if size != m.total_bytes:
            raise EngineError(f"{data}: {size} bytes, the manifest says {m.total_bytes}", Exit.INTEGRITY)
    return m


def check_order(m: Manifest, device, store_dir) -> None:
    """The GPU kernels read rows-order records; a cols store is for CPU serving (the CPU reads either)."""
    if m.order != "rows" and str(device).startswith("cuda"):
        raise EngineError(f"{Path(store_dir)}: holds {m.order}-order records, the GPU kernels read rows "
                          f"(repack with `engine pack-store --order rows`)", Exit.BAD_MODEL)


def check_matches(m: Manifest, checkpoint, store_dir) -> None:
    """A store packed from another checkpoint must not be served with this one."""
    if m.config_hash != checkpoint.config_hash():
        raise EngineError(f"{Path(store_dir) / MANIFEST}: packed from another checkpoint (config hash "
                          f"{m.config_hash[:12]}, {checkpoint.dir} has {checkpoint.config_hash()[:12]})", Exit.BAD_MODEL)
