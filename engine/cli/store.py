"""`engine pack-store`, `engine verify-store` and `engine verify-model`: data on stdout, progress and reasons on stderr."""
from __future__ import annotations

import json
from contextlib import contextmanager

import click

from engine import interrupts
from engine.checkpoint import CheckpointError
from engine.gguf_model import GgufModel, is_gguf
from engine.model_source import open_checkpoint
from engine.errors import EngineError, Exit
from engine.experts.layout import DTYPES
from engine.store.source import record_source
from engine.store import manifest as mf
from engine.store import model_manifest as mm
from engine.store.manifest import plan_offsets
from engine.store.pack import pack_store as pack
from engine.store.verify import check_gguf_types, verify_store as verify
from engine.convert import file_sha256

FLOAT_QUANTS = {"float32": "float32", "bf16": "bfloat16"}       # --quant spellings of float records
QUANT_FLAGS = ("float32", "bf16", "int8", "int4", "gguf")


@contextmanager
def _progress(total: int | None, phases: list[str], quiet: bool):
    """Rich progress bars on stderr, one per phase, shown from the first byte on (so a reason
    given before any I/O stays one line); yields advance(phase, n_bytes)."""
    if quiet:
        yield None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)
    bar = Progress(TextColumn("{task.description:<7}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TimeRemainingColumn(), console=Console(stderr=True), transient=False)
    tasks: dict = {}

    def advance(phase: str, n: int) -> None:
        if not tasks:
            bar.start()
        if phase not in tasks:
            tasks[phase] = bar.add_task(phase, total=total)
        bar.advance(tasks[phase], n)
    try:
        yield advance
    finally:
        if tasks:
            bar.stop()


@click.command("pack-store")
@click.option("--model", "model_dir", required=True, type=click.Path(),
              help="Hugging Face checkpoint directory, or a GGUF file (or the first part of a split set).")
@click.option("--store", "store_dir", required=True, type=click.Path(file_okay=False),
              help="Store directory to create or replace (staged beside it, published by rename).")
@click.option("--dtype", type=click.Choice(sorted(DTYPES)), default=None, help="Record dtype [default: the checkpoint's].")
@click.option("--order", type=click.Choice(["rows", "cols"]), default="rows", show_default=True,
              help="Record order: rows (the checkpoint's; what the GPU kernels read) or cols (each matrix "
                   "transposed: a CPU one-token GEMV reads it about twice as fast). Serve cols stores on the CPU.")
@click.option("--quant", type=click.Choice(QUANT_FLAGS), default=None,
              help="Record scheme: float32 / bf16 (float records, as --dtype), int8 / int4 (weight-only, group-wise "
                   "along the input, quantized at pack time), gguf (the --gguf file's own expert "
                   "blocks, kept as they are, each matrix in its own GGML type: F32, F16, BF16, Q4_0, Q4_1, Q5_0, "
                   "Q5_1, Q8_0, Q2_K … Q6_K, IQ4_NL, IQ4_XS; a GGUF --model's own) [default: the checkpoint's "
                   "dtype; a GGUF --model: gguf].")
@click.option("--gguf", "gguf_file", default=None, type=click.Path(dir_okay=False),
              help="With --quant gguf: the GGUF file holding this checkpoint's experts.")
@click.option("--readers", type=click.IntRange(1, 256), default=None, help="Threads for the verifying re-read.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def pack_store(model_dir, store_dir, dtype, order, quant, gguf_file, readers, quiet, as_json):
    """Pack a checkpoint's routed experts into one O_DIRECT store file of 4 KiB-aligned records.

    Writes experts.bin + manifest.json (+ manifest.sha256, its own sha256) in a staging directory beside
    STORE, re-reads every record
    with O_DIRECT and checks its sha256, byte-compares a sample with the checkpoint, then publishes
    by rename. An interrupted pack leaves the old store (or none) untouched.
    """
    if quant in FLOAT_QUANTS:
        if dtype and dtype != FLOAT_QUANTS[quant]:
            raise EngineError(f"--quant {quant} and --dtype {dtype} disagree; give one", Exit.USAGE)
        dtype, quant = FLOAT_QUANTS[quant], None
    scheme = quant or "none"
    if scheme != "none" and dtype:
        raise EngineError(f"--dtype {dtype} is for float records; --quant {quant} records are bytes", Exit.USAGE)
    try:
        ck = open_checkpoint(model_dir)
        if quant is None and dtype is None:
            scheme = ck.record_quant()
        layout, _ = record_source(ck, dtype=DTYPES[dtype] if dtype else None, order=order, quant=scheme,
                                  gguf=gguf_file)
    except CheckpointError as e:
        raise EngineError(str(e), Exit.BAD_MODEL) from None
    total = len(plan_offsets(ck.moe_layers, ck.n_experts, layout.record_bytes)) * layout.record_bytes
    try:
        with interrupts.recorded(), _progress(total, ["write", "verify"], quiet) as advance:
            r = pack(ck, store_dir, dtype=None if layout.quantized else layout.dtype, order=order,
                     readers=readers, progress=advance, quant=scheme, gguf=gguf_file)
    except CheckpointError as e:
        raise EngineError(str(e), Exit.BAD_MODEL) from None
    if as_json:
        click.echo(json.dumps({"store": str(r.store), "quant": layout.quant, "records": r.records, "bytes": r.bytes,
                               "write_seconds": r.write_seconds, "write_gbps": r.write_gbps,
                               "verify_seconds": r.verify_seconds, "verify_gbps": r.verify_gbps,
                               "sampled": r.sampled}))
    else:
        click.echo(f"packed {r.records} records ({r.bytes / 1e9:.3f} GB) into {r.store}: "
                   f"write {r.write_gbps:.2f} GB/s, verify {r.verify_gbps:.2f} GB/s, "
                   f"{r.sampled} records byte-compared with the checkpoint")


@click.command("verify-store")
@click.option("--store", "store_dir", required=True, type=click.Path(file_okay=False), help="Store directory.")
@click.option("--model", "model_dir", default=None, type=click.Path(),
              help="Also check the store was packed from this checkpoint or GGUF (config hash).")
@click.option("--gguf", "gguf_path", default=None, type=click.Path(dir_okay=False),
              help="Also check each layer's record types (gate, up, down) against this GGUF's expert tensors.")
@click.option("--readers", type=click.IntRange(1, 256), default=None, help="Reader threads [default: CPUs, 2..8].")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def verify_store(store_dir, model_dir, gguf_path, readers, quiet, as_json):
    """Re-read every store record with O_DIRECT and check its sha256; exit 8 naming each bad record.

    The manifest is checked first and believed only then: its own sha256 (manifest.sha256), every field's
    type and range, and every record exactly where the layer-major order puts it (offset = index x
    record_bytes). A manifest that fails any of it is exit 8 with the reason. A store of per-matrix GGML types
    (quant ggml:G,U,D) has each record's header checked against the manifest's types for its layer (exit 8),
    and with --gguf against the file's expert tensors (exit 3)."""
    m = mf.load(store_dir)
    if model_dir:
        try:
            mf.check_matches(m, open_checkpoint(model_dir), store_dir)
        except CheckpointError as e:
            raise EngineError(str(e), Exit.BAD_MODEL) from None
    if gguf_path:
        check_gguf_types(store_dir, m, gguf_path)
    with _progress(m.total_bytes, ["verify"], quiet) as advance:
        r = verify(store_dir, readers=readers, progress=(lambda n: advance("verify", n)) if advance else None)
    if as_json:
        click.echo(json.dumps({"store": str(r.store), "quant": m.quant, "records": r.records, "bytes": r.bytes, "seconds": r.seconds,
                               "gbps": r.gbps, "bad": [b.__dict__ for b in r.bad]}))
    else:
        for b in r.bad:
            click.echo(f"bad record: {b} (sha256 mismatch)", err=True)
        click.echo(f"verified {r.records} records ({r.bytes / 1e9:.3f} GB) in {r.store}: "
                   f"{r.records - len(r.bad)} ok, {len(r.bad)} bad, {r.gbps:.2f} GB/s")
    if r.bad:
        raise EngineError(f"{r.store}: {len(r.bad)} record(s) fail their sha256 "
                          f"(first: {r.bad[0]})", Exit.INTEGRITY)


def _verify_gguf(path, as_json: bool) -> None:
    import time
    t0 = time.perf_counter()
    m = GgufModel(path)                 # GgufError (exit 3) names what is wrong
    parts = [{"file": str(p), "bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in m.parts]
    quant = m.record_quant()
    layout, _ = record_source(m, quant=quant, order="cols")          # the store pack-store makes by default
    dt = time.perf_counter() - t0
    total = sum(p["bytes"] for p in parts)
    if as_json:
        click.echo(json.dumps({"model": str(m.dir), "architecture": m.gguf_arch, "tensors": len(m.tensors),
                               "bytes": total, "seconds": dt, "parts": parts, "bad": [],
                               "context": m.config["max_position_embeddings"], "moe_layers": len(m.moe_layers),
                               "experts": m.n_experts, "experts_per_token": m.config["num_experts_per_tok"],
                               "upcycled": m.upcycled, "expert_types": sorted(m.expert_types()),
                               "non_expert_elements": m.non_expert_elements(),
                               "store": {"quant": quant if quant == "gguf" else "float32",
                                         "record_bytes": layout.record_bytes,
                                         "records": len(m.moe_layers) * m.n_experts}}))
        return
    for p in parts:
        click.echo(f"{p['sha256']}  {p['file']}")
    click.echo(f"verified {m.dir}: a {m.gguf_arch} model of {len(m.tensors)} tensors in {len(parts)} file(s) "
               f"({total / 1e9:.3f} GB), {dt:.2f} s")


@click.command("verify-model")
@click.option("--model", "model_dir", required=True, type=click.Path(),
              help="A model directory written by `engine convert` or `engine synth`, or a GGUF file.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def verify_model(model_dir, as_json):
    """Re-hash every file of a converted model against the manifest written with it (kiln-files.json);
    exit 8 naming each file that is missing, extra, truncated or changed, or the manifest if it was edited.
    A GGUF file (or split set) is checked whole as a model (every part there, each tensor inside the file,
    of a type Kiln reads and of the shape its metadata says, an architecture and a tokenizer Kiln reads;
    exit 3 naming the first problem) and each part's sha256 is printed, to compare with a recipe's pin."""
    import time

    if is_gguf(model_dir):
        return _verify_gguf(model_dir, as_json)

    t0 = time.perf_counter()
    m = mm.load(model_dir)
    problems = mm.verify(m)
    dt = time.perf_counter() - t0
    total = sum(e.bytes for e in m.files)
    if as_json:
        click.echo(json.dumps({"model": str(m.dir), "files": len(m.files), "bytes": total, "seconds": dt,
                               "manifest_sha256": m.sha256, "bad": [p.__dict__ for p in problems]}))
    else:
        for p in problems:
            click.echo(f"bad file: {p}", err=True)
        click.echo(f"verified {len(m.files)} files ({total / 1e9:.3f} GB) in {m.dir}: "
                   f"{len(m.files) - len(problems)} ok, {len(problems)} bad, {dt:.2f} s")
    if problems:
        raise mm.refusal(m, problems)
