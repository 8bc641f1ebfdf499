"""What every gate gets (GateContext) and gives back (a result dict), plus liveness of a managed server.

A gate is `run(ctx) -> dict` with at least {"passed": bool, "reason": str}; any other keys are
its figures. Gates raise nothing on purpose: ClientError becomes the reason; the runner catches
anything else so one broken gate never stops the others.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Protocol

from tool.checks.client import Client
from tool.checks import tokens

# is_alive() → True while the managed server (unit, container, child process) runs; anything else
# means it died, and a str is the reason (exit code, OOM kill, last log lines).
IsAlive = Callable[[], "bool | str"]

DEFAULT_LIMITS = {
    "load_timeout_s": None,        # None → the recipe's checks.load_timeout_s, else 3600
    "poll_interval_s": 2.0,
    "request_timeout_s": 600.0,
    "answer_max_tokens": 2048,     # chat / reasoning / tools: room for a reasoning model to think
    "context_fill": None,          # None → the recipe's checks.context_fill, else 0.85
    "context_band": 0.01,
    "context_max_iterations": 8,
    "speed_window_s": 30.0,
    "speed_max_tokens": 256,       # per timed round: enough for a steady decode rate, short enough for rounds
    "speed_rounds": 3,             # interleaved server/baseline rounds (tool.checks.speed says why 3)
    "speed_idle_window_s": 2.0,    # the host sampled this long, before and after the rounds
    # when the speed gate says "inconclusive" instead of pass/fail (tool.checks.speed says why these)
    "speed_spread_max": 0.20,      # a side's rounds: (max - min) / median
    "speed_idle_busy_max": 0.25,   # share of all CPUs others use while nothing of ours works
    "speed_pressure_max": 0.20,    # share of a timed round's wall time some task waited for a CPU (PSI)
    "prefill_tokens": None,        # None → min(8192, context / 2)
    "seed": None,                  # the context needle's code and depth; None → derived from the recipe
    "served_name": None,           # None → the recipe's serve.served_name
    "sampling": None,              # None → sampling_for(recipe): greedy unless checks.sampling says otherwise
}

# Greedy unless the recipe says otherwise (checks.sampling): a verdict must not hang on a server's
# default sampling (llama-server's is temperature 0.8, top_k 40; Kiln's demo serves greedily).
GREEDY = {"temperature": 0.0}


def sampling_for(recipe) -> dict:
    """The sampling every gate sends, explicitly, and the evidence records."""
    return {**GREEDY, **((recipe.get("checks") or {}).get("sampling") or {})}


def seed_for(recipe) -> int:
    """A seed that is a function of what is checked (recipe id, served name, window) and nothing else, so a
    report-only result is reproducible run to run; the evidence records it (limits.seed) and --seed
    replays or varies it. Not the content hash: a --record proof line changes that."""
    key = f"{recipe.id}\0{recipe['serve']['served_name']}\0{recipe['serve']['context']}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big")


class Reporter(Protocol):
    def gate_started(self, name: str) -> None: ...
    def progress(self, text: str, completed: float | None = None, total: float | None = None) -> None: ...
    def gate_finished(self, name: str, result: dict) -> None: ...


class NullReporter:
    def gate_started(self, name): pass
    def progress(self, text, completed=None, total=None): pass
    def gate_finished(self, name, result): pass


@dataclass
class GateContext:
    recipe: object                          # tool.recipes.Recipe
    client: Client
    limits: dict
    reporter: Reporter = field(default_factory=NullReporter)
    is_alive: IsAlive | None = None
    shared: dict = field(default_factory=dict)   # found once, used by several gates (token counter, models)
    baseline: dict | None = None                 # the speed gate's reference (tool.checks.baseline), from the plan

    @property
    def served_name(self) -> str:
        return self.limits.get("served_name") or self.recipe["serve"]["served_name"]

    @property
    def sampling(self) -> dict:
        return self.limits["sampling"]

    @property
    def context_window(self) -> int:
        return int(self.recipe["serve"]["context"])

    @property
    def checks(self) -> dict:
        return self.recipe.get("checks") or {}

    def answer_tokens(self) -> int:
        """Room for an answer: the limit, but never more than a quarter of the window (servers
        reject prompt + max_tokens beyond it)."""
        return max(16, min(self.limits["answer_max_tokens"], self.context_window // 4))

    def ask(self, prompt: str):
        """One user question to the served model, with room for an answer (chat, reasoning).
        Raises tool.checks.client.ClientError, which the gate turns into its one-line reason."""
        return self.client.chat(self.body([{"role": "user", "content": prompt}], self.answer_tokens()))

    def body(self, messages: list[dict], max_tokens: int, **more) -> dict:
        """A chat request as every gate sends it: the served name and the explicit sampling."""
        return {"model": self.served_name, "messages": messages, "max_tokens": max_tokens, **self.sampling, **more}

    def death(self) -> str | None:
        """None while the managed server lives (or is not managed); else why it died."""
        if self.is_alive is None:
            return None
        try:
            alive = self.is_alive()
        except Exception as e:   # a broken callback must not hide the server's state as a crash
            return f"liveness check failed: {e}"
        if alive is True:
            return None
        return alive if isinstance(alive, str) and alive else "the server process is no longer running"

    def token_counter(self):
        if "tokens" not in self.shared:
            self.shared["tokens"] = tokens.detect(self.client, self.served_name)
        return self.shared["tokens"]


def fail(reason: str, **figures) -> dict:
    return {"passed": False, "reason": reason, **figures}


def inconclusive(reason: str, **figures) -> dict:
    """Neither pass nor fail: the measurement cannot decide (a busy host, rounds that disagree)."""
    return {"passed": False, "inconclusive": True, "reason": f"inconclusive: {reason}", **figures}


def ok(reason: str, **figures) -> dict:
    return {"passed": True, "reason": reason, **figures}
