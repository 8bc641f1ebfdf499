"""The layering stays: the imports of the engine and tool packages, module-level AND function-level (read with
ast, nothing imported), form no circle between modules and no loop between folders, and tool never imports engine.

A "folder" is a subpackage (engine.tiers, tool.checks) or a top-level module (engine.loader): a top-level module
sits beside the subpackages, not above them. Imports under `if TYPE_CHECKING:` never run, so they are no edge.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "tool")


def module_files(root: Path = REPO) -> dict[str, Path]:
    """Every module of the packages: dotted name → file (a package's is its __init__.py)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _type_checking_only(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports anywhere in its file (functions included)."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            # `from pkg import sub` imports the submodule pkg.sub; `from mod import name` imports mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        if _type_checking_only(node, parents):
            continue
        for t in targets:
            while t and t not in modules:          # `import engine.tiers.cache as c` → engine.tiers.cache
                t = t.rpartition(".")[0]
            if t and t != name and t not in PACKAGES:
                found.add(t)
    return found


@functools.lru_cache(maxsize=None)          # the repository's graph is read once for all the tests
def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    modules = module_files(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def folder(module: str) -> str:
    return ".".join(module.split(".")[:2])


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    n = stack.pop()
                    on_stack.discard(n)
                    comp.append(n)
                    if n == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        out.setdefault(folder(a), set()).update(folder(b) for b in targets if folder(b) != folder(a))
    return out


def edges_within(graph: dict[str, set[str]], comp: list[str], name=lambda m: m) -> list[str]:
    """The edges of one circle, for the failure message: 'a -> b'."""
    members = set(comp)
    return sorted({f"{a} -> {b}" for a, targets in graph.items() for b in targets
                   if name(a) in members and name(b) in members and name(a) != name(b)})


def test_the_walk_sees_module_and_function_level_imports(tmp_path):
    """The walker itself: a circle closed only by a function-level import, a folder loop, relative imports and
    a TYPE_CHECKING import are each seen as they run."""
    for rel, text in {
        "engine/__init__.py": "",
        "engine/a.py": "from engine import b\n",
        "engine/b.py": "def f():\n    from engine.a import x\n",
        "engine/p/__init__.py": "",
        "engine/p/one.py": "from . import two\nfrom engine.q.three import y\n",
        "engine/p/two.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.q import three\n",
        "engine/q/__init__.py": "",
        "engine/q/three.py": "import engine.p.two as t\n",
        "tool/__init__.py": "",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = import_graph(tmp_path)
    assert graph["engine.p.one"] == {"engine.p.two", "engine.q.three"}
    assert graph["engine.p.two"] == set()
    assert circles(graph) == [["engine.a", "engine.b"]]
    assert circles(folder_graph(graph)) == [["engine.a", "engine.b"], ["engine.p", "engine.q"]]


def test_no_circle_between_modules():
    graph = import_graph()
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(
        f"  {' <-> '.join(c)}: {', '.join(edges_within(graph, c))}" for c in found)


def test_no_loop_between_folders():
    graph = import_graph()
    found = circles(folder_graph(graph))
    assert not found, "loops between folders:\n" + "\n".join(
        f"  {' <-> '.join(c)}: {', '.join(edges_within(graph, c, folder))}" for c in found)


def test_tool_never_imports_engine():
    graph = import_graph()
    assert not {f"{a} -> {b}" for a, bs in graph.items() if a.startswith("tool") for b in bs if b.startswith("engine")}
