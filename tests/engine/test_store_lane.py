"""The store lane's rate the offload benches divide by (engine.measure.store_lane): whole records read with O_DIRECT
from a real file on this disk, a cold pass and a re-read of the same records, each a positive rate; a file shorter
than the records it is said to hold fails the read instead of timing a short one."""
from __future__ import annotations

import math

import pytest

from engine.measure.store_lane import record_read_rates

RECORD = 64 * 1024


def test_record_reads_give_a_cold_and_a_reread_rate(tmp_path):
    f = tmp_path / "experts.bin"
    f.write_bytes(bytes(range(256)) * (RECORD // 256) * 40)             # 40 records
    r = record_read_rates(f, RECORD, 40, threads=4, picks=32)
    assert set(r) == {"disk_odirect_random_1t_gbps", "disk_odirect_random_4t_gbps", "disk_odirect_reread_4t_gbps"}
    assert all(v > 0 and math.isfinite(v) for v in r.values())


def test_a_file_shorter_than_its_records_fails_the_read(tmp_path):
    f = tmp_path / "short.bin"
    f.write_bytes(b"\0" * RECORD * 4)                                    # 4 records, said to be 40
    with pytest.raises(EOFError, match="file ends at"):
        record_read_rates(f, RECORD, 40, threads=2, picks=40)
