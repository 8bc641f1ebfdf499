"""Domain errors and the one exit-code enum (in the manner of huggingface_hub's _errors.py).

Every command raises KilnError subclasses; tool.cli.main turns them into one line on
stderr and the exit code below. No traceback ever reaches the user.
"""
from __future__ import annotations

import enum
import re
import signal
import threading


class Exit(enum.IntEnum):
    OK = 0
    FAILED = 1          # the thing ran and said no: preflight no-go, a gate failed, verify mismatch
    USAGE = 2           # bad command line (click's own code)
    BAD_RECIPE = 3      # recipe malformed / invalid / unknown id
    MISSING_DEP = 4     # a required program is missing (nix, docker, systemd-analyze)
    NOT_WRITABLE = 5    # a root / state dir that cannot be written
    IO = 6              # filesystem refused (O_DIRECT, disk full, read-only)
    NETWORK = 7         # download / server unreachable
    INTEGRITY = 8       # hash / size / digest mismatch
    INTERNAL = 70       # a bug in Kiln (EX_SOFTWARE): the one line says so; KILN_DEBUG=1 shows the traceback
    INCONCLUSIVE = 75   # the checks could not decide (EX_TEMPFAIL: a busy host, a stream whose timings were lost);
                        # nothing failed, and trying again (on a quieter host, another path) may decide
    INTERRUPTED = 130   # Ctrl-C


def child_exit(returncode: int) -> Exit:
    """A Kiln child's exit status read as ours. `engine` exits with these very numbers (engine/errors.py
    declares the same enum; tests/engine/test_errors.py holds them equal), so nothing is mapped by hand;
    a status outside the enum (docker's 125, a signal) is a plain failure."""
    try:
        return Exit(returncode)
    except ValueError:
        return Exit.FAILED


_interrupted = threading.Event()


def interrupt(signum=None, frame=None):
    """The tool's SIGINT (and `tool up`'s SIGTERM) handler: KeyboardInterrupt, remembered. Python drops an exception
    raised in an at-fork hook (logging releases its locks after every fork), so a Ctrl-C that lands while a child
    is forked would vanish and the step would run on to its end; whoever starts a child calls raise_if_interrupted()."""
    _interrupted.set()
    raise KeyboardInterrupt


def raise_if_interrupted() -> None:
    if _interrupted.is_set():
        raise KeyboardInterrupt


def catch_interrupts() -> None:
    """A command's start: SIGINT goes to interrupt() (from the main thread only, as signal.signal requires)."""
    _interrupted.clear()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, interrupt)


class KilnError(Exception):
    """An error with a one-line user message and an exit code."""

    exit_code: Exit = Exit.FAILED

    def __init__(self, message: str, exit_code: Exit | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else self.__class__.__name__


class RecipeError(KilnError):
    exit_code = Exit.BAD_RECIPE


class MissingDependency(KilnError):
    exit_code = Exit.MISSING_DEP


class NotWritable(KilnError):
    exit_code = Exit.NOT_WRITABLE


class StorageError(KilnError):
    exit_code = Exit.IO


class NetworkError(KilnError):
    exit_code = Exit.NETWORK


class IntegrityError(KilnError):
    exit_code = Exit.INTEGRITY


def last_line(text: str | None, limit: int = 300) -> str:
    """The last non-empty line of a program's output: the one-line reason a failed child gives."""
    lines = [l.strip() for l in (text or "").splitlines() if l.strip()]
    return lines[-1][:limit] if lines else "no output"


# What may not reach a terminal or a log as it is: C0/C1 controls and DEL (a newline would start a line the
# program never wrote; an escape sequence would restyle the terminal), the Unicode line and paragraph
# separators, and lone surrogates (from JSON's "\ud800", or a file name that is not UTF-8), which no
# encoder can write.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def printable(text: str) -> str:
    """text as one printable line: each character above written as a Python-style escape (\\n, \\x1b, \\ud800)."""
    def escape(m: re.Match) -> str:
        c = m.group()
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c) or (
            f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
    return _UNPRINTABLE.sub(escape, text)
