"""The engine's one user-facing error and its exit-code enum.

Every library module raises EngineError; `engine.cli.main` prints its message as one line and exits with
its code. The numbers are `tool.errors.Exit`'s, member for member (tests/engine/test_errors.py asserts it),
so `tool` reads an engine child's exit status as its own with no table. The enum is declared in both
packages because neither imports the other: `engine`'s tiers import torch, and `tool` runs where torch is
not installed.
"""
from __future__ import annotations

import enum


class Exit(enum.IntEnum):
    OK = 0
    FAILED = 1          # ran and said no: a store record that fails, an output that exists without --force
    USAGE = 2           # bad command line: an option, --cpu-layout, a trace file, a prompt
    BAD_RECIPE = 3      # the tool's name; the engine says BAD_MODEL below
    MISSING_DEP = 4     # a package or program this command needs is missing
    NOT_WRITABLE = 5    # a directory that cannot be written
    IO = 6              # filesystem refused (O_DIRECT, disk full, read-only), or no memory for a tier
    NETWORK = 7         # the tool's name; the engine says ADDRESS below
    INTEGRITY = 8       # sha256 / size mismatch, a garbled manifest
    INTERNAL = 70       # a bug in Kiln (EX_SOFTWARE), as the tool numbers it
    INCONCLUSIVE = 75   # the tool's (its checks could not decide); the engine never exits with it
    INTERRUPTED = 130   # Ctrl-C / SIGTERM

    # The engine's words for the shared numbers (aliases: same members, so `Exit(3) is Exit.BAD_MODEL`).
    BAD_MODEL = 3       # a model directory, checkpoint, GGUF or store that is missing or not what it claims
    ADDRESS = 7         # the serve address is in use or cannot be bound


class EngineError(Exception):
    """A one-line, user-facing failure; `exit_code` is documented in `engine --help`."""

    def __init__(self, message: str, exit_code: Exit | int = Exit.FAILED):
        super().__init__(message)
        self.exit_code = Exit(exit_code)
