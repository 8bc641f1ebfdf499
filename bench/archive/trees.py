"""Benches that measure another checkout's engine (`--tree DIR`, e.g. the commit before a change) beside this one."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def engine_from(tree: Path) -> tuple[Path, str]:
    """Put checkout `tree` first on sys.path, so `engine` is imported from it, with this repo after it (bench/ and
    tests/ helpers); call before anything imports `engine`. → (tree, its short commit, "+dirty" when its working
    tree differs from that commit)."""
    tree = tree.resolve()
    if "engine" in sys.modules:
        raise RuntimeError("engine_from() must run before anything imports engine")
    sys.path.insert(0, str(tree))
    if str(REPO) not in sys.path:
        sys.path.insert(1, str(REPO))
    return tree, tree_commit(tree)


def tree_commit(tree: Path) -> str:
    """Checkout `tree`'s short commit, "+dirty" when its working tree differs from it."""
    git = ["git", "-C", str(tree)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    return commit + ("+dirty" if dirty else "")


def parse_with_tree(ap: argparse.ArgumentParser) -> tuple[argparse.Namespace, Path, str]:
    """ap's own options plus --tree, --rounds and --out, parsed; then engine_from(--tree) → (args, tree, commit)."""
    ap.add_argument("--tree", type=Path, default=REPO, help="the checkout whose engine is measured")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    return (args, *engine_from(args.tree))
