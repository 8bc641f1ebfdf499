"""nix/lib's own cases (nix/lib/tests.nix, nixpkgs lib/tests style), evaluated by real Nix.

Each case is evaluated separately (tryEval), so one failing or throwing case is reported by
name with what it gave and what was expected, and the others still run.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TESTS_NIX = REPO / "nix" / "lib" / "tests.nix"

pytestmark = pytest.mark.skipif(shutil.which("nix-instantiate") is None, reason="Nix is not installed")

RUNNER = """
{ file }:
builtins.mapAttrs (name: c:
  let r = builtins.tryEval (builtins.deepSeq c.expr c.expr); in
  if r.success then { ok = r.value == c.expected; got = r.value; expected = c.expected; }
  else { ok = false; got = "<throws>"; expected = c.expected; })
  (import file)
"""


def run_cases(path: Path) -> dict:
    proc = subprocess.run(
        ["nix-instantiate", "--eval", "--strict", "--json", "--expr", RUNNER, "--argstr", "file", str(path)],
        capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def failures(results: dict) -> list[str]:
    return [f"{name}: got {json.dumps(r['got'])}, expected {json.dumps(r['expected'])}"
            for name, r in sorted(results.items()) if not r["ok"]]


def test_nix_lib_cases():
    results = run_cases(TESTS_NIX)
    assert len(results) >= 30
    assert failures(results) == []


def test_a_failing_case_is_reported_by_name(tmp_path):
    """The runner itself can fail: a wrong and a throwing case come back named."""
    cases = tmp_path / "cases.nix"
    cases.write_text('{ testRight = { expr = 1 + 1; expected = 2; };'
                     '  testWrong = { expr = 1 + 1; expected = 3; };'
                     '  testThrows = { expr = throw "no"; expected = 1; }; }')
    out = failures(run_cases(cases))
    assert out == ['testThrows: got "<throws>", expected 1', "testWrong: got 2, expected 3"]
