"""Domain errors and the one exit-code enum (in the manner of huggingface_hub's _errors.py).

Every command raises KilnError subclasses; tool.cli.main turns them into one line on
stderr and the exit code below. No traceback ever reaches the user.
"""
from __future__ import annotations

import enum


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
    INTERRUPTED = 130   # Ctrl-C


def child_exit(returncode: int) -> Exit:
    """A Kiln child's exit status read as ours. `engine` exits with these very numbers (engine/errors.py
    declares the same enum; tests/engine/test_errors.py holds them equal), so nothing is mapped by hand;
    a status outside the enum (docker's 125, a signal) is a plain failure."""
    try:
        return Exit(returncode)
    except ValueError:
        return Exit.FAILED


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
