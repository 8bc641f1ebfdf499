"""`tool up`: preflight → (pull) → fetch → prepare → verify → serve → the checks → a report.

Each step either does its work or says why it was skipped (what is published and verifies is not
redone), so an interrupted `tool up` resumes where it stopped. Nothing half-made is ever published:
fetch and prepare stage and rename, and a server this run started is stopped again when anything
after it fails or the user presses Ctrl-C.
"""
from __future__ import annotations

import copy
import json
import subprocess
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import requests

from tool.errors import Exit, IntegrityError, KilnError, NetworkError, last_line
from tool.fleet import first_silent, host_view, peers_of, wait_for
from tool.images import present_by_digest, short
from tool.pids import pid_alive
from tool.plan import compile_plan, plan_options
from tool.programs import llama_cpp_program
from tool.run_record import RunRecord
from tool.state import Dirs
from tool import preflight
from tool.checks.baseline import from_plan
from tool.checks.runner import run_checks
from tool.fetch import Progress, fetch
from tool.prepare import prepare
from tool.runners import foreground, systemd
from tool.store_verify import verify_store
from tool.weights import read_marker, verify_offline, weights_dir

STEPS = ("preflight", "pull", "fetch", "prepare", "verify", "workers", "serve", "checks")


@dataclass
class StepResult:
    status: str         # ok | skipped | failed | inconclusive | none
    seconds: float
    detail: str


@dataclass
class Options:
    runner: str = "foreground"
    once: bool = False
    port: int | None = None
    gates: list[str] | None = None
    load_timeout_s: float | None = None
    stop_timeout_s: float = 30.0
    fleet: dict = field(default_factory=dict)   # a fleet recipe: host, fleetAddresses, … (nix/lib's options)


@dataclass
class Report:
    recipe: str
    runner: str
    endpoint: str | None = None
    steps: dict[str, dict] = field(default_factory=dict)
    limits: list[str] = field(default_factory=list)
    checks: dict | None = None
    engine: dict = field(default_factory=dict)
    verdict: str = "fail"
    log: str | None = None
    running: bool = False
    run_id: str | None = None           # what `tool down` takes: the recipe's id, or <id>-<host> for a fleet worker

    def as_dict(self) -> dict:
        return asdict(self)


class Up:
    def __init__(self, recipe, dirs: Dirs, opts: Options, say: Callable[[str], None] = lambda s: None,
                 reporter=None, progress=None):
        self.recipe, self.dirs, self.opts, self.say = recipe, dirs, opts, say
        self.reporter, self.progress = reporter, progress
        self.report = Report(recipe.id, opts.runner)
        self.plan_options = {**plan_options(dirs), **({"port": opts.port} if opts.port else {}), **opts.fleet}
        if recipe.runtime == "llama-cpp":
            self.plan_options |= {"llamaServerBin": llama_cpp_program("llama-server"),
                                  "rpcServerBin": llama_cpp_program("rpc-server")}
        self.plan: dict | None = None
        self.server = None

    # -- one step at a time, each timed and recorded ------------------------------------------------
    def step(self, name: str, fn) -> StepResult:
        t0 = time.monotonic()
        try:
            status, detail = fn()
        except BaseException as e:
            detail = getattr(e, "message", None) or ("interrupted" if isinstance(e, KeyboardInterrupt) else str(e))
            self.report.steps[name] = asdict(StepResult("failed", round(time.monotonic() - t0, 3), detail))
            raise
        r = StepResult(status, round(time.monotonic() - t0, 3), detail)
        self.report.steps[name] = asdict(r)
        self.say(f"{name:<10} {status:<8} {detail} ({r.seconds:.1f} s)")
        return r

    def run(self) -> Report:
        if self.opts.runner == "systemd":
            if why := systemd.unusable():      # say so before anything is downloaded or built
                raise KilnError(f"--runner systemd: {why}; use --runner foreground", Exit.MISSING_DEP)
        self.plan = compile_plan(self.recipe, self.plan_options)
        self.report.endpoint = self.plan["endpoint"]
        self.report.run_id = self.plan["id"]
        self.refuse_if_running()
        self.step("preflight", self.preflight)
        if self.plan["runtime"] == "container":
            self.step("pull", self.pull)
        self.step("fetch", self.fetch)
        self.step("prepare", self.prepare)
        self.step("verify", self.verify)
        if self.workers:
            self.step("workers", self.wait_for_workers)
        try:
            self.step("serve", self.serve)
            self.step("checks", self.checks)
            if not self.is_worker:
                self.report.engine = scrape_metrics(self.report.endpoint)
        except BaseException:
            self.stop_server()
            raise
        if self.opts.once:
            self.stop_server()
        else:
            self.report.running = self.server is not None and self.server_alive()
            if not self.report.running:
                self.stop_server()
        return self.report

    # -- the steps --------------------------------------------------------------------------------
    @property
    def workers(self) -> list:
        """A fleet head's workers (tool.fleet.Peer), as the plan places them; [] for any other plan."""
        fleet = (self.plan or {}).get("fleet") or {}
        return peers_of(self.plan) if fleet.get("role") == "head" else []

    @property
    def is_worker(self) -> bool:
        return ((self.plan or {}).get("fleet") or {}).get("role") == "worker"

    def refuse_if_running(self) -> None:
        rec = RunRecord.load(self.dirs.run, self.plan["id"])
        if rec is None:
            return
        if rec.runner == "foreground" and not pid_alive(rec.pid):
            rec.forget(self.dirs.run)       # it died or was stopped outside `tool down`
            return
        raise KilnError(f"{self.plan['id']} already runs ({rec.runner}, pid {rec.pid or '-'}, {rec.endpoint}): "
                        f"`tool down {self.plan['id']}` first")

    def preflight(self):
        data = copy.deepcopy(self.recipe.data)
        data["serve"]["port"] = int(self.plan["options"]["port"])   # check the port that will be used
        fleet = self.plan.get("fleet")
        if fleet:                                                   # this host's needs and its peers
            from tool.preflight.fleet import check as fleet_checks   # with tool.preflight, imported when used
            data = host_view(data, fleet["host"])
        results = preflight.run(data, preflight.host_from_env(self.dirs.models, self.dirs.stores),
                                serves_api=not self.is_worker, reads_weights=self.plan["steps"]["fetch"] is not None)
        if fleet:       # the peers are waited for below (the workers step), with the recipe's timeout
            results += fleet_checks(self.plan, peers=False)
        failing = preflight.failures(results)
        warns = [c for c in results if c.status == "warn"]
        if failing:
            for c in failing:
                self.say(f"preflight  ✗ {c.id}: {c.detail}")
            more = f" (+{len(failing) - 1} more above)" if len(failing) > 1 else ""
            raise KilnError(f"preflight: no-go: {failing[0].id}: {failing[0].detail}{more}", Exit.FAILED)
        return "ok", f"go ({len(results)} checks, {len(warns)} warnings)"

    def pull(self):
        image = self.recipe["runtime"]["container"]["image"]
        docker = self.plan["options"]["dockerBin"]
        if image_present(docker, image):
            return "skipped", f"{short(image)} present locally by digest"
        r = subprocess.run([docker, "pull", image], capture_output=True, text=True)
        if r.returncode != 0:
            why = last_line(r.stderr or r.stdout)
            if "manifest unknown" in why or "not found" in why or "does not match" in why:
                raise IntegrityError(f"{image}: the registry has no image with this digest ({why}); nothing was run")
            raise NetworkError(f"{image}: docker pull failed ({why}); nothing was run")
        if not image_present(docker, image):
            raise IntegrityError(f"{image}: pulled, but no local image carries this digest; nothing was run")
        return "ok", f"{short(image)} pulled by digest"

    def fetch(self):
        if self.plan["steps"]["fetch"] is None:
            return "none", "this fleet host reads no weights (the head sends rpc-server the tensors it computes)"
        where = weights_dir(self.recipe, self.dirs.models)
        if read_marker(where) is not None:
            w = verify_offline(self.recipe, self.dirs.models)
            if w.ok:
                return "skipped", f"{where}: {w.files} files, {w.bytes} bytes re-hashed and match the marker"
            if w.mismatches:
                more = f" (+{len(w.mismatches) - 1} more)" if len(w.mismatches) > 1 else ""
                raise IntegrityError(f"{where}: {w.mismatches[0]}{more}; marker removed: `tool up` again re-fetches it")
        result = fetch(self.recipe, self.dirs.models, self.progress or Progress(enabled=False))
        verb = "already fetched" if result.already else "fetched and verified"
        return ("skipped" if result.already else "ok"), f"{verb}: {len(result.files)} files, {result.bytes} bytes"

    def prepare(self):
        r = prepare(self.recipe, self.dirs, plan=self.plan)
        return {"prepared": "ok"}.get(r.status, r.status), r.detail

    def verify(self):
        r = verify_store(self.recipe, self.dirs.models, self.dirs.stores, self.plan)
        if r.status == "none":
            return "none", r.detail
        if r.status != "ok":
            raise KilnError(f"verify: {r.detail}", r.exit_code if r.exit_code != Exit.OK else Exit.INTEGRITY)
        return "ok", r.detail

    def wait_for_workers(self):
        """systemd cannot order units on two machines: the head waits for its workers, as its unit's ExecStartPre."""
        timeout = self.plan["fleet"]["timeoutSeconds"]
        took = wait_for(self.workers, timeout)
        return "ok", f"{', '.join(map(str, self.workers))} answered in {took:.1f} s (limit {timeout} s)"

    def alive(self):
        """The server runs and, for a fleet head, every worker answers; else why not, naming the worker."""
        alive = self.server.is_alive()
        if alive is not True or not self.workers:
            return alive
        silent = first_silent(self.workers)
        return True if silent is None else f"fleet worker {silent[0]} does not answer ({silent[1]})"

    def serve(self):
        if self.opts.runner == "systemd":
            rec = systemd.start(self.plan)
            rec.save(self.dirs.run)
            self.server = _SystemdServer(rec)
            return "ok", f"started {rec.unit}"
        self.server = foreground.start(self.plan, self.dirs, str(self.recipe.path), detach=not self.opts.once)
        if self.workers:                # `tool status` names a worker that stops answering
            self.server.record.extra["fleet_workers"] = [f"{w.name}={w.where}" for w in self.workers]
            self.server.record.save(self.dirs.run)
        self.report.limits = list(self.server.notes)
        self.report.endpoint = self.report.endpoint or self.server.record.endpoint
        self.report.log = self.server.log
        for line in self.server.notes:
            self.say(f"{'':<10} {line}")
        return "ok", f"pid {self.server.record.pid}: {' '.join(self.plan['steps']['serve']['argv'][:2])} …, log {self.server.log}"

    def checks(self):
        if self.is_worker:
            self.report.verdict = "pass"
            return "none", f"a fleet worker serves no API: it answers on its fleet address {self.server.record.endpoint}"
        limits = {"load_timeout_s": self.opts.load_timeout_s} if self.opts.load_timeout_s else {}
        evidence = run_checks(self.recipe, self.report.endpoint, self.opts.gates, is_alive=self.alive,
                              evidence_dir=self.dirs.evidence, reporter=self.reporter,
                              baseline=from_plan(self.plan), **limits)
        self.report.checks = evidence
        self.report.verdict = evidence["verdict"]
        failed, undecided = evidence["failed_gates"], evidence.get("inconclusive_gates") or []
        detail = f"verdict {evidence['verdict']}" + (f" (failed: {', '.join(failed)})" if failed else "") + \
            (f" (inconclusive: {', '.join(undecided)})" if undecided and not failed else "") + \
            f"; evidence {', '.join(evidence.get('evidence_files') or [])}"
        return ("failed" if failed else "inconclusive" if evidence["verdict"] == "inconclusive" else "ok"), detail

    # -- the server --------------------------------------------------------------------------------
    def server_alive(self) -> bool:
        return self.server is not None and self.server.is_alive() is True

    def stop_server(self) -> None:
        if self.server is None:
            return
        self.server.stop(self.opts.stop_timeout_s)
        self.server.record.forget(self.dirs.run)
        self.server = None


class _SystemdServer:
    def __init__(self, record: RunRecord):
        self.record = record
        self.is_alive = systemd.is_alive(record.unit)
        self.log = None

    def stop(self, timeout: float = 30) -> None:
        systemd.stop(self.record)


def image_present(docker: str, image: str) -> bool:
    """The local image is the pin (tool.images), asked through the plan's docker client."""
    r = subprocess.run([docker, "image", "inspect", "--format", "{{json .RepoDigests}}", image],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return False
    try:
        digests = json.loads(r.stdout.strip() or "[]") or []
    except ValueError:
        return False
    return present_by_digest(digests, image)


def scrape_metrics(endpoint: str | None) -> dict:
    """The engine's counters from /metrics: expert serves per tier, store bytes, tokens; {} if not Kiln's engine."""
    if not endpoint:
        return {}
    base = endpoint.removesuffix("/v1")
    try:
        r = requests.get(f"{base}/metrics", timeout=10)
    except requests.RequestException as e:
        return {"error": f"{base}/metrics: {type(e).__name__}"}
    if r.status_code != 200:
        return {"error": f"{base}/metrics answered {r.status_code} (not Kiln's engine?)"}
    from prometheus_client.parser import text_string_to_metric_families
    out: dict = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.name == "kiln_expert_served_total":
                out.setdefault("kiln_expert_served_total", {})[s.labels.get("tier", "?")] = int(s.value)
            elif s.name in ("kiln_store_read_bytes_total", "kiln_prompt_tokens_total", "kiln_generation_tokens_total"):
                out[s.name] = int(s.value)
            elif s.name in ("kiln_model_load_seconds",):
                out[s.name] = s.value
    return out
