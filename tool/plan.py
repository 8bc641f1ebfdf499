"""Plans: a recipe compiled by nix/lib (through tool.nixeval) with the caller's options.

The compiler is Nix's; this module only picks the defaults that depend on the host (the
service user's uid/gid) and renders a plan for people.
"""
from __future__ import annotations

import os
import pwd
import shlex

from tool import nixeval
from tool.programs import program
from tool.recipe_file import Recipe
from tool.state import Dirs

STEP_ORDER = ("fetch", "prepare", "verify", "serve", "check")
SERVICE_USER = "kiln"


def service_ids(user: str = SERVICE_USER) -> tuple[int, int]:
    """uid/gid docker's --user resolves to: the `kiln` user if it exists, else whoever runs the tool."""
    try:
        pw = pwd.getpwnam(user)
        return pw.pw_uid, pw.pw_gid
    except KeyError:
        return os.getuid(), os.getgid()


def plan_options(dirs: Dirs) -> dict:
    """The nix/lib options that put the plan's paths in `dirs`, and its programs (tool.programs) beside this Python.
    The container CLI only where $KILN_DOCKER_BIN names one (`nix run .#<id>` sets nixpkgs' docker);
    otherwise nix/lib's default stays, as `tool plan` prints it."""
    docker = os.environ.get("KILN_DOCKER_BIN")
    return {"stateDir": str(dirs.state), "modelsDir": str(dirs.models), "storeDir": str(dirs.stores),
            "engineBin": program("engine"), "toolBin": program("tool"), **({"dockerBin": docker} if docker else {})}


def compile_plan(recipe: Recipe, options: dict | None = None) -> dict:
    """The plan for `recipe`; options left out (or None) take nix/lib's defaults, uid/gid the host's."""
    opts = dict(options or {})
    if opts.get("uid") is None or opts.get("gid") is None:
        uid, gid = service_ids(opts.get("user") or SERVICE_USER)
        opts["uid"] = uid if opts.get("uid") is None else opts["uid"]
        opts["gid"] = gid if opts.get("gid") is None else opts["gid"]
    return nixeval.compile_plan(recipe.path, opts, recipe.id)


def _bytes(n: int | None) -> str | None:
    return None if n is None else f"{n} B ({n / 2**30:.1f} GiB)"


def describe_limits(limits: dict) -> str:
    """One line: each limit with its value, and what enforces it (docker flags or systemd)."""
    parts = []
    for label, key, fmt in (
        ("memory", "memoryBytes", _bytes),
        ("memory+swap", "memorySwapBytes", _bytes),
        ("memlock", "memlock", str),
        ("shm", "shmSize", str),
        ("cpus", "cpus", str),
        ("gpus", "gpus", str),
    ):
        value = limits.get(key)
        if value is not None:
            parts.append(f"{label} {fmt(value)}")
    if not parts:
        return "none"
    return ", ".join(parts) + f" (enforced by {limits.get('enforcedBy', '?')})"


def render(plan: dict) -> str:
    """Human form of a plan: per step its unit, each command shell-quoted, and its limits."""
    lines = [f"{plan['id']} ({plan['runtime']})"]
    if fleet := plan.get("fleet"):
        where = lambda h: f"{h['name']} {h['address']}:{h['port']}"
        lines.append(f"fleet: this is {fleet['role']} {where(fleet['self'])}; "
                     f"workers {', '.join(where(w) for w in fleet['workers'])}; admits {', '.join(fleet['allow'])}")
    for name in STEP_ORDER:
        step = plan["steps"].get(name)
        if step is None:
            lines.append(f"{name}: (none)")
            continue
        lines.append(f"{name}: {step['unit']}")
        for argv in step["commands"]:
            lines.append(f"  $ {shlex.join(argv)}")
        lines.append(f"  limits: {describe_limits(step['limits'])}")
    return "\n".join(lines) + "\n"
