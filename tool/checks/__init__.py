"""The six acceptance gates (load, chat, reasoning, tools, context, speed) against any
OpenAI-compatible server, with an evidence file. Entry point: run_checks."""
from tool.checks.runner import GATES, run_checks, run_gates

__all__ = ["GATES", "run_checks", "run_gates"]
