"""The foreground runner: the plan's serve argv as a child of `tool up`, where there is no systemd.

The child gets its own session (so a terminal's Ctrl-C reaches `tool up`, which stops it in order,
and so it can outlive `tool up` when detached), its output in <state>/run/<id>.log, and what of the
plan's limits can be applied without systemd. Each limit is reported in one line, applied or not
and why: for the native runtime RLIMIT_MEMLOCK (setrlimit), CPU affinity (sched_setaffinity) and a
cgroup v2 memory.max when a cgroup can be created; a container's limits are docker flags already
in its argv.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from tool.checks.liveness import exit_reason, log_tail
from tool.checks.llama_cpp import free_port
from tool.cpulist import parse_cpulist
from tool.errors import KilnError, MissingDependency
from tool.fleet import answers, parse_peer
from tool.pids import pid_alive
from tool.programs import child_env
from tool.run_record import RunRecord
from tool.state import Dirs

CGROUP_ROOT = Path("/sys/fs/cgroup")
TAIL = 20


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


@dataclass
class Limits:
    """What to do in the child before exec, and one line per limit saying what was done."""
    lines: list[str] = field(default_factory=list)
    memlock: int | None = None
    cpus: set[int] | None = None
    cgroup: Path | None = None

    def preexec(self):
        # Runs in the child between fork and exec: only async-signal-safe-ish work, errors swallowed
        # (each was checked in the parent, and a line already says it will be applied).
        if self.cgroup is not None:
            try:
                with open(self.cgroup / "cgroup.procs", "w") as f:
                    f.write(str(os.getpid()))
            except OSError:
                pass
        if self.memlock is not None:
            try:
                resource.setrlimit(resource.RLIMIT_MEMLOCK, (self.memlock, self.memlock))
            except (OSError, ValueError):
                pass
        if self.cpus:
            try:
                os.sched_setaffinity(0, self.cpus)
            except OSError:
                pass


def memlock_limit(want) -> tuple[int | None, str]:
    if want is None:
        return None, "memlock: the recipe asks none"
    value = resource.RLIM_INFINITY if str(want) in ("infinity", "-1") else int(want)
    shown = "infinity" if value == resource.RLIM_INFINITY else f"{value} B"
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if hard == resource.RLIM_INFINITY or (value != resource.RLIM_INFINITY and value <= hard):
        return value, f"memlock: RLIMIT_MEMLOCK={shown} applied (setrlimit)"
    try:    # raising the hard limit needs CAP_SYS_RESOURCE: ask the kernel, in this process, and put it back
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (value, value))
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))
        return value, f"memlock: RLIMIT_MEMLOCK={shown} applied (setrlimit)"
    except (OSError, ValueError):
        return None, (f"memlock: RLIMIT_MEMLOCK={shown} not applied: the hard limit here is {hard} B and raising it "
                      f"needs CAP_SYS_RESOURCE; the engine runs with {soft} B")


def cgroup_v2(rid: str, memory: int | None, swap_total: int | None) -> tuple[Path | None, str]:
    """A cgroup v2 child with memory.max (and memory.swap.max) when this host has a writable v2 hierarchy."""
    if memory is None:
        return None, "memory: the recipe asks no cap"
    want = f"memory: {_gib(memory)} cap (MemoryMax=)"
    if not (CGROUP_ROOT / "cgroup.controllers").exists():
        kind = "cgroup v1" if (CGROUP_ROOT / "memory").exists() or CGROUP_ROOT.exists() else "no cgroup filesystem"
        return None, (f"{want} not applied: {CGROUP_ROOT} is {kind}, not a cgroup v2 hierarchy (use --runner systemd "
                      f"on a v2 host); RLIMIT_AS is not used instead: it caps address space, not memory, and breaks "
                      f"mmap-heavy loaders")
    cg = CGROUP_ROOT / f"kiln-{rid}"
    try:
        cg.mkdir(exist_ok=True)
        (cg / "memory.max").write_text(str(memory))
        if swap_total is not None and (cg / "memory.swap.max").exists():
            (cg / "memory.swap.max").write_text(str(max(0, swap_total - memory)))
    except OSError as e:
        return None, f"{want} not applied: cannot create {cg} ({e.strerror or e})"
    return cg, f"{want} applied: cgroup v2 {cg} memory.max={memory}"


def limits_for(plan: dict, rid: str) -> Limits:
    step = plan["steps"]["serve"]
    l = step.get("limits") or {}
    if plan["runtime"] == "container":
        flags = [a for a in step["argv"] if a in ("--memory", "--memory-swap", "--ulimit", "--shm-size", "--cpuset-cpus", "--gpus")]
        return Limits(lines=[f"limits: enforced by docker, flags in the argv ({', '.join(flags) or 'none'})"])
    out = Limits()
    out.memlock, line = memlock_limit(l.get("memlock"))
    out.lines.append(line)
    cpus = l.get("cpus")
    if cpus:
        want = parse_cpulist(str(cpus))
        have = os.sched_getaffinity(0)
        if not want <= have:
            raise KilnError(f"cpus {cpus}: CPUs {sorted(want - have)} are not available to this process "
                            f"(allowed: {sorted(have)})")
        out.cpus = want
        out.lines.append(f"cpus: affinity {cpus} applied (sched_setaffinity)")
    else:
        out.lines.append("cpus: no affinity asked (all CPUs)")
    out.cgroup, line = cgroup_v2(rid, l.get("memoryBytes"), l.get("memorySwapBytes"))
    out.lines.append(line)
    if l.get("gpus"):
        out.lines.append("devices: not restricted (DeviceAllow= needs systemd)")
    return out


def published_port(argv: list[str]) -> tuple[str, int, int] | None:
    """The first `-p bind:host:container` in a docker argv."""
    for i, a in enumerate(argv[:-1]):
        if a == "-p":
            parts = argv[i + 1].split(":")
            if len(parts) == 3:
                return parts[0], int(parts[1]), int(parts[2])
    return None


@dataclass
class Server:
    """A running serve step: the child (when this process started it) and its record."""
    record: RunRecord
    proc: subprocess.Popen | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def log(self) -> str | None:
        return self.record.log

    def is_alive(self) -> bool | str:
        """True while it runs; else why it stopped: exit code, signal (SIGKILL: OOM-killed?) and the log's tail."""
        code = self.proc.poll() if self.proc is not None else (None if pid_alive(self.record.pid) else -1)
        if code is None:
            return True
        why = exit_reason(code) if self.proc is not None else "is gone"
        last = log_tail(self.log, TAIL)
        return f"the server {why}" + (f"; last log lines: {' | '.join(last)}" if last else "")

    def stop(self, timeout: float = 30) -> None:
        stop(self.record, timeout, self.proc)


def stop(record: RunRecord, timeout: float = 30, proc: subprocess.Popen | None = None) -> str:
    """SIGTERM the child's process group (a container: `docker stop` first), SIGKILL after `timeout`."""
    how = "was not running"
    if record.container and record.docker:
        subprocess.run([record.docker, "stop", "--time", str(int(timeout)), record.container], capture_output=True)
    if record.relay_pid and pid_alive(record.relay_pid):
        _signal_group(record.relay_pid, signal.SIGTERM)
    if record.pid and pid_alive(record.pid):
        _signal_group(record.pid, signal.SIGTERM)
        how = "stopped (SIGTERM)"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None or not pid_alive(record.pid):
                break
            time.sleep(0.1)
        else:
            _signal_group(record.pid, signal.SIGKILL)
            how = f"killed (SIGKILL after {timeout:.0f} s)"
    if proc is not None:
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
    remove_cgroup((record.extra or {}).get("cgroup"))
    return how


def remove_cgroup(path) -> None:
    """The run's cgroup goes with its last process (rmdir of an empty cgroup; a busy one stays)."""
    if path:
        try:
            os.rmdir(path)
        except OSError:
            pass


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)     # the child leads its own session and group
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def start(plan: dict, dirs: Dirs, recipe_path: str | None = None, detach: bool = False) -> Server:
    """Spawn the serve step's argv in its own session with the limits this host allows; record it."""
    rid = plan["id"]
    step = plan["steps"]["serve"]
    argv = step["argv"]
    gate = step.get("gate")
    if gate:    # a fleet worker: on a private loopback port, behind the allow-list gate (tool.runners.gate)
        inner = free_port()
        argv = [a.replace("@gate_port@", str(inner)) for a in gate["argv"]]
    limits = limits_for(plan, rid)
    dirs.run.mkdir(parents=True, exist_ok=True)
    log_path = dirs.run / f"{rid}.log"
    env = child_env(step.get("env"), dirs.env())
    container = docker = None
    if plan["runtime"] == "container":
        docker, container = argv[0], f"kiln-{rid}"
        # As the unit's ExecStartPre: a container left from a crash would make `docker run --name` refuse.
        subprocess.run([docker, "rm", "--force", container], capture_output=True, env=env)
    port = int(plan["options"]["port"])
    record = RunRecord(id=rid, runner="foreground", runtime=plan["runtime"],
                       endpoint=plan["endpoint"] or f"tcp://{gate['listen'] if gate else '-'}",
                       port=port, container=container, docker=docker, log=str(log_path),
                       started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), recipe_path=recipe_path)
    with open(log_path, "w") as log:
        log.write(f"# kiln: {' '.join(argv)}\n")
        log.flush()
        try:
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=limits.preexec, close_fds=True)
        except (OSError, subprocess.SubprocessError) as e:     # not found, not executable, preexec refused
            remove_cgroup(limits.cgroup)
            raise MissingDependency(f"{rid}: serve: cannot run {argv[0]} ({getattr(e, 'strerror', None) or e})") from None
    record.pid = proc.pid
    record.extra = {"limits": limits.lines, "detached": detach,
                    **({"cgroup": str(limits.cgroup)} if limits.cgroup else {})}
    server = Server(record, proc, list(limits.lines))
    record.save(dirs.run)
    if gate:
        try:
            start_gate(server, gate, inner)
        except BaseException:
            server.stop(10)
            record.forget(dirs.run)
            raise
        record.save(dirs.run)
    if container:
        try:
            relay_if_unpublished(server, env)
        except BaseException:
            server.stop(10)
            record.forget(dirs.run)
            raise
        record.save(dirs.run)
    return server


def start_gate(server: Server, gate: dict, inner: int, wait_s: float = 10) -> None:
    """The worker's fleet address, admitting only the fleet's hosts, relayed to its private port; ready when the
    fleet address answers."""
    rec = server.record
    proc = subprocess.Popen([sys.executable, "-m", "tool.runners.gate", "--listen", gate["listen"],
                             "--allow", ",".join(gate["allow"]), "--to", f"127.0.0.1:{inner}", "--pid", str(rec.pid)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                            start_new_session=True, cwd=str(Path(__file__).resolve().parents[2]))
    rec.relay_pid = proc.pid           # stop() ends it with the worker
    me = parse_peer(f"gate={gate['listen']}")
    deadline = time.monotonic() + wait_s
    while answers(me, 0.5) is not None:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise KilnError(f"{rec.id}: the allow-list gate on {gate['listen']} did not start "
                            f"({'it exited ' + str(proc.returncode) if proc.poll() is not None else 'no answer'}); "
                            "is the fleet address this host's and the port free?")
        time.sleep(0.1)
    server.notes.append(f"fleet: no systemd to apply IPAddressAllow=: rpc-server listens on 127.0.0.1:{inner}, and "
                        f"{gate['listen']} admits only {', '.join(gate['allow'])} (tool.runners.gate, pid {proc.pid})")


def _inspect(docker: str, name: str, env: dict) -> dict | None:
    r = subprocess.run([docker, "inspect", name], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        return None
    try:
        return json.loads(r.stdout)[0]
    except (ValueError, IndexError):
        return None


def relay_if_unpublished(server: Server, env: dict, wait_s: float = 60) -> None:
    """When the daemon accepted `-p` but bound nothing (no bridge network), relay the port into the netns."""
    rec = server.record
    deadline = time.monotonic() + wait_s
    info = None
    while time.monotonic() < deadline:     # docker run pulls first: wait for the container to be running
        if server.proc.poll() is not None:
            return
        info = _inspect(rec.docker, rec.container, env)
        if info and info.get("State", {}).get("Running"):
            break
        time.sleep(0.2)
    else:
        return
    asked = published_port(server.proc.args)
    bound = (info.get("NetworkSettings") or {}).get("Ports") or {}
    if asked is None or any(bound.values()):
        return
    bind, host_port, cport = asked
    pid = info["State"]["Pid"]
    relay = subprocess.Popen([sys.executable, "-m", "tool.runners.relay", "--listen", f"{bind}:{host_port}",
                              "--pid", str(pid), "--to", f"127.0.0.1:{cport}"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                             start_new_session=True, cwd=str(Path(__file__).resolve().parents[2]))
    rec.relay_pid = relay.pid
    mode = (info.get("HostConfig") or {}).get("NetworkMode")
    server.notes.append(f"port: the daemon bound nothing for -p {bind}:{host_port}:{cport} (network mode {mode}, no "
                        f"bridge network): relayed into the container's network namespace (pid {relay.pid})")
