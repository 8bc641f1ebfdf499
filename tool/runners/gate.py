"""An allow-list gate in front of a fleet worker, for the foreground runner (where there is no systemd).

rpc-server authenticates no caller. Under systemd its unit admits only the fleet's hosts (IPAddressAllow= with
IPAddressDeny=any: the kernel drops everyone else's packets, through the unit's cgroup). Without systemd nothing
polices the process's sockets, so the foreground runner puts rpc-server on a private loopback port and this gate
on the operator's fleet address: a connection whose source address is not one of the fleet's hosts is reset
before one byte reaches the worker; the rest are relayed both ways.

    python -m tool.runners.gate --listen 127.0.0.1:50053 --allow 127.0.0.1 --to 127.0.0.1:PRIVATE --pid PID

It exits when the worker (pid) is gone, so a dead worker stops answering on its fleet address.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import struct
import sys
import threading

from tool.runners.relay import _addr, pump


def _reset(conn: socket.socket) -> None:
    """Close with RST (SO_LINGER 0): the caller learns at once that nothing listens for it."""
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    conn.close()


def allowed(peer: str, allow: set[ipaddress._BaseAddress]) -> bool:
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped          # a dual-stack socket shows an IPv4 caller as ::ffff:a.b.c.d
    return address in allow


def serve(listen: tuple[str, int], allow: set, to: tuple[str, int], pid: int | None) -> int:
    family = socket.AF_INET6 if ":" in listen[0] else socket.AF_INET
    server = socket.create_server(listen, family=family)
    server.settimeout(0.5)
    print(f"gate: {listen[0]}:{listen[1]} → {to[0]}:{to[1]} for {', '.join(sorted(map(str, allow)))}", flush=True)
    while pid is None or os.path.exists(f"/proc/{pid}"):
        try:
            client, peer = server.accept()
        except socket.timeout:
            continue
        if not allowed(peer[0], allow):
            print(f"gate: refused {peer[0]}: not a host of the fleet", flush=True)
            _reset(client)
            continue
        try:
            upstream = socket.create_connection(to, timeout=10)
            upstream.settimeout(None)
        except OSError:
            _reset(client)
            continue
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=pump, args=(a, b), daemon=True).start()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tool.runners.gate", description=__doc__.splitlines()[0])
    p.add_argument("--listen", required=True, type=_addr)
    p.add_argument("--allow", required=True, help="comma-separated IP addresses admitted")
    p.add_argument("--to", required=True, type=_addr)
    p.add_argument("--pid", type=int, help="exit when this process is gone")
    a = p.parse_args(argv)
    allow = {ipaddress.ip_address(x) for x in a.allow.split(",") if x}
    try:
        return serve((a.listen[0].strip("[]"), a.listen[1]), allow, a.to, a.pid)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
