"""Run the selected gates in order, each isolated, and assemble (and write) the evidence.

`run_checks` is the API `tool check` and `tool up` call; `tool up` passes is_alive so the load
wait ends at once, with the reason, when the server it started dies.
"""
from __future__ import annotations

import importlib
import os
import time
import traceback
from datetime import datetime

import tool
from tool.checks import evidence as ev
from tool.checks import hostload
from tool.checks import record as rec
from tool.checks.client import Client
from tool.checks.gate import DEFAULT_LIMITS, GateContext, IsAlive, NullReporter, Reporter, fail, sampling_for, seed_for
from tool.errors import KilnError

GATES = ("load", "chat", "reasoning", "tools", "context", "speed")
_MODULES = {g: f"tool.checks.{g}" for g in GATES}


def plan(recipe, only: list[str] | None = None) -> tuple[list[str], list[str]]:
    """→ (gates to run, in order; the expected ones among them). Recipe checks.gates are expected,
    checks.report_only run but do not decide the verdict; `only` restricts the set."""
    checks = recipe.get("checks") or {}
    expected = checks.get("gates") or list(GATES)
    listed = set(expected) | set(checks.get("report_only") or [])
    if only is not None:
        unknown = [g for g in only if g not in GATES]
        if unknown:
            raise KilnError(f"unknown gate {', '.join(unknown)}; gates are {', '.join(GATES)}", exit_code=2)
        listed = set(only)
    run = [g for g in GATES if g in listed]
    return run, [g for g in run if g in expected]


def limits_for(recipe, overrides: dict) -> dict:
    unknown = set(overrides) - set(DEFAULT_LIMITS)
    if unknown:
        raise TypeError(f"unknown limit(s): {', '.join(sorted(unknown))}")
    checks = recipe.get("checks") or {}
    limits = {**DEFAULT_LIMITS, **{k: v for k, v in overrides.items() if v is not None}}
    if limits["load_timeout_s"] is None:
        limits["load_timeout_s"] = float(checks.get("load_timeout_s", 3600))
    if limits["context_fill"] is None:
        limits["context_fill"] = float(checks.get("context_fill", 0.85))
    if limits["prefill_tokens"] is None:
        limits["prefill_tokens"] = min(8192, int(recipe["serve"]["context"]) // 2)
    if limits["seed"] is None:
        limits["seed"] = seed_for(recipe)
    if limits["sampling"] is None:
        limits["sampling"] = sampling_for(recipe)
    return limits


def run_gates(recipe, endpoint: str, gates: list[str] | None = None, is_alive: IsAlive | None = None,
              reporter: Reporter | None = None, api_key: str | None = None, baseline: dict | None = None,
              **limits) -> dict:
    """Run the gates and return the evidence (not written). baseline: the plan's steps.check.baseline."""
    reporter = reporter or NullReporter()
    selected, expected = plan(recipe, gates)
    lim = limits_for(recipe, limits)
    started = ev.utc_now()
    t0 = time.monotonic()
    results: dict[str, dict] = {}
    with Client(endpoint, api_key=api_key, timeout_s=lim["request_timeout_s"]) as client:
        ctx = GateContext(recipe=recipe, client=client, limits=lim, reporter=reporter, is_alive=is_alive,
                          baseline=baseline)
        for name in selected:
            reporter.gate_started(name)
            first_record = len(client.records)
            g0 = time.monotonic()
            died = ctx.death() if name != "load" else None
            h0 = hostload.snapshot()
            if died:
                result = {"passed": False, "skipped": True, "reason": f"not run: the server died ({died})",
                          "token_source": "none (not run)"}
            else:
                result = _run_one(name, ctx)
            # every gate's evidence says how it asked and how busy this host was meanwhile
            result.setdefault("token_source", "none")
            result["sampling"] = ctx.sampling
            h1 = hostload.snapshot()
            result["host_load"] = {"before": hostload.public(h0), "after": hostload.public(h1),
                                   "during": hostload.between(h0, h1)}
            result["duration_s"] = round(time.monotonic() - g0, 3)
            result["expected"] = name in expected
            result["requests"] = client.records[first_record:]
            results[name] = result
            reporter.gate_finished(name, result)
        server = {"endpoint": endpoint, "served_name": ctx.served_name, "models": ctx.shared.get("models"),
                  "system_fingerprint": ctx.shared.get("system_fingerprint")}
        if "tokens" in ctx.shared:
            server.update(ctx.shared["tokens"].describe())
    failed = [g for g in expected if not results[g]["passed"] and not results[g].get("inconclusive")]
    undecided = [g for g in expected if results[g].get("inconclusive")]
    return {
        "format": ev.FORMAT,
        "kiln_version": getattr(tool, "__version__", None) or _kiln_version(),
        "recipe": {"id": recipe.id, "path": str(recipe.path), "content_hash": recipe.content_hash,
                   "card": (recipe.get("hardware") or {}).get("card"),
                   "served_name": recipe["serve"]["served_name"], "context": recipe["serve"]["context"]},
        "started_at": started.isoformat(timespec="seconds").replace("+00:00", "Z"),
        "duration_s": round(time.monotonic() - t0, 3),
        "limits": lim,
        "host": ev.host_fingerprint(),
        "server": server,
        "expected_gates": expected,
        "report_only_gates": [g for g in selected if g not in expected],
        "gates": results,
        "failed_gates": failed,
        "inconclusive_gates": undecided,
        # a failure outweighs an undecided gate; an undecided one is never a pass
        "verdict": "fail" if failed else ("inconclusive" if undecided else "pass"),
    }


def _run_one(name: str, ctx: GateContext) -> dict:
    """One gate, isolated: whatever it raises becomes its failure reason, never the run's."""
    try:
        result = importlib.import_module(_MODULES[name]).run(ctx)
        if not isinstance(result, dict) or "passed" not in result:
            return fail(f"internal error: gate {name} returned {result!r}")
        return result
    except KeyboardInterrupt:
        raise
    except Exception as e:  # a bug in a gate must not cost the others; the evidence keeps the trace
        return fail(f"internal error in gate {name}: {type(e).__name__}: {e}",
                    traceback=traceback.format_exc(limit=5))


def _kiln_version() -> str | None:
    try:
        from importlib.metadata import version
        return version("kiln")
    except Exception:
        return None


def run_checks(recipe, endpoint: str, gates: list[str] | None = None, is_alive: IsAlive | None = None,
               evidence_dir: str | os.PathLike = "evidence", json_path: str | os.PathLike | None = None,
               record: bool = False, reporter: Reporter | None = None, api_key: str | None = None,
               baseline: dict | None = None, **limits) -> dict:
    """Run the gates, write the evidence (and the proof line with record=True); → the evidence,
    plus "evidence_files" and "evidence_sha256" (where it went; not part of the file itself)."""
    evidence = run_gates(recipe, endpoint, gates, is_alive, reporter, api_key, baseline, **limits)
    when = datetime.fromisoformat(evidence["started_at"].replace("Z", "+00:00"))
    paths, sha = ev.write(evidence, recipe, evidence_dir, json_path, when)
    if record:
        rec.append_proof(recipe.path, rec.proof_line(evidence, sha, ev.gpu_label(evidence["host"])),
                         recipe.content_hash)
    return {**evidence, "evidence_files": [str(p) for p in paths], "evidence_sha256": sha}

