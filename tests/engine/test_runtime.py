"""EngineConfig: the runtime knobs checked once where a command builds them, and carried whole to the tiers."""
from __future__ import annotations

import pytest
import torch

from engine.cli import main
from engine.engine_config import EngineConfig
from engine.errors import EngineError, Exit
from engine.llm import LLM
from engine.store.pack import pack_store


@pytest.mark.parametrize("knobs,message", [
    ({"device": "tpu"}, "device tpu is not supported (cpu or cuda)"),
    ({"dtype": "int8"}, "dtype 'int8' is not supported (float32, bfloat16, float16)"),
    ({"max_batch": 0}, "max_batch 0 must be at least 1"),
    ({"ram_slots": -1}, "ram_slots is -1; it must be 0 or more"),
    ({"readers": 0}, "readers is 0; it must be at least 1"),
    ({"threads": 0}, "threads is 0; it must be at least 1"),
    ({"cpu_experts": "maybe"}, "cpu_experts 'maybe' is not one of auto, on, off"),
    ({"lane_rates": "pcie=fast"}, "lane rate 'pcie=fast' is not LANE=GB/s with LANE one of pcie, cpu, disk and a "
                                  "positive finite rate (e.g. pcie=25)"),
    ({"lane_rates": "pcie=25,nvlink=900"}, "lane rate 'nvlink=900' is not LANE=GB/s with LANE one of pcie, cpu, "
                                           "disk and a positive finite rate (e.g. pcie=25)"),
    ({"lane_rates": "cpu=0"}, "lane rate 'cpu=0' is not LANE=GB/s with LANE one of pcie, cpu, disk and a "
                              "positive finite rate (e.g. pcie=25)"),
    ({"lane_rates": "disk=nan"}, "lane rate 'disk=nan' is not LANE=GB/s with LANE one of pcie, cpu, disk and a "
                                 "positive finite rate (e.g. pcie=25)"),
])
def test_a_bad_knob_is_refused_by_name(knobs, message):
    with pytest.raises(ValueError) as e:
        EngineConfig(**knobs)
    assert str(e.value) == message


@pytest.mark.parametrize("knobs,message", [
    ({"chunk_size": 0}, "chunk_size 0 must be at least 1"),
    ({"max_queue": -1}, "max_queue -1 must be >= 0"),
])
def test_a_bad_scheduler_knob_is_refused_by_name(knobs, message):
    """The scheduler's knobs are EngineConfig's too, checked where the others are."""
    with pytest.raises(ValueError) as e:
        EngineConfig(**knobs)
    assert str(e.value) == message


def test_the_scheduler_takes_its_knobs_from_the_config(tiny_checkpoint):
    """chunk_size from the config, max_queue left to its default: 4 x max_batch (tests/engine/test_llm.py gives
    one and sees it refuse)."""
    with LLM.load(tiny_checkpoint("qwen3_moe", layers=2), config=EngineConfig(max_context=32, max_batch=2,
                                                                            chunk_size=4)) as llm:
        assert (llm.chunk_size, llm.max_queue, llm.max_batch) == (4, 8, 2)


def test_a_bad_cpu_layout_is_a_usage_error_at_construction():
    with pytest.raises(EngineError, match="--cpu-layout: 'readers' is not NAME=CPULIST") as e:
        EngineConfig(cpu_layout="readers")
    assert e.value.exit_code is Exit.USAGE


def test_torch_spellings_are_taken_as_names():
    c = EngineConfig(device=torch.device("cuda", 1), dtype=torch.bfloat16)
    assert (c.device, c.dtype, c.device_kind) == ("cuda:1", "bfloat16", "cuda")


def test_a_config_and_keyword_knobs_together_are_refused():
    assert EngineConfig.of(None, max_batch=2) == EngineConfig(max_batch=2)
    with pytest.raises(TypeError, match=r"not both \(got max_batch\)"):
        EngineConfig.of(EngineConfig(), max_batch=2)


def test_the_config_reaches_the_tiers_whole(tiny_checkpoint, tmp_path):
    ck = tiny_checkpoint("qwen3_moe", layers=2)
    store = tmp_path / "store"
    pack_store(ck, store, order="cols")
    config = EngineConfig(max_context=32, max_batch=2, ram_slots=3, readers=1, policy="lfu", threads=1)
    with LLM.load(ck, store, config) as llm:
        counters = llm.model.provider.counters()
        assert counters["policy"] == "lfu" and counters["tiers"]["ram"]["slots"] == 3
        assert llm.max_context == 32 and llm.model.kv.slots == 2


def test_lane_rates_parse_as_gb_per_second():
    from engine.engine_config import parse_lane_rates
    assert parse_lane_rates("pcie=25, cpu=12.5;disk=6") == {"pcie": 25.0, "cpu": 12.5, "disk": 6.0}
    assert parse_lane_rates(None) == {} == parse_lane_rates("")


def test_serve_refuses_a_bad_lane_rate_in_one_line(tiny_checkpoint, capsys):
    rc = main(["serve", "--model", str(tiny_checkpoint("qwen3_moe", layers=2)), "--lane-rates", "pcie=-1",
               "--port", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "lane rate 'pcie=-1'" in err


def test_serve_refuses_a_bad_knob_in_one_line_before_it_binds(tiny_checkpoint, capsys):
    rc = main(["serve", "--model", str(tiny_checkpoint("qwen3_moe", layers=2)), "--device", "tpu", "--port", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and err == "engine: device tpu is not supported (cpu or cuda)\n"
