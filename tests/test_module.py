"""The NixOS module (nix/module.nix) evaluated by the real NixOS module system.

../shared/nixpkgs/eval-nixos.nix runs `lib.evalModules` (the real nixpkgs lib) over the real NixOS
files that declare and render systemd services, users, groups and assertions, plus a stand-in `pkgs`
(fake derivations: nothing is built). tests/fixtures/nixos/more-options.nix adds the declarations of
the few other NixOS options the module reads or sets (podman, oci-containers' backend,
environment.systemPackages, system.checks). What this does not cover: building anything, activation
and switch-to-configuration itself, docker's/podman's own modules.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.fixtures.shared_nixpkgs import shared_nixpkgs
from tool.recipes import index

REPO = Path(__file__).resolve().parent.parent
MORE_OPTIONS = REPO / "tests" / "fixtures" / "nixos" / "more-options.nix"


NIXPKGS = shared_nixpkgs()
pytestmark = [
    pytest.mark.skipif(shutil.which("nix-instantiate") is None, reason="Nix is not installed"),
    pytest.mark.skipif(NIXPKGS is None, reason="../shared/nixpkgs (the NixOS module harness) is not beside the checkout"),
]

DOCKER = '{ virtualisation.docker.enable = true; }'
GPU_DOCKER = '{ virtualisation.docker.enable = true; hardware.nvidia-container-toolkit.enable = true; }'


def nix_eval(modules: list[str], attr: str) -> subprocess.CompletedProcess:
    mods = " ".join([str(REPO / "nix" / "module.nix"), str(MORE_OPTIONS)] + [f"({m})" for m in modules])
    return subprocess.run(
        ["nix-instantiate", "--eval", "--strict", "--json", str(NIXPKGS / "eval-nixos.nix"),
         "--arg", "modules", f"[ {mods} ]", "-A", attr],
        capture_output=True, text=True)


def evaluate(modules: list[str], attr: str):
    proc = nix_eval(modules, attr)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def enable(rid: str, extra: str = "") -> str:
    return f'{{ services.kiln.recipes."{rid}" = {{ enable = true; {extra} }}; }}'


def kiln_units(modules: list[str]) -> dict[str, str]:
    return {k: v for k, v in evaluate(modules, "units").items() if k.startswith("kiln-")}


def failed(modules: list[str]) -> list[str]:
    return evaluate(modules, "failedAssertions")


def service(modules: list[str], name: str, attr: str):
    return evaluate(modules, f'config.systemd.services."{name}".{attr}')


# --- unit texts, normalised ---------------------------------------------------------------------------
# NixOS' rendering (nixos/lib/systemd-lib.nix) differs from toUnitText's in ways that do not change what
# systemd does, and the module differs on purpose in a few named places. Each is undone here, by name:
STORE_RECIPE = re.compile(r"/nix/store/[0-9a-z]{32}-[^ \"]*\.json")


def sections(text: str, recipe_id: str) -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):            # comments: toUnitText's `# why:` lines
            continue
        if line.startswith("["):
            current = out.setdefault(line.strip("[]"), [])
            continue
        key, _, value = line.partition("=")
        if key == "Environment" and value.startswith('"PATH='):
            continue                                    # PATH line: NixOS' default `path` for every service
        if key.startswith("X-"):
            continue                                    # X-RestartIfChanged=false: the module's switch policy
        if key == "WantedBy":
            continue                                    # [Install]: the module's starter is what multi-user wants
        value = {"true": "yes", "false": "no"}.get(value, value)        # yes/true
        # recipe reference: the units name the recipe's store path, tool materialise its id
        value = STORE_RECIPE.sub(recipe_id, value)
        # one-line lists: NixOS writes Requires=a b, toUnitText one line per value
        values = value.split() if key in ("Requires", "Wants", "After") else [value]
        current.extend((key, v) for v in values)
    # key order: NixOS sorts keys alphabetically
    return {name: sorted(kv) for name, kv in out.items() if kv}


def materialised(tmp_path: Path, rid: str, flags: list[str]) -> tuple[dict[str, str], list[str]]:
    root = tmp_path / rid
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([str(Path(os.sys.executable)), "-m", "tool.cli", "materialise", rid, "--root", str(root), *flags],
                          capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0 and "No module named tool.cli.__main__" in proc.stderr:
        proc = subprocess.run([str(Path(os.sys.executable).parent / "tool"), "materialise", rid, "--root", str(root), *flags],
                              capture_output=True, text=True, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    units = {p.name: p.read_text() for p in (root / "etc/systemd/system").iterdir()}
    tmpfiles = (root / "etc/tmpfiles.d" / f"kiln-{rid}.conf").read_text().splitlines()
    return units, tmpfiles


@pytest.mark.parametrize("rid", sorted(index()))
def test_module_units_equal_tool_materialise(tmp_path, rid):
    # The deprecated enableNvidia keeps docker's --gpus, so the argv is the one `tool materialise` writes.
    mods = ['{ virtualisation.docker.enable = true; virtualisation.docker.enableNvidia = true; }', enable(rid)]
    cfg = evaluate(mods, "config.services.kiln")
    docker = evaluate(mods, "config.virtualisation.docker.package.outPath")
    flags = ["--uid", str(cfg["uid"]), "--gid", str(cfg["gid"]),
             "--tool-bin", f'{cfg["package"]}/bin/tool',
             "--engine-bin", f'{cfg["enginePackage"]}/bin/engine',
             "--docker-bin", f"{docker}/bin/docker"]
    want_units, want_tmpfiles = materialised(tmp_path, rid, flags)
    got = kiln_units(mods)
    starter = f"kiln-{rid}-start.service"
    assert starter in got
    got.pop(starter)
    assert sorted(got) == sorted(want_units)
    for name in want_units:
        assert sections(got[name], rid) == sections(want_units[name], rid), name
    # tmpfiles link vs file: the module links a mounted file from the store (L+), materialise writes it
    rules = evaluate(mods, "config.systemd.tmpfiles.rules")
    assert [r for r in rules if not r.startswith("L+ ")] == want_tmpfiles
    linked = sorted(r.split()[1] for r in rules if r.startswith("L+ "))
    plan_files = sorted(str(p.relative_to(tmp_path / rid)) for p in (tmp_path / rid).rglob("*")
                        if p.is_file() and "etc/" not in str(p.relative_to(tmp_path / rid)))
    assert linked == ["/" + p for p in plan_files]


# --- item 3: custom recipes ---------------------------------------------------------------------------
def custom_recipe(tmp_path: Path, rid: str, base: str = "smollm2-135m", **changes) -> Path:
    data = json.loads(index()[base].read_text())
    data["id"] = rid
    data.update(changes)
    p = tmp_path / "my.json"
    p.write_text(json.dumps(data))
    return p


def store_path(p: Path) -> str:
    proc = subprocess.run(["nix-instantiate", "--eval", "--expr", f'"${{{p}}}"'], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_custom_recipe_units_run_that_file(tmp_path):
    f = custom_recipe(tmp_path, "my-demo")
    mods = [f'{{ services.kiln.recipes.my-demo = {{ enable = true; recipe = {f}; }}; }}']
    assert failed(mods) == []
    units = kiln_units(mods)
    fetch = units["kiln-my-demo-fetch.service"]
    assert f"bin/tool fetch {store_path(f)}\n" in fetch
    assert f"bin/tool check {store_path(f)} --endpoint" in units["kiln-my-demo-check.service"]
    assert f"bin/tool check {store_path(f)} --gates load" in units["kiln-my-demo.service"]


def test_custom_recipe_with_a_bundled_id_runs_the_copy(tmp_path):
    f = custom_recipe(tmp_path, "smollm2-135m", title="my modified copy")
    mods = [f'{{ services.kiln.recipes."smollm2-135m" = {{ enable = true; recipe = {f}; }}; }}']
    fetch = kiln_units(mods)["kiln-smollm2-135m-fetch.service"]
    assert f"fetch {store_path(f)}\n" in fetch and "my modified copy" in fetch


def test_custom_recipe_whose_id_is_not_the_attribute_name_fails(tmp_path):
    f = custom_recipe(tmp_path, "my-demo")
    msgs = failed([f'{{ services.kiln.recipes.other-name = {{ enable = true; recipe = {f}; }}; }}'])
    assert len(msgs) == 1
    assert 'services.kiln.recipes."other-name"' in msgs[0] and '"my-demo"' in msgs[0] and str(f) in msgs[0]
    assert "kiln-my-demo-fetch.service" not in kiln_units([f'{{ services.kiln.recipes.other-name = {{ enable = true; recipe = {f}; }}; }}'])


def test_a_recipe_file_that_does_not_validate_is_named(tmp_path):
    f = custom_recipe(tmp_path, "my-demo", serve={"port": 70000})
    msgs = failed([f'{{ services.kiln.recipes.my-demo = {{ enable = true; recipe = {f}; }}; }}'])
    assert msgs and "my-demo" in msgs[0] and "$.serve.port" in msgs[0] and "1-65535" in msgs[0]


def test_an_unknown_recipe_id_is_named_with_the_bundled_ones():
    msgs = failed([enable("glm-9")])
    assert len(msgs) == 1 and '"glm-9"' in msgs[0] and "smollm2-135m" in msgs[0]


def test_the_system_build_validates_each_recipe_file():
    mods = [enable("smollm2-135m")]
    assert len(evaluate(mods, "config.system.checks")) == 1
    script = evaluate(mods, "config.system.checks.0.stub.script")
    assert f"tool validate {store_path(index()['smollm2-135m'])}\n" in script


# --- item 4: GPU containers through CDI ---------------------------------------------------------------
def test_gpu_container_uses_cdi_with_the_nvidia_container_toolkit():
    units = kiln_units([GPU_DOCKER, enable("glm-5.3-flash")])
    serve = units["kiln-glm-5.3-flash.service"]
    assert "--device nvidia.com/gpu=all" in serve and "--gpus" not in serve


def test_gpu_container_without_cdi_is_an_assertion():
    msgs = failed([DOCKER, enable("glm-5.3-flash")])
    assert any("glm-5.3-flash" in m and "hardware.nvidia-container-toolkit.enable" in m and "GPU" in m for m in msgs)


# --- item 5: the container CLI from nixpkgs ---------------------------------------------------------
def test_container_units_run_docker_from_nixpkgs():
    mods = [GPU_DOCKER, enable("glm-5.3-flash")]
    docker = evaluate(mods, "config.virtualisation.docker.package.outPath")
    serve = kiln_units(mods)["kiln-glm-5.3-flash.service"]
    assert f"ExecStart={docker}/bin/docker run " in serve and "/usr/bin/docker" not in serve


# --- item 6: a switch does not restart the chain; a real change does --------------------------------
def trigger(mods: list[str], rid: str) -> str:
    """The starter's whole unit text: what switch-to-configuration compares to decide a restart."""
    return kiln_units(mods)[f"kiln-{rid}-start.service"]


def test_chain_units_are_not_restarted_by_a_switch():
    mods = [enable("smollm2-135m")]
    units = kiln_units(mods)
    chain = [n for n in units if n != "kiln-smollm2-135m-start.service"]
    assert len(chain) == 5
    for name in chain:
        assert "X-RestartIfChanged=false" in units[name], name
    assert "X-RestartIfChanged" not in units["kiln-smollm2-135m-start.service"]


def test_a_new_kiln_or_nixpkgs_does_not_change_the_trigger_a_recipe_change_does():
    base = [enable("smollm2-135m")]
    other_pkgs = ('{ pkgs, ... }: { services.kiln.package = pkgs.writeShellScriptBin "tool" "new kiln"; '
                  'services.kiln.enginePackage = pkgs.writeShellScriptBin "engine" "new engine"; }')
    before, after = kiln_units(base), kiln_units(base + [other_pkgs])
    assert before["kiln-smollm2-135m.service"] != after["kiln-smollm2-135m.service"]       # new store paths …
    assert trigger(base, "smollm2-135m") == trigger(base + [other_pkgs], "smollm2-135m")    # … same starter
    starter = trigger(base, "smollm2-135m")
    assert "/nix/store/" not in starter and re.search(r"^X-Kiln-Chain=[0-9a-f]{64}$", starter, re.M), starter
    # an option, an override, or the recipe itself: the trigger changes, so the switch restarts the starter
    assert trigger([enable("smollm2-135m", "port = 8123;")], "smollm2-135m") != trigger(base, "smollm2-135m")
    override = '{ systemd.services."kiln-smollm2-135m".serviceConfig.MemoryMax = "8G"; }'
    assert trigger(base + [override], "smollm2-135m") != trigger(base, "smollm2-135m")


def test_a_changed_recipe_file_changes_the_trigger(tmp_path):
    a = custom_recipe(tmp_path, "smollm2-135m")
    ta = trigger([f'{{ services.kiln.recipes."smollm2-135m" = {{ enable = true; recipe = {a}; }}; }}'], "smollm2-135m")
    b = custom_recipe(tmp_path, "smollm2-135m", title="another revision")
    tb = trigger([f'{{ services.kiln.recipes."smollm2-135m" = {{ enable = true; recipe = {b}; }}; }}'], "smollm2-135m")
    assert ta != tb


# --- item 7: the first switch does not wait for the chain -------------------------------------------
def test_only_the_non_blocking_starter_is_wanted_by_multi_user():
    mods = [GPU_DOCKER, enable("glm-5.3-flash")]
    units = kiln_units(mods)
    wanted = sorted(n for n, t in units.items() if "WantedBy=multi-user.target" in t)
    assert wanted == ["kiln-glm-5.3-flash-start.service"]
    start = units["kiln-glm-5.3-flash-start.service"]
    exec_start = next(l for l in start.splitlines() if l.startswith("ExecStart="))
    assert "systemctl restart --no-block" in exec_start
    for step in ("fetch", "prepare", "verify", "check"):
        assert f"kiln-glm-5.3-flash-{step}.service" in exec_start
    assert "kiln-glm-5.3-flash.service" in exec_start.split()
    assert "Type=oneshot" in start and "TimeoutStartSec=infinity" not in start
    assert "/nix/store/" not in start              # no store path: a new nixpkgs leaves the starter's text alone


# --- item 8: ids and an existing user ---------------------------------------------------------------
def test_the_kiln_user_has_static_ids_outside_the_dynamic_range():
    mods = [enable("smollm2-135m")]
    user = evaluate(mods, "config.users.users.kiln")
    group = evaluate(mods, "config.users.groups.kiln")
    assert user["isSystemUser"] and not (400 <= user["uid"] <= 999) and user["uid"] >= 1000
    assert not (400 <= group["gid"] <= 999)
    assert failed(mods) == []


def test_the_module_defaults_are_the_compilers():
    """stateDir, user, group, uid and gid default to nix/lib's defaultOptions, the one place each is written in
    Nix (the module used to spell "/var/lib/kiln" and "kiln" again)."""
    cfg = evaluate([enable("smollm2-135m")], "config.services.kiln")
    lib = json.loads(subprocess.run(
        ["nix-instantiate", "--eval", "--strict", "--json", "-E", f"(import {REPO / 'nix' / 'lib'}).defaultOptions"],
        capture_output=True, text=True, check=True).stdout)
    assert {k: cfg[k] for k in ("stateDir", "user", "group", "uid", "gid")} == \
        {k: lib[k] for k in ("stateDir", "user", "group", "uid", "gid")}
    spelled = [f.name for f in (REPO / "nix").rglob("*.nix") if f.name != "tests.nix" and '"/var/lib/kiln"' in f.read_text()]
    assert spelled == ["options.nix"]


def test_an_existing_user_is_honoured():
    existing = ('{ users.users.alice = { isNormalUser = true; uid = 1000; group = "users"; home = "/home/alice"; };'
                '  users.groups.users.gid = 100;'
                '  services.kiln.user = "alice"; services.kiln.group = "users"; }')
    mods = [existing, enable("smollm2-135m")]
    assert failed(mods) == []
    alice = evaluate(mods, "config.users.users.alice")
    assert alice["home"] == "/home/alice" and alice["uid"] == 1000 and not alice["isSystemUser"]
    assert "kiln" not in evaluate(mods, "config.users.users")
    units = kiln_units(mods)
    assert "User=alice" in units["kiln-smollm2-135m-fetch.service"]


def test_an_existing_user_without_a_static_uid_is_an_assertion():
    existing = '{ users.users.bob = { isSystemUser = true; group = "bob"; }; users.groups.bob = { }; services.kiln.user = "bob"; services.kiln.group = "bob"; }'
    msgs = failed([existing, enable("smollm2-135m")])
    assert any("services.kiln.uid" in m and "bob" in m for m in msgs)


# --- item 9: ports, binds and the firewall ----------------------------------------------------------
def test_a_non_loopback_container_bind_needs_an_explicit_opt_in():
    msgs = failed([GPU_DOCKER, enable("glm-5.3-flash", 'bindAddress = "0.0.0.0"; openFirewall = true;')])
    assert any("glm-5.3-flash" in m and "bindAddress" in m and "firewall" in m and "allowUnfirewalledBind" in m for m in msgs)
    assert failed([GPU_DOCKER, enable("glm-5.3-flash", 'bindAddress = "0.0.0.0"; allowUnfirewalledBind = true;')]) == []


@pytest.mark.parametrize("bind", ["localhost", "::1", "127.0.0.2"])
def test_open_firewall_on_any_loopback_address_is_an_assertion(bind):
    msgs = failed([enable("smollm2-135m", f'bindAddress = "{bind}"; openFirewall = true;')])
    assert any("openFirewall" in m and bind in m and "loopback" in m for m in msgs)


def test_loopback_spellings_publish_an_ip_literal():
    units = kiln_units([GPU_DOCKER, enable("glm-5.3-flash", 'bindAddress = "::1";')])
    assert '-p "[::1]:8000:30000"' in units["kiln-glm-5.3-flash.service"]
    units = kiln_units([GPU_DOCKER, enable("glm-5.3-flash", 'bindAddress = "localhost";')])
    assert "-p 127.0.0.1:8000:30000" in units["kiln-glm-5.3-flash.service"]


def test_two_recipes_on_one_port_is_an_assertion():
    msgs = failed([GPU_DOCKER, enable("glm-5.3-flash"), enable("glm-5.3", "port = 8000;")])
    assert any("port 8000" in m and "glm-5.3" in m and "glm-5.3-flash" in m for m in msgs)
    assert not any("port 8000" in m for m in failed([GPU_DOCKER, enable("glm-5.3-flash"), enable("glm-5.3", "port = 8001;")]))


def test_an_out_of_range_option_names_the_option_and_the_limit():
    proc = nix_eval([enable("smollm2-135m", "port = 70000;")], "units")
    assert proc.returncode != 0
    assert "services.kiln.recipes.smollm2-135m.port" in proc.stderr and "65535" in proc.stderr


# --- item 10: podman ----------------------------------------------------------------------------------
def test_podman_runs_container_recipes_without_the_docker_group():
    mods = ['{ virtualisation.podman.enable = true; hardware.nvidia-container-toolkit.enable = true; }', enable("glm-5.3-flash")]
    assert failed(mods) == []
    assert evaluate(mods, "config.services.kiln.containerRuntime") == "podman"
    units = kiln_units(mods)
    for name in ("kiln-glm-5.3-flash-prepare.service", "kiln-glm-5.3-flash.service"):
        text = units[name]
        assert "/bin/podman run " in text and "bin/docker" not in text and "docker.service" not in text, name
        assert "SupplementaryGroups" not in text and "User=" not in text, name
        assert "--user 2960:2960" in text or name.endswith("flash.service"), name


def test_no_container_runtime_is_an_assertion():
    msgs = failed(['{ hardware.nvidia-container-toolkit.enable = true; }', enable("glm-5.3-flash")])
    assert any("glm-5.3-flash" in m and "virtualisation.podman.enable" in m for m in msgs)   # oci-containers' default


def test_docker_keeps_its_group_and_user():
    text = kiln_units([GPU_DOCKER, enable("glm-5.3-flash")])["kiln-glm-5.3-flash.service"]
    assert "SupplementaryGroups=docker" in text and "User=kiln" in text
    assert re.search(r"^After=.*docker\.service", text, re.M)


# --- item 11: a plain definition overrides ------------------------------------------------------------
def test_a_plain_definition_overrides_a_compiled_setting():
    mods = [enable("smollm2-135m"), '{ systemd.services."kiln-smollm2-135m".serviceConfig.MemoryMax = "8G"; }']
    text = kiln_units(mods)["kiln-smollm2-135m.service"]
    assert "MemoryMax=8G" in text and "MemoryMax=6442450944" not in text


# --- item 13: the tool on the system's PATH -------------------------------------------------------
def test_the_tool_is_installed_system_wide():
    mods = [enable("smollm2-135m")]
    assert len(evaluate(mods, "config.environment.systemPackages")) == 1
    assert evaluate(mods, "config.environment.systemPackages.0.name") == "kiln-tool-0.1.0"


# --- the module's units pass real systemd-analyze verify ------------------------------------------------
def fake_package(tmp_path: Path, name: str, programs: list[str]) -> str:
    """A derivation-shaped attrset whose outPath is a real directory with bin/<program> scripts, so that
    systemd-analyze verify finds the executables the units name (the stand-in pkgs' paths do not exist)."""
    out = tmp_path / name
    (out / "bin").mkdir(parents=True, exist_ok=True)
    for p in programs:
        (out / "bin" / p).write_text("#!/bin/sh\nexit 0\n")
        (out / "bin" / p).chmod(0o755)
    return f'{{ type = "derivation"; name = "{name}"; outPath = "{out}"; meta.mainProgram = "{programs[0]}"; }}'


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("rid,runtime", [(r, "docker") for r in sorted(index())] + [("glm-5.3-flash", "podman")])
def test_module_units_pass_systemd_analyze_verify(tmp_path, rid, runtime):
    pkgs = (f'{{ services.kiln.package = {fake_package(tmp_path, "tool", ["tool"])};'
            f'  services.kiln.enginePackage = {fake_package(tmp_path, "engine", ["engine"])};'
            f'  services.kiln.llamaCppPackage = {fake_package(tmp_path, "llama-cpp", ["llama-server", "rpc-server"])};'
            f'  virtualisation.{runtime}.enable = true; hardware.nvidia-container-toolkit.enable = true;'
            f'  virtualisation.{runtime}.package = {fake_package(tmp_path, runtime, [runtime])}; }}')
    units = kiln_units([pkgs, enable(rid)])
    d = tmp_path / "units"
    d.mkdir()
    for name, text in units.items():
        (d / name).write_text(text)
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", *sorted(str(p) for p in d.iterdir())],
                          capture_output=True, text=True)
    lines = [l for l in (proc.stdout + proc.stderr).splitlines() if l.strip()]
    # The one program that is not here: NixOS' /run/current-system/sw/bin/systemctl, which the starter names.
    starter = f"kiln-{rid}-start.service"
    lines = [l for l in lines if not (starter in l and "/run/current-system/sw/bin/systemctl" in l)]
    assert lines == [], lines
