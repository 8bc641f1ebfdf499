"""The speed gate's decode baseline: a reference implementation timed in the same run, the same way.

A recipe's checks.decode_baseline names it (native recipes: the engine program's `reference-decode`,
transformers' own generate); nix/lib compiles it into the plan as steps.check.baseline
{argv, env, label, timeoutSeconds} with Kiln's paths substituted. The gate appends the prompt,
token count and temperature it just timed the server on, runs the command while the server idles,
and reads one JSON object holding decode_tps from the last line of its stdout.
"""
from __future__ import annotations

import json
import os
import subprocess

from tool.errors import last_line


class BaselineError(Exception):
    """The baseline did not give a figure; the message is the gate's one-line reason."""


def from_plan(plan: dict) -> dict | None:
    return ((plan.get("steps") or {}).get("check") or {}).get("baseline")


def resolve(recipe, dirs=None) -> dict | None:
    """The recipe's baseline, compiled by nix/lib for these directories (tool check: from KILN_* / the
    defaults, as the check unit's environment sets them). None when the recipe names none."""
    if not (recipe.get("checks") or {}).get("decode_baseline"):
        return None
    from tool.plan import compile_plan
    from tool.state import Dirs
    return from_plan(compile_plan(recipe, (dirs or Dirs.resolve()).plan_options()))


def measure(baseline: dict, messages: list[dict], tokens: int, temperature: float) -> dict:
    """Run the baseline on this prompt for `tokens` tokens → its JSON (decode_tps, ...) plus label and argv."""
    if "error" in baseline:                  # it could not be resolved (tool check says why)
        raise BaselineError(baseline["error"])
    argv = [*baseline["argv"], "--messages", json.dumps(messages), "--tokens", str(tokens),
            "--temperature", str(temperature)]
    env = {**os.environ, **{k: str(v) for k, v in (baseline.get("env") or {}).items()}}
    timeout = float(baseline.get("timeoutSeconds") or 600)
    label = baseline.get("label") or os.path.basename(argv[0])
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                             stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise BaselineError(f"{argv[0]}: not found") from None
    except subprocess.TimeoutExpired:
        raise BaselineError(f"gave no figure within {timeout:g} s") from None
    if out.returncode:
        raise BaselineError(f"exit {out.returncode}: {last_line(out.stderr if out.stderr.strip() else out.stdout)}")
    try:
        result = json.loads(out.stdout.strip().splitlines()[-1])
        tps = float(result["decode_tps"])
    except (IndexError, ValueError, KeyError, TypeError):
        raise BaselineError(f"no JSON line with decode_tps on its stdout (last line: {last_line(out.stdout)!r})") from None
    if not tps > 0:
        raise BaselineError(f"decode_tps {tps} is not a rate")
    return {**result, "decode_tps": tps, "label": label, "argv": argv[:len(baseline["argv"])]}
