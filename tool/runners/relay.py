"""A loopback TCP relay into a container's network namespace, for a Docker daemon that cannot publish ports.

A daemon started with `--bridge=none` (as in CI sandboxes) accepts `-p 127.0.0.1:P:C` but has no
network to publish it from: `docker inspect` shows the binding asked for and no port bound. The
container still has its own loopback. This relay listens on the host's 127.0.0.1:P and opens each
upstream connection from a thread that has joined the container's network namespace (setns(2),
CLONE_NEWNET; needs CAP_SYS_ADMIN, i.e. root), so clients speak real HTTP to the real server inside.
A socket belongs to the namespace it was created in, so only the connecting thread switches.

    python -m tool.runners.relay --listen 127.0.0.1:P --pid CONTAINER_PID --to 127.0.0.1:C

It exits when the container's process is gone.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import queue
import socket
import sys
import threading

CLONE_NEWNET = 0x40000000


def join_netns(pid: int) -> None:
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into /proc/{pid}/ns/net: {os.strerror(err)}")
    finally:
        os.close(fd)


class Connector(threading.Thread):
    """Opens upstream connections from inside the container's network namespace."""

    def __init__(self, pid: int, to: tuple[str, int]):
        super().__init__(daemon=True)
        self.pid, self.to = pid, to
        self.requests: queue.Queue = queue.Queue()
        self.ready = threading.Event()
        self.error: Exception | None = None

    def run(self):
        try:
            join_netns(self.pid)
        except OSError as e:
            self.error = e
            self.ready.set()
            return
        self.ready.set()
        while True:
            reply = self.requests.get()
            try:
                reply.put(socket.create_connection(self.to, timeout=10))
            except OSError as e:
                reply.put(e)

    def connect(self) -> socket.socket:
        reply: queue.Queue = queue.Queue()
        self.requests.put(reply)
        got = reply.get()
        if isinstance(got, Exception):
            raise got
        got.settimeout(None)
        return got


def pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except OSError:
                pass


def serve(listen: tuple[str, int], pid: int, to: tuple[str, int]) -> int:
    connector = Connector(pid, to)
    connector.start()
    connector.ready.wait()
    if connector.error:
        print(f"relay: {connector.error}", file=sys.stderr)
        return 1
    server = socket.create_server(listen, reuse_port=False)
    server.settimeout(1.0)
    print(f"relay: {listen[0]}:{listen[1]} → {to[0]}:{to[1]} in the network namespace of pid {pid}", flush=True)
    while os.path.exists(f"/proc/{pid}"):
        try:
            client, _ = server.accept()
        except socket.timeout:
            continue
        try:
            upstream = connector.connect()
        except OSError:
            client.close()
            continue
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=pump, args=(a, b), daemon=True).start()
    return 0


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tool.runners.relay", description=__doc__.splitlines()[0])
    p.add_argument("--listen", required=True, type=_addr)
    p.add_argument("--pid", required=True, type=int)
    p.add_argument("--to", required=True, type=_addr)
    a = p.parse_args(argv)
    try:
        return serve(a.listen, a.pid, a.to)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
