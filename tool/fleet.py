"""A fleet's hosts as the tool sees them: whether a worker answers on its fleet address, the head's wait for its
workers, and one host's needs as a one-host recipe (what preflight checks on that host).

systemd cannot order units on two machines, so the head waits for its workers itself (`tool fleet-wait`, the
head unit's ExecStartPre, and `tool up --host HEAD`), and names the first worker that does not answer. An
answer is a TCP connection accepted on the worker's fleet address and port: rpc-server and a Ray node accept
before they authenticate anything (they authenticate nothing), so nothing more can be asked without speaking
their protocols.
"""
from __future__ import annotations

import copy
import socket
import time
from dataclasses import dataclass

from tool.errors import NetworkError


@dataclass(frozen=True)
class Peer:
    name: str
    address: str
    port: int

    @property
    def where(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return f"{self.name} ({self.where})"


def parse_peer(text: str) -> Peer:
    """NAME=ADDRESS:PORT (IPv6 in brackets), as nix/lib writes them for `tool fleet-wait`."""
    name, eq, where = text.partition("=")
    host, colon, port = where.rpartition(":")
    if not (eq and name and colon and port.isdigit() and host):
        raise ValueError(f"{text!r} is not NAME=ADDRESS:PORT")
    return Peer(name, host.removeprefix("[").removesuffix("]"), int(port))


def peers_of(plan: dict, role: str = "worker") -> list[Peer]:
    """The plan's fleet hosts of one role (the head's workers), as nix/lib resolved their addresses."""
    fleet = plan.get("fleet") or {}
    return [Peer(h["name"], h["address"], int(h["port"])) for h in fleet.get("hosts", []) if h["role"] == role]


def answers(peer: Peer, timeout: float = 2.0) -> str | None:
    """None when the peer accepts a TCP connection on its fleet port; else why not, in a few words."""
    try:
        with socket.create_connection((peer.address, peer.port), timeout=timeout):
            return None
    except socket.timeout:
        return f"no answer within {timeout:g} s"
    except OSError as e:
        return (e.strerror or str(e)).lower()


def first_silent(peers: list[Peer], timeout: float = 2.0) -> tuple[Peer, str] | None:
    """The first peer that does not answer, with why; None when every one does."""
    for peer in peers:
        if (why := answers(peer, timeout)) is not None:
            return peer, why
    return None


def wait_for(peers: list[Peer], timeout_s: float, interval: float = 0.5) -> float:
    """Until every peer answers (the seconds it took), or KilnError naming the first that did not in timeout_s."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    while True:
        silent = first_silent(peers, timeout=min(2.0, max(0.2, deadline - time.monotonic())))
        if silent is None:
            return time.monotonic() - t0
        if time.monotonic() >= deadline:
            peer, why = silent
            raise NetworkError(f"fleet worker {peer} did not answer within {timeout_s:g} s ({why})")
        time.sleep(interval)


def host_view(data: dict, host: str) -> dict:
    """The recipe as one host of its fleet needs it: that host's hardware and memory cap in the recipe's place,
    so every one-host preflight check applies to it unchanged."""
    spec = data["fleet"]["hosts"][host]
    out = copy.deepcopy(data)
    hw = out["hardware"]
    gpus = spec.get("gpu_count", 0)
    hw["gpu_count"] = gpus
    hw["min_host_ram_bytes"] = spec["min_host_ram_bytes"]
    for key in ("card", "min_vram_bytes"):
        if key in spec:
            hw[key] = spec[key]
        elif gpus == 0:
            hw.pop(key, None)
    if gpus == 0:
        hw["vendor"] = "cpu"
    cpu = dict(hw.get("cpu", {}))
    cpu["min_logical_cpus"] = spec["cpu"]["min_logical_cpus"]
    cpu.pop("layout", None)
    hw["cpu"] = cpu
    if "memory_max_bytes" in spec:
        rt = out["runtime"]
        if rt["kind"] == "container":
            rt["container"]["memory_bytes"] = rt["container"]["memory_swap_bytes"] = spec["memory_max_bytes"]
        else:
            rt[{"native": "native", "llama-cpp": "llama_cpp"}[rt["kind"]]]["memory_max_bytes"] = spec["memory_max_bytes"]
    return out
