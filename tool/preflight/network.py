"""Network: the port the server publishes, free on 127.0.0.1."""
from __future__ import annotations

import socket

from tool.preflight.checks import CheckResult, failed, passed


def port_free(port: int, host: str = "127.0.0.1") -> str | None:
    """Bind it the way a server would (SO_REUSEADDR, so TIME_WAIT leftovers do not count): None if free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def check(recipe: dict) -> list[CheckResult]:
    port = int(recipe["serve"]["port"])
    reason = port_free(port)
    if reason:
        return [failed("net.port", f"port {port} on 127.0.0.1 (serve.port) is not free: {reason.lower()}")]
    return [passed("net.port", f"port {port} on 127.0.0.1 (serve.port) is free")]
