"""`tool`: Kiln's CLI. One module per command group (huggingface_hub's cli/ layout).

Commands are imported lazily so `tool --help` stays fast and a missing optional
dependency of one command cannot break the others.
"""
from __future__ import annotations

import importlib
import os
import sys
import traceback

import click

from tool.errors import Exit, KilnError, catch_interrupts, printable

# command name -> (module, attribute). Each module owns one command group's job.
COMMANDS: dict[str, tuple[str, str]] = {
    "validate": ("tool.cli.validate", "validate"),
    "plan": ("tool.cli.plan", "plan"),
    "materialise": ("tool.cli.materialise", "materialise"),
    "preflight": ("tool.cli.preflight", "preflight"),
    "list": ("tool.cli.list_", "list_"),
    "check": ("tool.cli.check", "check"),
    "fetch": ("tool.cli.fetch", "fetch"),
    "verify": ("tool.cli.verify", "verify"),
    "prepare": ("tool.cli.prepare", "prepare"),
    "up": ("tool.cli.up", "up"),
    "down": ("tool.cli.up", "down"),
    "status": ("tool.cli.up", "status"),
    "recipe": ("tool.cli.recipe", "recipe"),
    "fleet-wait": ("tool.cli.fleet", "fleet_wait"),
}

SHORT_HELP = {
    "validate": "Validate recipe files: every error at once, located.",
    "plan": "Compile a recipe (with Nix) into its plan: steps and units.",
    "materialise": "Write a recipe's systemd units and mounted files under a root.",
    "preflight": "Check, before any download, whether this host can run a recipe.",
    "list": "List the recipes and whether each fits this host.",
    "check": "Run the six acceptance gates against an OpenAI-compatible server.",
    "fetch": "Download a recipe's weights at the pinned revision, verified.",
    "verify": "Re-hash a recipe's weights and prepared store, offline.",
    "prepare": "Run a recipe's prepare step in staging, verify, publish.",
    "up": "Preflight, fetch, prepare, verify, start, wait, check: the whole way.",
    "down": "Stop a recipe's server.",
    "status": "Show what Kiln runs on this host.",
    "recipe": "Write a recipe: `recipe new FILE.gguf --card CARD` for a GGUF you have.",
    "fleet-wait": "Wait for a fleet's workers to answer; name the one that does not.",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return list(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module, attr = COMMANDS[name]
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            why = str(e)                # `e` is unbound once the except block ends; the command runs later

            @click.command(name=name, help=f"(unavailable: {why})")
            def unavailable():
                raise KilnError(f"`tool {name}` is unavailable here: {why}", Exit.MISSING_DEP)
            return unavailable

    def format_commands(self, ctx, formatter):
        rows = [(name, SHORT_HELP.get(name, "")) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kiln", prog_name="tool")
def cli():
    """Kiln: a recipe (one JSON file) → a pinned, verified, running model server."""


def _say(text: str) -> None:
    click.echo(f"tool: {printable(text)}", err=True)


def main(argv=None) -> int:
    """Entry point: domain errors become one line on stderr and an exit code from tool.errors.Exit.

    Whatever a command is given, the user sees one line, never a traceback: anything unexpected is a
    bug, reported as one (exit 70) with the traceback left to KILN_DEBUG=1."""
    catch_interrupts()
    try:
        rv = cli.main(args=argv, prog_name="tool", standalone_mode=False)
        return int(rv or 0)
    except KilnError as e:
        _say(e.message)
        return int(e.exit_code)
    except click.exceptions.Abort:
        _say("interrupted")
        return int(Exit.INTERRUPTED)
    except click.ClickException as e:
        e.show()  # click's usage line and its one-line error
        return int(e.exit_code)
    except KeyboardInterrupt:
        _say("interrupted")
        return int(Exit.INTERRUPTED)
    except click.exceptions.Exit as e:
        return int(e.exit_code)
    except BrokenPipeError:  # `tool list | head`: the reader left; nothing more to say
        return int(Exit.OK)
    except Exception as e:  # noqa: BLE001 — the contract is one line, even for Kiln's own bugs
        if os.environ.get("KILN_DEBUG"):
            traceback.print_exc()
        _say(f"internal error ({type(e).__name__}: {e}); this is a bug in Kiln: rerun with KILN_DEBUG=1 "
             "for the traceback and report it")
        return int(Exit.INTERNAL)


if __name__ == "__main__":
    sys.exit(main())


def entry():
    sys.exit(main())
