"""`tool up` / `tool down` / `tool status`: a recipe from nothing to a checked, running server, and back.

Progress lines on stderr; the report (steps table, gates table) on stdout; --json writes the report.
"""
from __future__ import annotations

import json
import signal

import sys

import click
from rich import box
from rich.console import Console
from rich.table import Table

from tool import programs
from tool.cli import options
from tool.cli.plan import fleet_options, options_from
from tool.errors import Exit, KilnError, interrupt
from tool.fleet import answers, first_silent, parse_peer
from tool.atomic import write_json
from tool.fetch import Progress
from tool.pids import pid_alive
from tool.run_record import RunRecord
from tool.runners import foreground, systemd
from tool.state import Dirs


def steps_table(report: dict) -> Table:
    t = Table(box=box.SIMPLE_HEAD, title=f"tool up {report['recipe']} ({report['runner']})")
    t.add_column("step", no_wrap=True)
    t.add_column("status", no_wrap=True)
    t.add_column("seconds", justify="right", no_wrap=True)
    t.add_column("detail", overflow="fold")
    for name, s in report["steps"].items():
        t.add_row(name, s["status"], f"{s['seconds']:.1f}", s["detail"])
    return t


def _write_report(path, report: dict) -> None:
    if path == "-":
        click.echo(json.dumps(report, indent=2))
    elif path:
        write_json(path, report)


@click.command("up")
@click.argument("recipe")
@click.option("--runner", type=click.Choice(["foreground", "systemd"]), default="foreground", show_default=True,
              help="foreground: a child process with the limits this host allows; systemd: the plan's units.")
@click.option("--once", is_flag=True, help="Stop the server after the checks and exit with their verdict.")
@click.option("--json", "json_path", metavar="PATH", help="Write the report (steps, check evidence, engine counters) here.")
@click.option("--port", type=click.IntRange(1, 65535), help="Serve on this port (default: the recipe's).")
@options.gates
@click.option("--load-timeout", type=float, metavar="S", help="Override the recipe's load limit, seconds.")
@click.option("--engine-bin", metavar="PATH", help="The program a native serve step runs (default: the `engine` beside this Python).")
@fleet_options
@options.dirs
def up(recipe, runner, once, json_path, port, gates, load_timeout, engine_bin, state_dir, models_dir, store_dir,
       **fleet):
    """Preflight, (pull the image by digest,) fetch, prepare, verify, start, wait until ready, run the checks,
    report. Steps whose result is published and verifies are skipped, so `tool up` after an interruption
    resumes. Without --once the server keeps running (`tool down RECIPE` stops it).

    A fleet recipe runs one host per `tool up --host NAME`: a worker starts its rpc-server (or Ray node) on its
    fleet address; the head waits for every worker (naming one that does not answer), serves, and checks
    (`tool down RECIPE-NAME` stops a worker).

    Exit codes: 0 every expected gate passed, 1 preflight no-go / a gate failed / a step failed, 3 bad recipe,
    4 a program is missing, 5 not writable, 6 filesystem refused, 7 unreachable, 8 integrity (hash or digest
    mismatch, tampered store), 75 inconclusive (no gate failed, but one could not decide, e.g. the speed gate
    on a busy host: the last line names it and why), 130 interrupted (the server this run started is stopped).
    """
    if engine_bin:                       # every step of this run (prepare, verify, serve) uses it
        programs.use("engine", engine_bin)
    from tool.cli.check import RichReporter, results_table, verdict_line  # requests, rich: not at the CLI's start
    from tool.recipes import load as load_recipe  # jsonschema: not at the CLI's start
    from tool.up import Options, Up  # requests: not at the CLI's start

    err = Console(stderr=True, highlight=False, soft_wrap=True)
    r = load_recipe(recipe)
    run = Up(r, Dirs.resolve(state_dir, models_dir, store_dir),
             Options(runner=runner, once=once, port=port, gates=gates, load_timeout_s=load_timeout,
                     fleet=options_from(fleet)),
             say=lambda line: err.print(line, markup=False), reporter=RichReporter(err), progress=Progress())
    signal.signal(signal.SIGTERM, interrupt)       # `kill`/a unit stop: stop the server as Ctrl-C would
    try:
        report = run.run()
    except BaseException:
        _write_report(json_path, run.report.as_dict())
        raise
    data = report.as_dict()
    _write_report(json_path, data)
    # Tables are data: where stdout is not a terminal (CI, make demo | tee) give them room, as tool check does.
    out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
    out.print(steps_table(data))
    if report.checks:
        out.print(results_table(report.checks))
        files = report.checks.get("evidence_files") or []
        out.print(verdict_line(report.checks), markup=False)
        out.print(f"evidence: {', '.join(files)}", markup=False)
    if report.engine:
        out.print("engine: " + ", ".join(f"{k}={v}" for k, v in report.engine.items()), markup=False)
    if report.running:
        out.print(f"running: {report.endpoint} (log {report.log}); `tool down {report.run_id or r.id}` stops it",
                  markup=False)
    if report.verdict != "pass":
        load = (report.checks or {}).get("gates", {}).get("load") or {}
        if load and not load.get("passed"):
            from tool.checks.liveness import log_tail  # requests: not at the CLI's start
            reason = load.get("reason", "")
            tail = "" if "last log lines" in reason or not report.log else \
                "; last log lines: " + " | ".join(log_tail(report.log, 20))
            raise KilnError(f"load: {reason}{tail}", Exit.FAILED)
        raise verdict_error(r.id, report.checks or {}, report.verdict)


def verdict_error(rid: str, checks: dict, verdict: str) -> KilnError:
    """The one line a verdict other than pass ends with: the failed gates (exit 1), else the undecided ones,
    each with its reason (exit 75: nothing failed, so a demo that ends here has done its job)."""
    failed, undecided = checks.get("failed_gates") or [], checks.get("inconclusive_gates") or []
    if failed:
        return KilnError(f"{rid}: gate{'s' if len(failed) > 1 else ''} {', '.join(failed)} failed", Exit.FAILED)
    if undecided:
        why = "; ".join(f"{g}: {checks['gates'][g]['reason'].removeprefix('inconclusive: ')}" for g in undecided)
        return KilnError(f"{rid}: inconclusive, nothing failed: {why}", Exit.INCONCLUSIVE)
    return KilnError(f"{rid}: verdict {verdict}", Exit.FAILED)


@click.command("down")
@click.argument("recipe")
@click.option("--timeout", type=float, default=30, show_default=True, help="Seconds between SIGTERM and SIGKILL.")
@options.dirs
def down(recipe, timeout, state_dir, models_dir, store_dir):
    """Stop RECIPE's server started by `tool up` (SIGTERM, then SIGKILL; a container: docker stop)."""

    dirs = Dirs.resolve(state_dir, models_dir, store_dir)
    rid = recipe if RunRecord.load(dirs.run, recipe) else _recipe_id(recipe)
    rec = RunRecord.load(dirs.run, rid)
    if rec is None:
        raise KilnError(f"{rid}: not running (no {RunRecord.path(dirs.run, rid)})", Exit.FAILED)
    how = systemd.stop(rec) if rec.runner == "systemd" else foreground.stop(rec, timeout)
    rec.forget(dirs.run)
    click.echo(f"{rid}: {how}")


def _recipe_id(ref: str) -> str:
    from tool.recipes import load as load_recipe  # jsonschema: not at the CLI's start
    return load_recipe(ref).id


def _health(endpoint: str) -> str:
    if endpoint.startswith("tcp://"):            # a fleet worker: no HTTP, its fleet port answers or not
        why = answers(parse_peer(f"worker={endpoint.removeprefix('tcp://')}"))
        return "answers" if why is None else f"no answer ({why})"
    import requests
    base = endpoint.removesuffix("/v1")
    try:
        r = requests.get(f"{base}/health", timeout=2)
    except requests.RequestException as e:
        return f"no answer ({type(e).__name__})"
    return f"{r.status_code}"


def _fleet_health(rec) -> str:
    """A fleet head's workers: '' while every one answers, else the first that does not, named."""
    workers = [parse_peer(w) for w in (rec.extra or {}).get("fleet_workers", [])]
    silent = first_silent(workers) if workers else None
    return "" if silent is None else f"; fleet worker {silent[0]} does not answer ({silent[1]})"


@click.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
@options.dirs
def status(as_json, state_dir, models_dir, store_dir):
    """List the servers `tool up` started: runner, pid (alive?), endpoint, and whether /health answers."""

    dirs = Dirs.resolve(state_dir, models_dir, store_dir)
    rows = []
    for rec in RunRecord.all(dirs.run):
        alive = pid_alive(rec.pid) if rec.runner == "foreground" else None
        rows.append({"id": rec.id, "runner": rec.runner, "runtime": rec.runtime, "pid": rec.pid, "alive": alive,
                     "endpoint": rec.endpoint, "health": _health(rec.endpoint) + _fleet_health(rec),
                     "container": rec.container,
                     "unit": rec.unit, "log": rec.log, "started_at": rec.started_at})
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("nothing runs")
        return
    t = Table(box=box.SIMPLE_HEAD)
    for c in ("id", "runner", "pid", "alive", "endpoint", "health"):
        t.add_column(c, no_wrap=True)
    for row in rows:
        t.add_row(row["id"], row["runner"], str(row["pid"] or "-"), {True: "yes", False: "no", None: "-"}[row["alive"]],
                  row["endpoint"], row["health"])
    Console(highlight=False).print(t)
