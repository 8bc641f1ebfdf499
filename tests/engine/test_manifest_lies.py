"""`engine verify-store` against lying manifests, on a real O_DIRECT store packed from a tiny checkpoint.

Each lie is written twice over where it matters: once as an edit (the manifest's sidecar sha256 no longer
agrees: found before anything is parsed) and once with the sidecar rewritten to match, so the structure
checks are shown to find it on their own. Every failure is one line on stderr and exit 8 (integrity).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from engine.cli import main
from engine.store import manifest as mf
from engine.store import manifest_file
from tests.engine.test_store import ckpt, store  # noqa: F401 (fixtures: a freshly packed 24-record store)

RECORDS = 24                                   # tiny qwen3_moe: 3 MoE layers x 8 experts


def raw(store: Path) -> dict:
    return json.loads((store / "manifest.json").read_text())


def lie(store: Path, doc, *, sidecar: bool = True) -> None:
    """Replace the manifest; with `sidecar`, its sha256 sidecar too (a liar who knows the format)."""
    text = doc if isinstance(doc, bytes) else (json.dumps(doc) + "\n").encode()
    (store / "manifest.json").write_bytes(text)
    if sidecar:
        (store / "manifest.sha256").write_text(f"{hashlib.sha256(text).hexdigest()}  manifest.json\n")


def verify(store: Path, capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["verify-store", "-q", "--store", str(store)])
    out, err = capsys.readouterr()
    return rc, out, err


def refused(store: Path, capsys, *needles: str) -> str:
    rc, out, err = verify(store, capsys)
    assert rc == 8, (rc, out, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"engine: {store / 'manifest.json'}: "), err
    for n in needles:
        assert n in err, (n, err)
    return err


def flip_byte(store: Path, offset: int) -> None:
    with open(store / "experts.bin", "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def test_an_honest_rewrite_still_verifies(store, capsys):
    """The harness itself: a manifest rewritten as it was (with its sidecar) passes, so the failures below are
    the lies and not the rewriting."""
    lie(store, raw(store))
    rc, out, err = verify(store, capsys)
    assert rc == 0 and f"{RECORDS} ok, 0 bad" in out, err


def test_verify_store_json_names_the_records_quant(store, capsys):
    """--json reports the manifest's record kind (it named an undefined variable: a NameError traceback)."""
    capsys.readouterr()
    rc = main(["verify-store", "-q", "--json", "--store", str(store)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    doc = json.loads(out)
    assert (doc["quant"], doc["records"], doc["bad"]) == (raw(store).get("quant", "none"), RECORDS, [])


def test_any_edit_is_found_by_the_manifests_own_sha256(store, capsys):
    doc = raw(store)
    doc["created"] = "2020-01-01T00:00:00+00:00"        # harmless-looking, still an edit
    lie(store, doc, sidecar=False)
    refused(store, capsys, "is not the", "recorded in manifest.sha256 (edited after it was written")
    (store / "manifest.sha256").unlink()
    rc, _, err = verify(store, capsys)
    assert rc == 8 and err.count("\n") == 1 and "manifest.sha256: missing, so nothing proves manifest.json" in err


def test_records_swapped_in_the_data_with_their_hashes_swapped_too(store, capsys):
    """Layer 0's and layer 1's expert 3 exchanged in experts.bin and their sha256 exchanged in the manifest:
    every record hashes right, the engine would compute with the wrong layer's weights. Only the manifest's
    own hash can tell (with the sidecar rewritten too, `tool prepare`'s marker does: tests/test_prepare.py)."""
    m = mf.load(store)
    a, b = m.record(0, 3), m.record(1, 3)
    with open(store / "experts.bin", "r+b") as f:
        f.seek(a.offset)
        da = f.read(m.record_bytes)
        f.seek(b.offset)
        db = f.read(m.record_bytes)
        f.seek(a.offset)
        f.write(db)
        f.seek(b.offset)
        f.write(da)
    doc = raw(store)
    ia, ib = m.records.index(a), m.records.index(b)
    doc["records"][ia][3], doc["records"][ib][3] = doc["records"][ib][3], doc["records"][ia][3]
    lie(store, doc, sidecar=False)
    refused(store, capsys, "(edited after it was written")


def test_two_layers_records_swapped_in_the_manifest(store, capsys):
    """Rows of layer 0 and layer 1 exchanged with their offsets and hashes: every hash still matches the bytes
    at its offset, but (layer, expert) would be read from the other layer's place."""
    doc = raw(store)
    doc["records"][0], doc["records"][8] = doc["records"][8], doc["records"][0]
    lie(store, doc)
    refused(store, capsys, "record 0 is layer 1 expert 0 at offset", "out of the documented order",
            "record 0 must be layer 0 expert 0 at offset 0")


def test_keys_swapped_between_rows(store, capsys):
    doc = raw(store)
    doc["records"][2][1], doc["records"][5][1] = 5, 2       # experts 2 and 5 of layer 0 named the other's
    lie(store, doc)
    refused(store, capsys, "record 2 is layer 0 expert 5", "must be layer 0 expert 2")


def test_a_duplicate_offset_hiding_a_corrupted_record(store, capsys):
    """Record 5 pointed at record 4's bytes (and hash): today's verify reads record 4 twice and never looks at
    record 5, which is corrupted."""
    rb = raw(store)["record_bytes"]
    flip_byte(store, 5 * rb + 123)
    doc = raw(store)
    doc["records"][5][2], doc["records"][5][3] = doc["records"][4][2], doc["records"][4][3]
    lie(store, doc)
    refused(store, capsys, f"record 5 is layer 0 expert 5 at offset {4 * rb}", f"at offset {5 * rb}")


def test_duplicate_layer_expert_keys(store, capsys):
    doc = raw(store)
    doc["records"][7][1] = 6                              # two rows say layer 0 expert 6, none says expert 7
    lie(store, doc)
    refused(store, capsys, "record 7 is layer 0 expert 6", "must be layer 0 expert 7")


def test_order_flipped_rows_to_cols(store, capsys):
    """A rows store relabelled cols: same sizes, same hashes, every matrix read transposed. Only an edit."""
    doc = raw(store)
    assert doc["order"] == "rows"
    doc["order"] = "cols"
    lie(store, doc, sidecar=False)
    refused(store, capsys, "(edited after it was written")


@pytest.mark.parametrize("name,offset,why", [
    ("misaligned", lambda rb: 3 * rb + 512, "is not a multiple of 4096"),
    ("negative", lambda rb: -rb, "is negative"),
    ("out-of-file", lambda rb: RECORDS * rb, "runs past the end of experts.bin"),
    ("far-out-of-file", lambda rb: 1 << 60, "runs past the end of experts.bin"),
])
def test_bad_offsets_are_integrity_failures_not_thread_tracebacks(store, capsys, name, offset, why):
    doc = raw(store)
    rb = doc["record_bytes"]
    doc["records"][3][2] = offset(rb)
    lie(store, doc)
    refused(store, capsys, f"record 3 is layer 0 expert 3 at offset {offset(rb)}: offset", why)


@pytest.mark.parametrize("field,value,why", [
    ("hidden", True, "hidden: bool True, not an integer"),
    ("experts_per_layer", 8.0, "experts_per_layer: float 8.0, not an integer"),
    ("record_bytes", "4096", "record_bytes: str '4096', not an integer"),
    ("dtype", 16, "dtype: int 16, not a string"),
    ("moe_layers", [0, 0, 1], "moe_layers: not strictly ascending"),
    ("moe_layers", [0, 1, 2.0], "moe_layers: holds 2.0, not a layer number"),
    ("config_hash", "ABC", "config_hash: 'ABC' is not [0-9a-f]{64}"),
    ("records", {"0": []}, "records: dict, not a list"),
    ("experts_per_layer", 1 << 40, "experts_per_layer: 1099511627776 is outside 1..65536"),
])
def test_field_types_are_exact(store, capsys, field, value, why):
    doc = raw(store)
    doc[field] = value
    lie(store, doc)
    refused(store, capsys, "garbled (", why)


@pytest.mark.parametrize("row,why", [
    ([0, 0, 0], "record 0 is [0, 0, 0], not [layer, expert, offset, sha256]"),
    ([0, False, 0, "0" * 64], "record 0's expert is bool False, not an integer"),
    ([0, 0, 0.0, "0" * 64], "record 0's offset is float 0.0, not an integer"),
    ([0, 0, 0, "Z" * 64], "record 0's sha256 is 'ZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZ..., not 64 lowercase hex"),
    ("row", "record 0 is 'row', not [layer"),
])
def test_record_rows_are_exact(store, capsys, row, why):
    doc = raw(store)
    doc["records"][0] = row
    lie(store, doc)
    refused(store, capsys, why)


def test_missing_extra_unknown_and_duplicate_fields(store, capsys):
    honest = raw(store)
    doc = dict(honest)
    del doc["hidden"]
    lie(store, doc)
    refused(store, capsys, "garbled (no hidden;")

    lie(store, honest | {"trust_me": True})
    refused(store, capsys, "garbled (unknown field 'trust_me';")

    text = json.dumps(honest)
    lie(store, (text[:-1] + ', "records": []}').encode())        # JSON keeps the last "records"
    refused(store, capsys, "garbled (key 'records' appears twice in one object;")

    doc = json.loads(text)
    doc["records"].append(doc["records"][-1])
    lie(store, doc)
    refused(store, capsys, f"{RECORDS + 1} records for 3 layers x 8 experts")


def test_too_many_records_is_refused_before_anything_is_built(store, capsys):
    doc = raw(store)
    doc["moe_layers"] = list(range(60000))
    doc["experts_per_layer"] = 60000
    lie(store, doc)
    refused(store, capsys, "60000 layers x 60000 experts is more than 1048576 records")


def test_deep_nesting_is_one_line(store, capsys):
    doc = raw(store)
    lie(store, b"[" * 200_000 + b"]" * 200_000)
    refused(store, capsys, "garbled (nested deeper than JSON parsing allows")
    doc["created"] = 0
    text = json.dumps(doc).replace('"created": 0', '"created": ' + "[" * 50_000 + "]" * 50_000)
    lie(store, text.encode())
    refused(store, capsys, "garbled (nested deeper than JSON parsing allows")


def test_a_5000_digit_integer_is_one_line(store, capsys):
    text = json.dumps(raw(store))
    total = json.loads(text)["total_bytes"]
    lie(store, text.replace(f'"total_bytes": {total}', '"total_bytes": ' + "9" * 5000).encode())
    refused(store, capsys, "garbled (an integer of 5000 digits (at most 20)")


@pytest.mark.parametrize("text,why", [
    (b'{"format_version": NaN}', "NaN is not a number a manifest holds"),
    (b"\xff\xfe not utf-8", "not UTF-8 at byte 0"),
    (b'["a list"]', "a JSON list, not an object"),
])
def test_other_garbage_is_one_line(store, capsys, text, why):
    lie(store, text)
    refused(store, capsys, why)


def test_a_huge_manifest_is_refused_unread(store, capsys, monkeypatch):
    monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", 1000)
    refused(store, capsys, "larger than 1000 bytes, more than any manifest this engine writes")


def test_the_sidecar_is_sha256sums_own_format(store):
    """`sha256sum -c manifest.sha256` checks the manifest with nothing but coreutils."""
    import subprocess
    r = subprocess.run(["sha256sum", "-c", "manifest.sha256"], cwd=store, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "manifest.json: OK", r
    assert mf.load(store).sha256 == hashlib.sha256((store / "manifest.json").read_bytes()).hexdigest()
    assert manifest_file.sidecar_of(store / "manifest.json").name == mf.SIDECAR
