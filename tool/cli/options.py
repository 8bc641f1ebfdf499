"""Options more than one `tool` command takes, declared once (huggingface_hub's cli/ keeps them beside
the commands in the same way). Defaults named in help texts come from where they are defined."""
from __future__ import annotations

import click

from tool.state import DEFAULT_STATE_DIR

_DIR = click.Path(file_okay=False)

state_dir = click.option("--state-dir", type=_DIR, default=None,
                         help="Kiln's state directory: models, stores, evidence and run state below it, ahead of "
                              f"$KILN_MODELS_DIR / $KILN_STORE_DIR (default $KILN_STATE_DIR, else {DEFAULT_STATE_DIR}).")
models_dir = click.option("--models-dir", type=_DIR, default=None,
                          help="Where weights live (default $KILN_MODELS_DIR, else $KILN_STATE_DIR/models, else "
                               f"{DEFAULT_STATE_DIR}/models).")
store_dir = click.option("--store-dir", type=_DIR, default=None,
                         help="Where prepared stores live (default $KILN_STORE_DIR, else $KILN_STATE_DIR/stores, else "
                              f"{DEFAULT_STATE_DIR}/stores).")
host_root = click.option("--host-root", type=click.Path(exists=True, file_okay=False), hidden=True,
                         help="Read /proc and /sys from this tree instead of / (tests).")


def dirs(f):
    """--state-dir / --models-dir / --store-dir: what tool.state.Dirs.resolve takes."""
    return state_dir(models_dir(store_dir(f)))


def _gate_list(ctx, param, value) -> list[str] | None:
    """'load, chat' -> ['load', 'chat'], each a known gate; None (every gate the recipe expects) if not given
    or empty."""
    if not value:
        return None
    from tool.checks.runner import GATES  # requests: not at the CLI's start

    only = [g.strip() for g in value.split(",") if g.strip()]
    if unknown := [g for g in only if g not in GATES]:
        raise click.BadParameter(f"unknown gate {', '.join(unknown)}; gates are {', '.join(GATES)}",
                                 param_hint="--gates")
    return only


gates = click.option("--gates", metavar="G1,G2", callback=_gate_list,
                     help="Run only these gates (load,chat,reasoning,tools,context,speed).")
