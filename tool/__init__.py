"""Kiln's command-line tool: recipes → pinned plans, units, preflight, checks."""
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
