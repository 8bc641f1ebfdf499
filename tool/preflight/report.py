"""Human output: one table, fails first, then a one-line summary."""
from __future__ import annotations

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tool.preflight.checks import FAIL, PASS, WARN, CheckResult, fails_first, verdict

STYLE = {FAIL: "bold red", WARN: "yellow", PASS: "green"}


def summary(recipe_id: str, results: list[CheckResult]) -> str:
    n = {s: sum(r.status == s for r in results) for s in (FAIL, WARN, PASS)}
    v = verdict(results)
    tail = "nothing fails" if v == "go" else "fix what fails above"
    return f"{v}: {recipe_id} — {n[FAIL]} fail, {n[WARN]} warn, {n[PASS]} pass; {tail}"


def table(results: list[CheckResult]) -> Table:
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    t.add_column("status", no_wrap=True)
    t.add_column("check", no_wrap=True)
    t.add_column("detail", overflow="fold")
    for r in fails_first(results):
        t.add_row(f"[{STYLE[r.status]}]{r.status}[/]", escape(r.id), escape(r.detail))  # details quote recipe text
    return t


def render(recipe_id: str, results: list[CheckResult], console: Console) -> None:
    console.print(table(results))
    style = STYLE[FAIL] if verdict(results) == "no-go" else STYLE[PASS]
    console.print(f"[{style}]{escape(summary(recipe_id, results))}[/]", highlight=False)
