"""`tool check RECIPE --endpoint URL`: the six acceptance gates against any OpenAI-compatible server.

Data on stdout (the results table, or the evidence JSON with --json -); progress on stderr.
Exit 0 iff every gate the recipe expects passed; 1 (Exit.FAILED) when one failed; 75 (Exit.INCONCLUSIVE)
when none failed but one could not decide (the speed gate on a busy host, or a stream whose timings were
lost): the table and the verdict line name it and say why.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time

import click
from rich import box
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from tool.checks.llama_cpp import DEFAULT_BIN as DEFAULT_LLAMA_SERVER   # what scripts/build-llama-cpp.sh builds
from tool.cli import options
from tool.errors import Exit, KilnError
from tool.checks.baseline import llama_cpp_spec, resolve
from tool.checks.runner import run_checks
from tool.state import Dirs


class RichReporter:
    """Live progress on stderr for the long gates (load wait, context fill, speed), one line per gate."""

    def __init__(self, console: Console, plain_every_s: float = 30.0):
        self.console = console
        self._live: Progress | None = None
        self._task = None
        self._plain_every_s, self._plain_last = plain_every_s, 0.0

    def gate_started(self, name):
        if not self.console.is_terminal:     # a log file gets the result lines only
            return
        self._live = Progress(SpinnerColumn(), TextColumn(f"[bold]{name}[/] {{task.description}}"),
                              BarColumn(), TimeElapsedColumn(), console=self.console, transient=True)
        self._task = self._live.add_task("", total=None)
        self._live.start()

    def progress(self, text, completed=None, total=None):
        if self._live is not None:
            self._live.update(self._task, description=text, completed=completed or 0, total=total)
        elif time.monotonic() - self._plain_last >= self._plain_every_s:   # a log: a line now and then
            self._plain_last = time.monotonic()
            self.console.print(f"… {text}", highlight=False, soft_wrap=True)

    def gate_finished(self, name, result):
        if self._live is not None:
            self._live.stop()
        self._live = self._task = None
        mark = "[green]✓[/]" if result["passed"] else (
            "[yellow]-[/]" if result.get("skipped") else "[yellow]?[/]" if result.get("inconclusive") else "[red]✗[/]")
        self.console.print(f"{mark} {name}: {result['reason']}", highlight=False, soft_wrap=True)


def figure(name: str, r: dict) -> str:
    """The one figure per gate the table shows."""
    def num(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "–"
    if name == "load":
        return f"ready {num(r.get('ready_s'), '.1f')} s" if r.get("passed") else f"waited {num(r.get('waited_s'), '.1f')} s"
    if name == "chat":
        return f"finish {r.get('finish_reason') or '–'}"
    if name == "reasoning":
        return f"{num(r.get('reasoning_chars'), 'd')} chars thinking"
    if name == "tools":
        return f"finish {r.get('finish_reason') or r.get('first_finish_reason') or '–'}"
    if name == "context":
        frac = r.get("fill_fraction")
        return f"{frac:.1%} of {r.get('window', 0):,}" if isinstance(frac, float) else "–"
    if name == "speed":
        vs = f" · {r['vs_baseline']:.2f}× baseline" if isinstance(r.get("vs_baseline"), (int, float)) else ""
        # ± half the rounds' range (decode_spread is the whole range over the median)
        spread = f"±{r['decode_spread'] / 2:.0%}" if isinstance(r.get("decode_spread"), float) else ""
        return (f"decode {num(r.get('decode_tps'), '.1f')}{spread} · prefill {num(r.get('prefill_tps'), ',.0f')} tok/s"
                f" · TTFT {num(r.get('ttft_s'), '.2f')} s{vs}")
    return ""


def results_table(evidence: dict) -> Table:
    t = Table(box=box.SIMPLE_HEAD, title=f"{evidence['recipe']['id']} @ {evidence['server']['endpoint']}")
    t.add_column("gate", no_wrap=True)
    t.add_column("result", no_wrap=True)
    t.add_column("reason", overflow="fold")
    t.add_column("figure", no_wrap=True)
    for name, r in evidence["gates"].items():
        result = "pass" if r["passed"] else (
            "skip" if r.get("skipped") else "inconclusive" if r.get("inconclusive") else "FAIL")
        if not r.get("expected"):
            result += " (report only)"
        t.add_row(name, result, r["reason"], figure(name, r))
    return t


def verdict_line(evidence: dict) -> str:
    """`verdict: …` as `tool check` and `tool up` print it: how many expected gates passed, which were undecided."""
    expected = evidence["expected_gates"]
    passed = [g for g in expected if evidence["gates"][g]["passed"]]
    undecided = evidence.get("inconclusive_gates") or []
    more = f"; inconclusive: {', '.join(undecided)}" if undecided else ""
    return f"verdict: {evidence['verdict']} ({len(passed)}/{len(expected)} expected gates passed{more})"


def verdict_exit(evidence: dict) -> Exit:
    """The verdict's exit code: a failure outweighs an undecided gate, and an undecided one is never a pass."""
    return {"pass": Exit.OK, "inconclusive": Exit.INCONCLUSIVE}.get(evidence["verdict"], Exit.FAILED)


def _baseline(recipe) -> dict | None:
    """The recipe's decode baseline with Kiln's paths filled in: $KILN_DECODE_BASELINE (the check unit's, as
    nix/lib compiled it), else the plan compiled here for KILN_* or the defaults. A broken
    $KILN_DECODE_BASELINE fails the speed gate saying why; a plan that cannot be compiled on this machine
    makes the baseline "not run"; the other gates run either way."""
    if env := os.environ.get("KILN_DECODE_BASELINE"):
        try:
            return json.loads(env)
        except ValueError as e:
            return {"error": f"$KILN_DECODE_BASELINE is not JSON ({e})"}
    try:
        return resolve(recipe)
    except KilnError as e:
        return {"unavailable": f"it needs {recipe.id}'s compiled plan, which this machine cannot give: {e}"}




def _llama_cpp_baseline(recipe, server_bin: str | None, gguf: str | None) -> dict:
    """--baseline llama.cpp: its llama-server on the recipe's GGUF where this host keeps it (or --baseline-gguf)."""
    from pathlib import Path
    if gguf is None:
        w = recipe.get("weights") or {}
        name = Path(w.get("file") or "").name
        if name.endswith(".gguf") and w.get("dirname"):
            gguf = str(Dirs.resolve().models / w["dirname"] / name)
    server_bin = server_bin or os.environ.get("KILN_LLAMA_SERVER") or \
        (DEFAULT_LLAMA_SERVER if os.path.exists(DEFAULT_LLAMA_SERVER) else None)
    return llama_cpp_spec(server_bin, gguf)


@click.command("check")
@click.argument("recipe")
@click.option("--endpoint", required=True, metavar="URL", help="The server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1.")
@click.option("--served-name", metavar="NAME",
              help="The model name the server serves (what its /v1/models lists); default: the recipe's.")
@options.gates
@click.option("--json", "json_path", metavar="PATH", help="Also write the evidence JSON here ('-': print it instead of the table).")
@click.option("--record", is_flag=True, help="Append a proof line to the recipe file.")
@click.option("--evidence-dir", default="evidence", show_default=True, type=click.Path(file_okay=False),
              help="Where the evidence file goes.")
@click.option("--load-timeout", type=float, metavar="S", help="Override the recipe's load limit, seconds.")
@click.option("--speed-window", type=float, metavar="S", help="Decode timing window, seconds (default 30).")
@click.option("--seed", type=int,
              help="Seed for the context needle's code and depth (default: derived from the recipe; the evidence keeps it).")
@click.option("--api-key", envvar="KILN_API_KEY", help="Bearer token for the server [env KILN_API_KEY].")
@click.option("--baseline", "baseline_kind", type=click.Choice(["recipe", "llama.cpp", "none"]), default="recipe",
              show_default=True,
              help="What the speed gate must beat: the recipe's checks.decode_baseline, llama.cpp's llama-server on "
                   "the same GGUF, or nothing (the floor only). One that cannot run here is reported as not run.")
@click.option("--llama-server", metavar="PATH",
              help=f"llama-server for --baseline llama.cpp [env KILN_LLAMA_SERVER; default {DEFAULT_LLAMA_SERVER}].")
@click.option("--baseline-gguf", metavar="FILE",
              help="The GGUF for --baseline llama.cpp (default: the recipe's weights where this host keeps them).")
@click.option("--no-baseline", is_flag=True, help="The same as --baseline none.")
def check(recipe, endpoint, served_name, gates, json_path, record, evidence_dir, load_timeout, speed_window, seed,
          api_key, baseline_kind, llama_server, baseline_gguf, no_baseline):
    """Run the acceptance gates of RECIPE (an id or a file) against the server at --endpoint.

    Exit 0 when every expected gate passed; 1 when one failed; 75 when none failed but one was
    inconclusive (the speed gate on a busy host, with rounds that disagree, or on a stream whose timings
    were lost: the table says which, the evidence says why).
    """
    from tool.recipes import load  # jsonschema: not at the CLI's start

    if not re.match(r"https?://[^/\s]+", endpoint):
        raise click.BadParameter(f"{endpoint!r} is not an http(s) URL like http://127.0.0.1:8000/v1",
                                 param_hint="--endpoint")
    r = load(recipe)
    err = Console(stderr=True, highlight=False)
    if served_name is not None and not re.fullmatch(r"[^\s]{1,256}", served_name):
        raise click.BadParameter(f"{served_name!r} is not a model name (1-256 characters, no spaces)",
                                 param_hint="--served-name")
    kind = "none" if no_baseline else baseline_kind
    if kind == "none" or (gates is not None and "speed" not in gates):
        baseline = None
    elif kind == "llama.cpp":
        baseline = _llama_cpp_baseline(r, llama_server, baseline_gguf)
    else:
        baseline = _baseline(r)
    evidence = run_checks(r, endpoint, gates=gates, evidence_dir=evidence_dir,
                          json_path=None if json_path == "-" else json_path, record=record,
                          reporter=RichReporter(err), api_key=api_key, baseline=baseline,
                          load_timeout_s=load_timeout, speed_window_s=speed_window, seed=seed,
                          served_name=served_name)
    if json_path == "-":
        files = evidence.pop("evidence_files"), evidence.pop("evidence_sha256")
        click.echo(json.dumps(evidence, indent=2, ensure_ascii=False))
        err.print(f"evidence: {files[0][0]}")
    else:
        out = Console(highlight=False, width=None if sys.stdout.isatty() else 120)
        with out.capture() as table:
            out.print(results_table(evidence))
        click.echo("\n".join(line.rstrip() for line in table.get().splitlines()))
        click.echo(verdict_line(evidence))
        click.echo(f"evidence: {evidence['evidence_files'][0]}")
        if record:
            click.echo(f"recorded a proof line in {r.path}")
    if evidence["verdict"] != "pass":
        click.get_current_context().exit(int(verdict_exit(evidence)))
