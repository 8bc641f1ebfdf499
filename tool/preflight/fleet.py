"""A fleet host's own needs on the fleet network: its address is this machine's, its port is free, and the peers
it connects to answer from here (a llama.cpp head: its rpc-server workers; a Ray worker: the head)."""
from __future__ import annotations

import socket

from tool.fleet import Peer, answers, peers_of
from tool.preflight.checks import CheckResult, failed, passed


def bind_problem(address: str, port: int) -> str | None:
    """Bind it as the worker would (SO_REUSEADDR: TIME_WAIT leftovers do not count): None if it can."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
        except OSError as e:
            return (e.strerror or str(e)).lower()
    return None


def peers_to_reach(plan: dict) -> list[Peer]:
    """The hosts this one opens connections to: a llama.cpp head drives its workers; a Ray worker joins its head."""
    fleet = plan["fleet"]
    if fleet["role"] == "head":
        return peers_of(plan, "worker") if plan["runtime"] == "llama-cpp" else []
    return peers_of(plan, "head") if plan["runtime"] == "container" else []


def check(plan: dict, peers: bool = True) -> list[CheckResult]:
    fleet = plan["fleet"]
    me = Peer(fleet["host"], fleet["self"]["address"], int(fleet["self"]["port"]))
    listens = fleet["role"] == "worker" or plan["runtime"] == "container"    # a llama.cpp head only connects
    out = []
    if why := bind_problem(me.address, 0):
        out.append(failed("fleet.address", f"fleet address {me.address} of {me.name} is not an address of this host "
                                           f"({why}): give this host's own with --fleet-address {me.name}=ADDR:PORT"))
    else:
        out.append(passed("fleet.address", f"fleet address {me.address} of {me.name} is this host's"))
        if listens:
            why = bind_problem(me.address, me.port)
            out.append((failed if why else passed)(
                "fleet.port", f"fleet port {me.where} of {me.name} is " + (f"not free: {why}" if why else "free")))
    for peer in peers_to_reach(plan) if peers else []:
        why = answers(peer, timeout=3)
        out.append((failed if why else passed)(
            f"fleet.peer.{peer.name}", f"fleet {'worker' if fleet['role'] == 'head' else 'head'} {peer} "
            + (f"does not answer from here: {why}" if why else "answers from here")))
    return out
