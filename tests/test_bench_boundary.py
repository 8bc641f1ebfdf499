"""Tests hold the package, not the benchmarks: no test imports bench/ or opens a file under it (what a test needs
lives in engine/measure or tests/fixtures). bench/ moves as figures are re-measured and results archived; a test
leaning on it would move or break with them. Running an entry point as a user does (`python -m bench.NAME`) is
allowed: that is its command line under test, not its code borrowed."""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes (prose may name bench files)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def bench_uses(source: str) -> list[str]:
    """What in this test source imports bench or names a path under bench/: 'line N: what' each."""
    tree = ast.parse(source)
    docs, found = _docstrings(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] == "bench"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "bench":
            found.append(f"line {node.lineno}: from {node.module} import …")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
              and (node.value == "bench" or node.value.startswith(("bench/", "./bench/")) or "/bench/" in node.value)):
            found.append(f"line {node.lineno}: path {node.value!r}")
    return sorted(found, key=lambda f: int(f.split()[1].rstrip(':')))


def test_no_test_imports_bench_or_opens_its_files():
    offenders = {str(p.relative_to(TESTS)): got for p in sorted(TESTS.rglob("*.py"))
                 if p != Path(__file__).resolve() and (got := bench_uses(p.read_text()))}     # this file spells the rule
    assert offenders == {}


def test_the_rule_sees_each_way_in():
    caught = bench_uses('import bench.harness\nfrom bench import h200_peer\nREPO / "bench" / "results"\n'
                        'open("bench/results/x.json")\nspec("tool", "/repo/bench/quant_accuracy.py")\n')
    assert [c.split(":")[0] for c in caught] == ["line 1", "line 2", "line 3", "line 4", "line 5"]
    # a docstring may name a bench file; running an entry point is its command line, not its code
    assert bench_uses('"""bench/results/x.json is where the full run lives."""\n'
                      'run([sys.executable, "-m", "bench.h200_peer", "--help"])\n') == []
