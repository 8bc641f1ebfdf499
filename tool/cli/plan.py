"""`tool plan RECIPE`: the recipe compiled by nix/lib: each step's command and limits, or the whole plan as JSON."""
from __future__ import annotations

import json

import click

from tool import plan as plans
from tool.recipes import load
from tool.state import DEFAULT_STATE_DIR


def plan_options(f):
    """Flags shared by `plan` and `materialise`: every one overrides a nix/lib option."""
    for decl, kw in reversed([
        (("--state-dir", "stateDir"), dict(type=click.Path(), help=f"Kiln's state directory (default {DEFAULT_STATE_DIR}).")),
        (("--models-dir", "modelsDir"), dict(type=click.Path(), help="Where weights live (default STATE_DIR/models).")),
        (("--store-dir", "storeDir"), dict(type=click.Path(), help="Where prepared stores live (default STATE_DIR/stores).")),
        (("--port", "port"), dict(type=click.IntRange(1, 65535), help="Host port the server publishes (default: the recipe's).")),
        (("--bind", "bindAddress"), dict(help="Address the server binds on the host (default 127.0.0.1).")),
        (("--uid", "uid"), dict(type=click.IntRange(0), help="Service user's uid (default: the kiln user's, else yours).")),
        (("--gid", "gid"), dict(type=click.IntRange(0), help="Service user's gid (default: the kiln user's, else yours).")),
        (("--tool-bin", "toolBin"), dict(help="The `tool` program units run (default: tool).")),
        (("--engine-bin", "engineBin"), dict(help="The `engine` program native units run (default: engine).")),
        (("--docker-bin", "dockerBin"), dict(help="The docker client container units run (default /usr/bin/docker).")),
        (("--environment-file", "environmentFile"), dict(help="KEY=VALUE secrets file (KILN_API_KEY, HF_TOKEN) for every "
                                                          "unit (EnvironmentFile=) and container (--env-file).")),
    ]):
        f = click.option(*decl, default=None, **kw)(f)
    return f


def options_from(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if v is not None}


@click.command("plan")
@click.argument("recipe")
@click.option("--json", "as_json", is_flag=True, help="Print the whole plan as JSON.")
@plan_options
def plan(recipe, as_json, **kwargs):
    """Compile RECIPE (an id or a path) with Nix and print each step's command and limits."""
    compiled = plans.compile_plan(load(recipe), options_from(kwargs))
    if as_json:
        click.echo(json.dumps(compiled, indent=2, sort_keys=True))
    else:
        click.echo(plans.render(compiled), nl=False)
