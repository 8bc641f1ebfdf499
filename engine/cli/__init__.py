"""`engine`: the offload engine's CLI. Commands load lazily (torch is slow to import).

One module per command in this package (store.py holds pack-store and verify-store, which share their
progress bars); the options several commands take, and the EngineConfig they build, in options.py.
Library modules never import this package: they raise engine.errors.EngineError, which main() below
turns into one line and its exit code (tests/engine/test_errors.py checks both by ast).
"""
from __future__ import annotations

import importlib
import os
import sys

# Before any command imports torch (libgomp reads it once): OpenMP threads that wait spin briefly, then sleep.
# libgomp's default spins ~300,000 times (milliseconds) first; on a host whose cores other work shares, a waiting
# thread that spins holds the core its teammate needs, and the CPU demo's decode fell to a few tok/s under load
# (bench/README.md, "The CPU demo beside llama.cpp"). 1,000 spins still cover the microsecond gaps between the
# parallel regions of a native decode step (native.DecodeLayers). A caller's own setting wins.
if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "1000"

import click

from engine.errors import EngineError, Exit

# command name -> (module, attribute)
COMMANDS: dict[str, tuple[str, str]] = {
    "pack-store": ("engine.cli.store", "pack_store"),
    "verify-store": ("engine.cli.store", "verify_store"),
    "verify-model": ("engine.cli.store", "verify_model"),
    "serve": ("engine.cli.serve", "serve"),
    "generate": ("engine.cli.generate", "generate"),
    "convert": ("engine.cli.convert", "convert"),
    "synth": ("engine.cli.synth", "synth"),
    "simulate-cache": ("engine.cli.simulate_cache", "simulate_cache"),
    "reference-decode": ("engine.cli.reference_decode", "reference_decode"),
}

SHORT_HELP = {
    "pack-store": "Pack a checkpoint's routed experts into an O_DIRECT store, verified.",
    "verify-store": "Re-read every store record with O_DIRECT and check its sha256.",
    "verify-model": "Re-hash every file of a converted model against its manifest.",
    "serve": "Serve a model over an OpenAI-compatible HTTP API.",
    "generate": "Generate from a prompt on the command line (greedy or sampled).",
    "convert": "Convert a dense GGUF model into a sparse-upcycled Mixtral checkpoint.",
    "synth": "Synthesize a random checkpoint of a given MoE shape (Qwen3-30B-A3B, GLM-5.3-Flash) straight into a store.",
    "simulate-cache": "Compare expert-cache eviction policies on a routing trace.",
    "reference-decode": "Time transformers' own generate on a model (the speed gate's baseline).",
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
                raise EngineError(f"`engine {name}` is unavailable here: {why}", Exit.MISSING_DEP)
            return unavailable

    def format_commands(self, ctx, formatter):
        with formatter.section("Commands"):
            formatter.write_dl([(n, SHORT_HELP.get(n, "")) for n in self.list_commands(ctx)])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]},
             epilog="Exit codes: 0 ok, 1 failed, 2 usage (bad option, --cpu-layout, trace file), "
                    "3 bad model/checkpoint/store, 4 missing dependency, 6 filesystem refused (O_DIRECT, full, "
                    "read-only), 7 address in use or cannot be bound, 8 integrity (sha256 mismatch), 130 interrupted.")
def cli():
    """Kiln's MoE expert-offload engine. Architectures: qwen3_moe, glm4_moe, mixtral and glm5_next
    (GLM-5.3-Flash: KDA + DSA layers, mHC residual), each exact against transformers'."""


def main(argv=None) -> int:
    try:
        rv = cli.main(args=argv, prog_name="engine", standalone_mode=False)
        return int(rv or 0)
    except EngineError as e:
        click.echo(f"engine: {e}", err=True)
        return int(e.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo("engine: interrupted", err=True)
        return Exit.INTERRUPTED
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except click.exceptions.Exit as e:
        return int(e.exit_code)


def entry():
    code = main()
    if code == Exit.INTERRUPTED:
        # CPython ends a process by re-raising SIGINT (exit status -2, not the documented 130) once a Ctrl-C passed
        # through interpreter code run from C (its "unhandled KeyboardInterrupt" flag), even when main() caught it.
        # The work is unwound by now (staging removed); only the streams need flushing.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
