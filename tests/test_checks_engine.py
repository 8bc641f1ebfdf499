"""The gates against Kiln's own engine server (real model code, real tokenizer and chat template,
real uvicorn on 127.0.0.1) on a tiny random checkpoint. A random model cannot answer, so this
checks what does not depend on the answers: load, the token counting through the engine's
/tokenize {messages}, the context band by its real tokenizer, and speed from its usage."""
from __future__ import annotations

import json

import pytest

uvicorn = pytest.importorskip("uvicorn")
from engine.llm import LLM  # noqa: E402
from engine.server.app import create_app  # noqa: E402
from tool.checks.runner import run_gates  # noqa: E402
from tool.recipe_file import parse  # noqa: E402

from tests.fixtures.served import Served  # noqa: E402
from tests.test_checks import IGNORE_HOST  # noqa: E402

WINDOW = 512


@pytest.fixture(scope="module")
def engine_url(tiny_checkpoint):
    with LLM.load(tiny_checkpoint("qwen3_moe"), max_context=WINDOW) as llm, \
            Served(create_app(llm, served_name="tiny-qwen")) as served:
        yield served.url + "/v1"


@pytest.fixture
def recipe(tmp_path, repo_root):
    data = json.loads((repo_root / "recipes/cpu/any/smollm2-135m.kiln.8k.json").read_text())
    data["serve"].update(served_name="tiny-qwen", context=WINDOW)
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return parse(path)


def test_context_band_and_speed_by_the_engines_own_tokenizer(engine_url, recipe):
    e = run_gates(recipe, engine_url, gates=["load", "context", "speed"], seed=5, poll_interval_s=0.05,
                  load_timeout_s=30, speed_window_s=10, prefill_tokens=128, speed_rounds=1,
                  **IGNORE_HOST)    # about token counting, not host load: a busy box must not skip the prefill
    load, ctx, speed = (e["gates"][g] for g in ("load", "context", "speed"))
    assert load["passed"], load["reason"]
    assert e["server"]["models"][0]["id"] == "tiny-qwen"
    assert ctx["token_count_source"] == "/tokenize {messages}"
    # the prompt the engine answered, counted by the engine itself, fills 85 % ± 1 % of the window
    assert 0.84 * WINDOW <= ctx["prompt_tokens"] <= 0.86 * WINDOW, ctx
    assert ctx["prompt_tokens"] == ctx["counted_tokens"]
    assert ctx["passed"] or "lacks the code" in ctx["reason"]          # a random model rarely finds it
    # a stream cut at the window is counted by a {"prompt"} call, and labelled so
    assert speed["completion_tokens_source"] in ("usage.completion_tokens", "/tokenize {prompt}")
    assert speed["decode_tps"] is None or speed["decode_tps"] > 0
    assert speed["prefill_prompt_tokens"] > 100 and speed["prefill_tps"] > 0
