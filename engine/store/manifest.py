"""What a store holds: manifest.json beside experts.bin.

Records are laid out layer-major (layer l's experts 0..E-1, then the next MoE layer), each
exactly ExpertLayout.pack(gate, up, down) in the store dtype and record order (rows or cols,
engine.experts; a manifest without "order" is rows), padded to 4 KiB. "quant" names the record
scheme: "none" (float records in "dtype"; a manifest without it), one of engine.quant.records.SCHEMES, or a
"ggml:G,U,D" layout of per-matrix GGML types; quantized records are bytes (dtype "uint8") with their scales
inside. A ggml: store also records each record's layout, "layer_types": one [gate, up, down] triple of GGML
type names per MoE layer (a layer's experts are one GGUF tensor each, so its records share their types), which
each record's own header repeats and verify-store checks (engine.store.verify).

manifest.sha256 beside it holds the manifest's own sha256 (engine.store.manifest_file): a manifest is
checked against it, then field by field, then record by record (each exactly where the layer-major order
puts it), before anything it says is used.

Exit codes of the one-line reasons: 3 the store does not belong here (missing, another
checkpoint, another format), 8 integrity (edited, garbled or lying manifest, wrong file size).
"""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from engine.errors import EngineError, Exit
from engine.experts.layout import ALIGN, DTYPES, ORDERS, ExpertLayout
from engine.store import manifest_file
from engine.quant import ggml
from engine.quant.records import MIXED, SCHEMES, is_scheme, matrix_bytes

QUANTS = ("none", *SCHEMES)
QUANT_DTYPE = "uint8"           # the dtype of a quantized store's records: bytes

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SIDECAR = "manifest.sha256"         # the manifest's own sha256 (engine.store.manifest_file)
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
    layer_types: list | None = None     # ggml: stores: [[gate, up, down] GGML type names] per moe_layers entry
    sha256: str = ""                # of manifest.json as read (not a field of it): what tool prepare records
    _index: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        self._index = {(r.layer, r.expert): i for i, r in enumerate(self.records)}

    @property
    def layout(self) -> ExpertLayout:
        dtype = torch.uint8 if self.quant != "none" else DTYPES[self.dtype]
        return ExpertLayout(self.hidden, self.intermediate, dtype, self.order, self.quant)

    def record_types(self, layer: int) -> tuple[str, str, str] | None:
        """(gate, up, down) GGML types of `layer`'s records: the manifest's layer_types, a GGUF one-type scheme's
        three, else None (float, int8, int4 records)."""
        if self.layer_types is not None:
            return tuple(self.layer_types[self.moe_layers.index(layer)])  # type: ignore[return-value]
        return (self.quant,) * 3 if self.quant in ggml.TYPES else None

    def record(self, layer: int, expert: int) -> Record:
        return self.records[self._index[(layer, expert)]]

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("_index")
        d.pop("sha256")
        if d["layer_types"] is None:        # one-type stores: the manifest as before
            d.pop("layer_types")
        d["records"] = [[r.layer, r.expert, r.offset, r.sha256] for r in self.records]
        return {"format_version": d.pop("format_version"), **d}


def plan_offsets(moe_layers: list[int], experts: int, record_bytes: int) -> list[tuple[int, int, int]]:
    """(layer, expert, offset) of every record, in file order."""
    return [(l, e, (i * experts + e) * record_bytes) for i, l in enumerate(moe_layers) for e in range(experts)]


# The manifest's fields and what each must be, checked exactly (a bool is not an int, 8.0 is not 8) before
# anything is built from them. A new field (a record `quant` scheme, say) is one entry here (plus OPTIONAL
# if older manifests lack it) and one attribute on Manifest; what it implies for another field (a quantized
# store's dtype) belongs where the layout is built, below. A field not listed is refused, so a manifest
# cannot carry what nothing checks.
MAX_RECORDS = 1 << 20
MAX_MANIFEST_BYTES = 128 << 20          # ~110 bytes a record: room for MAX_RECORDS
_HEX64 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[a-z0-9_]{1,64}")


def _int(lo: int, hi: int):
    def check(v):
        if type(v) is not int:
            return f"{type(v).__name__} {_short(v)}, not an integer"
        if not lo <= v <= hi:
            return f"{v} is outside {lo}..{hi}"
        return None
    return check


def _str(pattern: re.Pattern | None = None, choices=None, limit: int = 64):
    def check(v):
        if type(v) is not str:
            return f"{type(v).__name__} {_short(v)}, not a string"
        if choices is not None and v not in choices:
            return f"{v[:limit]!r} is not one of {', '.join(choices)}"
        if pattern is not None and not pattern.fullmatch(v):
            return f"{v[:limit]!r} is not {pattern.pattern}"
        if len(v) > limit:
            return f"a string of {len(v)} characters (at most {limit})"
        return None
    return check


def _layers(v):
    if type(v) is not list or not v or len(v) > 1 << 16:
        return f"{_short(v)}, not a non-empty list of layer numbers"
    bad = next((x for x in v if type(x) is not int or not 0 <= x < 1 << 16), None)
    if bad is not None:
        return f"holds {_short(bad)}, not a layer number"
    if v != sorted(set(v)):
        return "not strictly ascending (a layer twice, or out of order)"
    return None


def _quant(v):
    if type(v) is not str:
        return f"{type(v).__name__} {_short(v)}, not a string"
    if len(v) > 64 or (v != "none" and not is_scheme(v)):
        return f"{v[:64]!r} is not one of {', '.join(QUANTS)} or {MIXED}G,U,D (GGML types)"
    return None


def _layer_types(v):
    if v is None:
        return None
    if type(v) is not list or len(v) > 1 << 16:
        return f"{_short(v)}, not a list of [gate, up, down] type triples"
    for row in v:
        if type(row) is not list or len(row) != 3 or any(type(t) is not str or t not in ggml.TYPES for t in row):
            return f"holds {_short(row)}, not [gate, up, down] GGML type names"
    return None


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


FIELDS = {
    "format_version": _int(FORMAT_VERSION, FORMAT_VERSION),
    "config_hash": _str(_HEX64),
    "arch": _str(_NAME),
    "moe_layers": _layers,
    "experts_per_layer": _int(1, 1 << 16),
    "hidden": _int(1, 1 << 20),
    "intermediate": _int(1, 1 << 20),
    "dtype": _str(choices=[*sorted(DTYPES), QUANT_DTYPE]),
    "order": _str(choices=ORDERS),
    "quant": _quant,
    "layer_types": _layer_types,
    "record_bytes": _int(ALIGN, 1 << 40),
    "total_bytes": _int(0, 1 << 62),
    "records": lambda v: None if type(v) is list else f"{type(v).__name__}, not a list",
    "created": _str(limit=64),
}
# manifests from before record orders / quantized records / per-matrix GGML types
OPTIONAL = {"order": "rows", "quant": "none", "layer_types": None}


def _garbled(path: Path, why: str) -> EngineError:
    return EngineError(f"{path}: garbled ({why}; repack with `engine pack-store`)", Exit.INTEGRITY)


def _check_fields(path: Path, raw) -> dict:
    if type(raw) is not dict:
        raise _garbled(path, f"a JSON {type(raw).__name__}, not an object")
    if "format_version" in raw and raw["format_version"] != FORMAT_VERSION and type(raw["format_version"]) is int:
        raise EngineError(f"{path}: format_version {raw['format_version']} is not {FORMAT_VERSION} "
                          f"(repack with this engine)", Exit.BAD_MODEL)
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise _garbled(path, f"unknown field {unknown[0][:64]!r}")
    raw = {**OPTIONAL, **raw}
    for name, check in FIELDS.items():
        if name not in raw:
            raise _garbled(path, f"no {name}")
        why = check(raw[name])
        if why:
            raise _garbled(path, f"{name}: {why}")
    return raw


def _check_records(path: Path, raw: dict, data_size: int | None) -> list[Record]:
    """Every record where the documented order puts it: row i is (moe_layers[i // E], i % E) at offset
    i x record_bytes. That one rule makes the keys unique and complete and the offsets aligned, in the
    file and never shared, so a record's sha256 is bound to its (layer, expert) and to its bytes."""
    layers, e, rb, rows = raw["moe_layers"], raw["experts_per_layer"], raw["record_bytes"], raw["records"]
    if len(layers) * e > MAX_RECORDS:
        raise _garbled(path, f"{len(layers)} layers x {e} experts is more than {MAX_RECORDS} records")
    if len(rows) != len(layers) * e:
        raise _garbled(path, f"{len(rows)} records for {len(layers)} layers x {e} experts")
    # One pass with the cheap tests inline; _why_row words the first failure only.
    ok_hex = _HEX64.fullmatch
    records = []
    add = records.append
    for i, row in enumerate(rows):
        if (type(row) is list and len(row) == 4 and type(row[0]) is int and type(row[1]) is int
                and type(row[2]) is int and type(row[3]) is str and row[2] == i * rb and row[1] == i % e
                and row[0] == layers[i // e] and ok_hex(row[3])):
            add(Record(*row))
            continue
        raise _garbled(path, _why_row(i, row, layers, e, rb, data_size))
    return records


def _why_row(i: int, row, layers: list[int], e: int, rb: int, data_size: int | None) -> str:
    if type(row) is not list or len(row) != 4:
        return f"record {i} is {_short(row)}, not [layer, expert, offset, sha256]"
    l, x, o, h = row
    for what, v in (("layer", l), ("expert", x), ("offset", o)):
        if type(v) is not int:
            return f"record {i}'s {what} is {type(v).__name__} {_short(v)}, not an integer"
    if type(h) is not str or not _HEX64.fullmatch(h):
        return f"record {i}'s sha256 is {_short(h)}, not 64 lowercase hex digits"
    want = (layers[i // e], i % e, i * rb)
    if o < 0:
        why = f"offset {o} is negative"
    elif o % ALIGN:
        why = f"offset {o} is not a multiple of {ALIGN}"
    elif data_size is not None and o + rb > data_size:
        why = f"offset {o} + {rb} runs past the end of {DATA} ({data_size} bytes)"
    else:
        why = "out of the documented order"
    return (f"record {i} is layer {l} expert {x} at offset {o}: {why}; record {i} must be "
            f"layer {want[0]} expert {want[1]} at offset {want[2]}")


def load(store_dir: str | os.PathLike, *, check_size: bool = True) -> Manifest:
    """The store's manifest, once its own sha256 (manifest.sha256), every field's type and range, and the
    position of every record are checked; then, with `check_size`, experts.bin's size. Nothing in a
    manifest is believed before that, so a lying one is an integrity failure (exit 8), not a wrong read."""
    store_dir = Path(store_dir)
    path = store_dir / MANIFEST
    if not store_dir.is_dir():
        raise EngineError(f"{store_dir}: no such store directory (run `engine pack-store`)", Exit.BAD_MODEL)
    raw, digest = manifest_file.read_checked(path, max_bytes=MAX_MANIFEST_BYTES, repair="repack with `engine pack-store`",
                                             missing="not a Kiln expert store; run `engine pack-store`")
    raw = _check_fields(path, raw)
    if (raw["quant"] != "none") != (raw["dtype"] == QUANT_DTYPE):
        raise _garbled(path, f"dtype {raw['dtype']!r} does not go with quant {raw['quant']!r} "
                             f"(quantized records are {QUANT_DTYPE} bytes, float records name their dtype)")
    data = store_dir / DATA
    size = None
    if check_size:
        try:
            size = data.stat().st_size
        except FileNotFoundError:
            raise EngineError(f"{data}: missing (the manifest names {raw['total_bytes']} bytes)", Exit.INTEGRITY) from None
    records = _check_records(path, raw, size)
    m = Manifest(**{**raw, "records": records}, sha256=digest)
    try:
        layout = m.layout               # a layout refuses combinations no single field shows (its asserts)
    except (AssertionError, ValueError) as e:
        raise _garbled(path, f"no record layout for these fields ({e})") from None
    _check_layer_types(path, m, layout)
    if m.record_bytes != layout.record_bytes:
        raise _garbled(path, f"record_bytes {m.record_bytes} != {layout.record_bytes} for its shape")
    if m.total_bytes != len(m.records) * m.record_bytes:
        raise _garbled(path, f"total_bytes {m.total_bytes} != {len(m.records)} records x {m.record_bytes}")
    if size is not None and size != m.total_bytes:
        raise EngineError(f"{data}: {size} bytes, the manifest says {m.total_bytes}", Exit.INTEGRITY)
    return m


def _check_layer_types(path: Path, m: Manifest, layout: ExpertLayout) -> None:
    """layer_types: present exactly for ggml: layouts, one triple a MoE layer, each type fitting its region."""
    q = layout.quantized
    if (m.layer_types is not None) != bool(q and q.mixed):
        raise _garbled(path, f"layer_types goes with a {MIXED}G,U,D quant and only with it (quant {m.quant!r})")
    if m.layer_types is None:
        return
    if len(m.layer_types) != len(m.moe_layers):
        raise _garbled(path, f"{len(m.layer_types)} layer_types for {len(m.moe_layers)} moe_layers")
    for l, types in zip(m.moe_layers, m.layer_types):
        for t, (name, (_, size, o, i)) in zip(types, q.regions.items()):
            try:
                fits = matrix_bytes(t, o, i) <= size
            except ValueError as e:
                raise _garbled(path, f"layer {l}'s {name} type {t}: {e}") from None
            if not fits:
                raise _garbled(path, f"layer {l}'s {name} type {t} does not fit the {m.quant} record's region")


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
