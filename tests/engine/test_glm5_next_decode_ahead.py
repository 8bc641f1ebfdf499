"""Decode ahead on glm5_next, whose KDA layers carry recurrent state: a step launched ahead and then not used (here
a stream stops at a stop id while the others go on) is run again at the same positions, and without
SlotCaches.hold/undo the KDA states of the streams still running would advance twice. Decoding ahead is forced on
for this CPU model (on the CPU a step is synchronous and the engine leaves it off), as tests/engine/test_llm.py
does for the KV-only models."""
from __future__ import annotations

import pytest

from engine.llm import LLM, SamplingParams
from tests.fixtures.callers import stream_together

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def ids(tokens) -> list[int]:
    return [t.id for t in tokens]


def test_a_stream_stopping_beside_others_keeps_their_step_by_step_tokens(tiny_checkpoint, monkeypatch):
    prompts = [[5 + (7 * i + 3 * j) % 290 for j in range(n)] for i, n in enumerate((6, 9, 4))]
    with LLM.load(tiny_checkpoint("glm5_next"), max_context=64, max_batch=3, prefix_cache=False,
                  threads=1) as llm:
        free = ids(llm.generate(prompts[1], SamplingParams(max_tokens=16, ignore_eos=True)))
        at = next(i for i in range(4, 16) if free[i] not in free[:i])       # a stop id first met half way
        params = [SamplingParams(max_tokens=16, ignore_eos=True),
                  SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=(free[at],)),
                  SamplingParams(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True)]
        alone = [ids(llm.generate(p, q)) for p, q in zip(prompts, params)]
        assert len(alone[1]) == at + 1
        monkeypatch.setattr(llm, "_chain", True)
        before = llm.counters()
        got = stream_together(llm, prompts, params, timeout=120)
        after = llm.counters()
        assert after["decode_ahead_steps_total"] > before["decode_ahead_steps_total"]
        assert after["decode_ahead_redone_total"] > before["decode_ahead_redone_total"]   # the case under test
        assert got == alone
