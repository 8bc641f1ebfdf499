#!/usr/bin/env python3
"""Regenerate the CLI reference from the commands' own --help, so it cannot drift: README.md holds each program's
--help (its commands, one line each), docs/cli.md every command's full --help.

  python scripts/cli_reference.py          rewrite the block between the markers in README.md and docs/cli.md
  python scripts/cli_reference.py --check  exit 1 if either block is stale (tests run this)
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from click.testing import CliRunner

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
BEGIN, END = "<!-- cli-reference:begin -->", "<!-- cli-reference:end -->"
FULL = REPO / "docs" / "cli.md"


def help_text(group, prog: str, args: list[str]) -> str:
    res = CliRunner().invoke(group, args + ["--help"], prog_name=prog, terminal_width=100)
    assert res.exit_code == 0, res.output
    return res.output.rstrip()


def reference(every_command: bool) -> str:
    """Each program's --help; with every_command, each of its commands' --help after it."""
    os.environ["COLUMNS"] = "100"
    from engine.cli import cli as engine_cli, COMMANDS as ENGINE_COMMANDS
    from tool.cli import cli as tool_cli, COMMANDS as TOOL_COMMANDS
    parts = []
    for prog, group, names in (("tool", tool_cli, TOOL_COMMANDS), ("engine", engine_cli, ENGINE_COMMANDS)):
        parts.append(f"### `{prog}`\n\n```\n{help_text(group, prog, [])}\n```")
        for name in names if every_command else ():
            parts.append(f"#### `{prog} {name}`\n\n```\n{help_text(group, prog, [name])}\n```")
    return "\n\n".join(parts)


def render(text: str, every_command: bool) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{reference(every_command)}\n{END}{tail}"


def main() -> int:
    stale = []
    for path, every_command in ((REPO / "README.md", False), (FULL, True)):
        text = path.read_text()
        new = render(text, every_command)
        if new == text:
            continue
        if "--check" in sys.argv:
            stale.append(path.relative_to(REPO))
            continue
        tmp = path.with_suffix(".md.tmp")
        tmp.write_text(new)
        os.replace(tmp, path)
    if stale:
        print(f"{', '.join(map(str, stale))}: the CLI reference is stale; run `python scripts/cli_reference.py`",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
