"""`tool validate`: recipes against recipes/schema.json and the rules beyond it."""
from __future__ import annotations

import json
from pathlib import Path

import click

from tool.errors import Exit, printable


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


@click.command("validate")
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print {files, errors} as JSON instead of lines.")
def validate(paths: tuple[Path, ...], as_json: bool) -> None:
    """Validate recipe files: every error at once, located.

    PATHS are recipe files or directories (searched recursively for *.json); by default
    every recipe under the recipes directories ($KILN_RECIPES, then the repo's recipes/).
    Each error is printed on its own line as FILE::$.json.path: message, and a summary
    to stderr. Ids must be unique across everything validated together.

    Exit status: 0 when every recipe is valid, 3 otherwise.
    """
    from tool.validate import check_paths, display_path  # imported here: `tool --help` stays fast

    files, problems = check_paths(paths or None)
    if as_json:
        click.echo(json.dumps({"files": [printable(display_path(f)) for f in files],
                               "errors": [p.as_dict() for p in problems]}, indent=2, ensure_ascii=False))
    else:
        for p in problems:
            click.echo(str(p))
    click.echo(f"{_plural(len(files), 'recipe')}, {_plural(len(problems), 'error')}", err=True)
    if problems:
        click.get_current_context().exit(int(Exit.BAD_RECIPE))
