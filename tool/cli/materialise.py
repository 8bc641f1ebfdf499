"""`tool materialise RECIPE --root DIR`: write the recipe's units and mounted files under DIR, atomically."""
from __future__ import annotations

import click

from tool import plan as plans
from tool.cli.plan import options_from, plan_options
from tool.materialise import materialise as write_plan
from tool.recipes import load


@click.command("materialise")
@click.argument("recipe")
@click.option("--root", required=True, type=click.Path(file_okay=False),
              help="Directory to write under (/ for the real system).")
@click.option("--user", "user_units", is_flag=True,
              help="Units for a per-user systemd (ROOT/.config/systemd/user).")
@plan_options
def materialise(recipe, root, user_units, **kwargs):
    """Write RECIPE's systemd units, the files its steps mount and its tmpfiles.d rules under ROOT."""
    options = options_from(kwargs)
    options["userUnits"] = user_units
    compiled = plans.compile_plan(load(recipe), options)
    for path in write_plan(compiled, root, user=user_units):
        click.echo(str(path))
