"""`tool preflight RECIPE`: every requirement of the recipe checked on this host; exit 0 only on go."""
from __future__ import annotations

import json

import click

from tool.cli import options
from tool.cli.plan import fleet_options, options_from
from tool.errors import Exit
from tool import preflight as pf
from tool.fleet import host_view
from tool.plan import compile_plan
from tool.preflight import fleet as fleet_checks
from tool.preflight.checks import verdict


def console():
    """The terminal's width on a terminal; unwrapped lines when piped, so each check stays one line."""
    import sys

    from rich.console import Console

    return Console(highlight=False, width=None if sys.stdout.isatty() else 400)


@click.command("preflight")
@click.argument("recipe")
@click.option("--json", "as_json", is_flag=True, help="Print {recipe, verdict, checks} as JSON on stdout.")
@options.models_dir
@options.store_dir
@options.host_root
@fleet_options
@click.pass_context
def preflight(ctx, recipe, as_json, models_dir, store_dir, host_root, **fleet):
    """Check, before any download, whether this host can run RECIPE (an id or a file).

    A fleet recipe is checked for one of its hosts (--host, default its head): that host's hardware, its fleet
    address and port, and that the peers it connects to answer from here.

    Each check says pass, warn or fail with a one-line reason. Exit 0 when nothing fails (go),
    1 when something does (no-go).
    """
    from tool.recipes import load  # jsonschema: not at the CLI's start

    r = load(recipe)
    host = pf.host_from_env(models_dir, store_dir, host_root)
    if "fleet" in r.data or fleet.get("host"):
        # the operator's addresses are resolved where the units get them: nix/lib
        plan = compile_plan(r, options_from(fleet))
        worker = plan["fleet"]["role"] == "worker"
        results = pf.run(host_view(r.data, plan["fleet"]["host"]), host, serves_api=not worker,
                         reads_weights=plan["steps"]["fetch"] is not None) + fleet_checks.check(plan)
    else:
        results = pf.run(r, host)
    v = verdict(results)
    if as_json:
        click.echo(json.dumps({"recipe": r.id, "verdict": v, "checks": [c.as_dict() for c in results]}, indent=2))
    else:
        from tool.preflight.report import render  # rich: not at the CLI's start

        render(r.id, results, console())
    ctx.exit(int(Exit.OK if v == "go" else Exit.FAILED))
