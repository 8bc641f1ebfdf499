"""The engine's exit codes are the tool's, and the package boundaries hold.

Static checks over the source (ast, not grep): they fail the moment a library module imports the CLI or
`tool` imports `engine`, which the enums' being declared twice depends on.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from engine.errors import EngineError, Exit as EngineExit
from tool.errors import Exit as ToolExit, child_exit

ROOT = Path(__file__).resolve().parents[2]


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_the_engine_and_the_tool_share_every_exit_number():
    assert [(m.name, m.value) for m in EngineExit] == [(m.name, m.value) for m in ToolExit]
    assert EngineExit.BAD_MODEL is EngineExit.BAD_RECIPE and EngineExit.ADDRESS is EngineExit.NETWORK


@pytest.mark.parametrize("code", list(EngineExit))
def test_the_tool_reads_an_engine_exit_as_its_own(code):
    assert child_exit(int(code)) is ToolExit(int(code))


def test_a_status_outside_the_enum_is_a_plain_failure():
    assert child_exit(125) is ToolExit.FAILED and child_exit(-9) is ToolExit.FAILED


def test_an_engine_error_carries_an_enum_member_even_from_a_bare_integer():
    assert EngineError("x").exit_code is EngineExit.FAILED
    assert EngineError("x", 8).exit_code is EngineExit.INTEGRITY
    with pytest.raises(ValueError):
        EngineError("x", 9)


def test_no_engine_library_module_imports_the_cli():
    cli = ROOT / "engine" / "cli"
    offenders = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "engine").rglob("*.py"))
                 if cli not in p.parents and p.name != "__main__.py"
                 and any(m == "engine.cli" or m.startswith("engine.cli.") for m in imports(p))]
    assert offenders == []


def test_the_tool_never_imports_the_engine():
    offenders = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tool").rglob("*.py"))
                 if any(m == "engine" or m.startswith("engine.") for m in imports(p))]
    assert offenders == []
