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
from tool.images import present_by_digest, short
from tool.plan import compile_plan
from tool.state import Dirs, RunRecord, pid_alive
from tool import preflight
from tool.checks.baseline import from_plan
from tool.checks.runner import run_checks
from tool.fetch import Progress, fetch
from tool.prepare import prepare
from tool.runners import foreground, systemd
from tool.store_verify import verify_store
from tool.weights import read_marker, verify_offline, weights_dir

STEPS = ("preflight", "pull", "fetch", "prepare", "verify", "serve", "checks")


@dataclass
class StepResult:
    status: str         # ok | skipped | failed | none
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
    engine_bin: str | None = None       # the serve step's program (default: the `engine` beside this Python)


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

    def as_dict(self) -> dict:
        return asdict(self)


class Up:
    def __init__(self, recipe, dirs: Dirs, opts: Options, say: Callable[[str], None] = lambda s: None,
                 reporter=None, progress=None):
        self.recipe, self.dirs, self.opts, self.say = recipe, dirs, opts, say
        self.reporter, self.progress = reporter, progress
        self.report = Report(recipe.id, opts.runner)
        self.plan_options = {**dirs.plan_options(), **({"port": opts.port} if opts.port else {}),
                             **({"engineBin": opts.engine_bin} if opts.engine_bin else {})}
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
        self.refuse_if_running()
        self.step("preflight", self.preflight)
        if self.plan["runtime"] == "container":
            self.step("pull", self.pull)
        self.step("fetch", self.fetch)
        self.step("prepare", self.prepare)
        self.step("verify", self.verify)
        try:
            self.step("serve", self.serve)
            self.step("checks", self.checks)
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
    def refuse_if_running(self) -> None:
        rec = RunRecord.load(self.dirs.run, self.recipe.id)
        if rec is None:
            return
        if rec.runner == "foreground" and not pid_alive(rec.pid):
            rec.forget(self.dirs.run)       # it died or was stopped outside `tool down`
            return
        raise KilnError(f"{self.recipe.id} already runs ({rec.runner}, pid {rec.pid or '-'}, {rec.endpoint}): "
                        f"`tool down {self.recipe.id}` first")

    def preflight(self):
        data = copy.deepcopy(self.recipe.data)
        data["serve"]["port"] = int(self.plan["options"]["port"])   # check the port that will be used
        results = preflight.run(data, preflight.host_from_env(self.dirs.models, self.dirs.stores))
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

    def serve(self):
        if self.opts.runner == "systemd":
            rec = systemd.start(self.plan)
            rec.save(self.dirs.run)
            self.server = _SystemdServer(rec)
            return "ok", f"started {rec.unit}"
        self.server = foreground.start(self.plan, self.dirs, str(self.recipe.path), detach=not self.opts.once)
        self.report.limits = list(self.server.notes)
        self.report.log = self.server.log
        for line in self.server.notes:
            self.say(f"{'':<10} {line}")
        return "ok", f"pid {self.server.record.pid}: {' '.join(self.plan['steps']['serve']['argv'][:2])} …, log {self.server.log}"

    def checks(self):
        limits = {"load_timeout_s": self.opts.load_timeout_s} if self.opts.load_timeout_s else {}
        evidence = run_checks(self.recipe, self.report.endpoint, self.opts.gates, is_alive=self.server.is_alive,
                              evidence_dir=self.dirs.evidence, reporter=self.reporter,
                              baseline=from_plan(self.plan), **limits)
        self.report.checks = evidence
        self.report.verdict = evidence["verdict"]
        failed = evidence["failed_gates"]
        detail = f"verdict {evidence['verdict']}" + (f" (failed: {', '.join(failed)})" if failed else "") + \
            f"; evidence {', '.join(evidence.get('evidence_files') or [])}"
        return ("ok" if not failed else "failed"), detail

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
