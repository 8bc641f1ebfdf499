"""How fast a streamed answer decoded: shared by the speed gate (tool.checks.speed) and the baseline it is
compared with (tool.checks.baseline), which speed imports."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:                    # an annotation only: the baseline's importers need not load the HTTP client
    from tool.checks.client import Answer


def time_stream(a: Answer, n: int | None = None) -> tuple[float, int] | None:
    """(decode tok/s, tokens) of a streamed answer: n tokens, else its usage's completion_tokens."""
    if n is None:
        n = (a.usage or {}).get("completion_tokens")
    if not isinstance(n, int) or a.t_first is None or n < 2 or a.t_last <= a.t_first:
        return None
    return (n - 1) / (a.t_last - a.t_first), n
