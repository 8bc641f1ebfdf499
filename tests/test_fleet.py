"""A fleet's parts that need no llama.cpp: the head's wait for its workers, the foreground runner's allow-list
gate, and preflight per host. Real sockets on loopback: a worker here is a real listener bound where the unit
binds rpc-server (tests/test_fleet_loopback.py runs the real rpc-server and llama-server)."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tool.checks.llama_cpp import free_port
from tool.cli import main

REPO = Path(__file__).resolve().parent.parent
FLEET = "smollm2-135m-rpc"

needs_nix = pytest.mark.skipif(shutil.which("nix-instantiate") is None, reason="Nix is not installed")


class Listener:
    """A TCP server on 127.0.0.1 that echoes what it is sent: a worker's port as the unit would bind it."""

    def __init__(self, port: int | None = None):
        self.sock = socket.create_server(("127.0.0.1", port or 0))
        self.port = self.sock.getsockname()[1]
        self.seen: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            self.seen.append(peer[0])
            with conn:
                while data := conn.recv(4096):
                    conn.sendall(data)

    def close(self):
        self.sock.close()


def tool(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_fleet_wait_names_the_worker_that_did_not_answer(capsys):
    up = Listener()
    down = free_port()
    try:
        code, out, err = tool(capsys, "fleet-wait", "--timeout", "5", f"worker-a=127.0.0.1:{up.port}")
        assert (code, err) == (0, "") and out.startswith("1 fleet worker answered in 0.")
        assert out.endswith(f" s: worker-a (127.0.0.1:{up.port})\n")
        t0 = time.monotonic()
        code, out, err = tool(capsys, "fleet-wait", "--timeout", "1", f"worker-a=127.0.0.1:{up.port}",
                              f"worker-b=127.0.0.1:{down}")
        assert time.monotonic() - t0 < 5
        assert (code, out, err) == (7, "", f"tool: fleet worker worker-b (127.0.0.1:{down}) did not answer within "
                                           "1 s (connection refused)\n")
    finally:
        up.close()


def test_fleet_wait_returns_once_a_late_worker_answers(capsys):
    port = free_port()
    late: list[Listener] = []
    timer = threading.Timer(1.0, lambda: late.append(Listener(port)))
    timer.start()
    try:
        code, out, err = tool(capsys, "fleet-wait", "--timeout", "10", f"worker-a=127.0.0.1:{port}")
        assert (code, err) == (0, "") and out.startswith("1 fleet worker answered in 1.")
    finally:
        timer.join()
        for l in late:
            l.close()


def _gate(listen: int, allow: str, to: int, pid: int | None = None) -> subprocess.Popen:
    args = [sys.executable, "-m", "tool.runners.gate", "--listen", f"127.0.0.1:{listen}", "--allow", allow,
            "--to", f"127.0.0.1:{to}"] + (["--pid", str(pid)] if pid else [])
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("gate: ")        # listening
    return proc


def _talk(port: int, source: str) -> bytes:
    """Connect from `source` (a loopback address of this host), send a line, read what comes back."""
    try:     # the gate's reset can land while the connection is still being made, as under CI's load
        with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0)) as s:
            s.sendall(b"hello\n")
            return s.recv(100)
    except ConnectionResetError:
        return b""


def test_the_gate_admits_the_fleet_and_resets_everyone_else():
    """127.0.0.2 is this host too (all of 127/8 is loopback) but not the fleet's: it gets a reset and the worker
    never sees it; 127.0.0.1, the fleet's address, talks to the worker through the gate."""
    worker = Listener()
    listen = free_port()
    gate = _gate(listen, "127.0.0.1", worker.port)
    try:
        assert _talk(listen, "127.0.0.1") == b"hello\n"
        assert _talk(listen, "127.0.0.2") == b""
        assert worker.seen == ["127.0.0.1"]
    finally:
        gate.terminate()
        gate.wait(5)
        worker.close()


def test_the_gate_goes_with_its_worker():
    """A dead worker must stop answering on its fleet address, or the head would not notice it."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    worker = Listener()
    gate = _gate(free_port(), "127.0.0.1", worker.port, pid=sleeper.pid)
    try:
        sleeper.kill()
        sleeper.wait()
        assert gate.wait(5) == 0
    finally:
        gate.kill()
        worker.close()


@needs_nix
def test_preflight_per_host_checks_its_address_port_and_peers(capsys):
    busy = Listener()
    try:
        code, out, err = tool(capsys, "preflight", FLEET, "--host", "worker-a", "--json",
                              "--fleet-address", f"worker-a=127.0.0.1:{busy.port}")
        checks = {c["id"]: c for c in json.loads(out)["checks"]}
        assert (code, checks["fleet.port"]["status"]) == (1, "fail")
        assert checks["fleet.port"]["detail"] == f"fleet port 127.0.0.1:{busy.port} of worker-a is not free: address already in use"
        assert "net.port" not in checks and "weights.file" not in checks     # a worker serves no API, keeps no weights
        assert checks["fleet.address"]["status"] == "pass"

        # the head connects to its workers: one answers, one does not, named
        down = free_port()
        code, out, err = tool(capsys, "preflight", FLEET, "--json", "--fleet-address", f"worker-a=127.0.0.1:{busy.port}",
                              "--fleet-address", f"worker-b=127.0.0.1:{down}")
        checks = {c["id"]: c for c in json.loads(out)["checks"]}
        assert checks["fleet.peer.worker-a"] == {"id": "fleet.peer.worker-a", "status": "pass",
                                                 "detail": f"fleet worker worker-a (127.0.0.1:{busy.port}) answers from here"}
        assert checks["fleet.peer.worker-b"] == {"id": "fleet.peer.worker-b", "status": "fail",
                                                 "detail": f"fleet worker worker-b (127.0.0.1:{down}) does not answer "
                                                           "from here: connection refused"}
        assert code == 1
    finally:
        busy.close()


@needs_nix
def test_preflight_refuses_an_address_that_is_not_this_hosts(capsys):
    code, out, err = tool(capsys, "preflight", FLEET, "--host", "worker-b", "--json",
                          "--fleet-address", "worker-b=192.0.2.77:50052")
    check = next(c for c in json.loads(out)["checks"] if c["id"] == "fleet.address")
    assert code == 1 and check["status"] == "fail"
    assert check["detail"].startswith("fleet address 192.0.2.77 of worker-b is not an address of this host (")


@needs_nix
@pytest.mark.parametrize("argv, message", [
    (["--host", "worker-c"], 'fleet has no host "worker-c" (hosts: head, worker-a, worker-b)'),
    (["--host", "worker-a", "--fleet-address", "worker-a=0.0.0.0:50052"],
     "fleet address of worker-a is 0.0.0.0, every address of the host: its port takes commands from anyone who "
     "reaches it (no authentication)"),
])
def test_plan_for_a_host_refuses_in_one_line(argv, message, capsys):
    code, out, err = tool(capsys, "plan", FLEET, *argv)
    assert (code, out) == (3, "") and message in err and err.count("\n") == 1


@needs_nix
def test_plan_for_a_worker_is_that_host_only(capsys):
    code, out, err = tool(capsys, "plan", FLEET, "--host", "worker-b", "--json",
                          "--fleet-address", "worker-b=[::1]:6000", "--fleet-address", "head=[::1]:6001")
    plan = json.loads(out)
    assert (code, err) == (0, "")
    assert list(plan["units"]) == [f"kiln-{FLEET}-worker-b.service"]
    assert plan["steps"]["serve"]["argv"] == ["rpc-server", "--host", "::1", "--port", "6000", "--threads", "1"]
    assert plan["unitSections"][f"kiln-{FLEET}-worker-b.service"]["Service"]["IPAddressAllow"] == \
        ["::1", "127.0.0.1"]
