"""Plans from the real Nix compiler: golden files for every recipe, the seed commands reproduced
option for option, and `tool plan`'s exact output and errors.

Regenerate the golden files after an intended change:
    KILN_REGEN_GOLDEN=1 .venv/bin/pytest tests/test_plan.py
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest

from tool import plan as plans, recipes
from tool.cli import main
from tool.errors import printable
from tool.recipes import index

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "golden"
REGEN = os.environ.get("KILN_REGEN_GOLDEN") == "1"
# Fixed ids so golden files do not depend on who runs the tests.
GOLDEN_OPTIONS = {"uid": 960, "gid": 960}
RECIPE_IDS = sorted(index())

pytestmark = pytest.mark.skipif(shutil.which("nix-instantiate") is None, reason="Nix is not installed")


def compiled(recipe_id: str, **options) -> dict:
    return plans.compile_plan(recipes.load(recipe_id), {**GOLDEN_OPTIONS, **options})


# ---------------------------------------------------------------- golden plans and units

def golden_tree(plan: dict) -> dict[str, bytes]:
    """relative path → bytes: what tests/golden/<id>/ must hold, exactly."""
    tree = {"plan.json": (json.dumps(plan, indent=2, sort_keys=True) + "\n").encode()}
    for name, text in plan["units"].items():
        tree[f"units/{name}"] = text.encode()
    for host_path, f in plan["files"].items():
        tree[f"files/{Path(host_path).name}"] = f["content"].encode()
    return tree


def compare_tree(directory: Path, expected: dict[str, bytes]) -> None:
    if REGEN:
        if directory.exists():
            shutil.rmtree(directory)
        for rel, data in expected.items():
            (directory / rel).parent.mkdir(parents=True, exist_ok=True)
            (directory / rel).write_bytes(data)
    actual = {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()} \
        if directory.is_dir() else {}
    missing = sorted(set(expected) - set(actual))
    extra = sorted(set(actual) - set(expected))
    assert not missing, f"{directory}: golden files missing (KILN_REGEN_GOLDEN=1 to write): {missing}"
    assert not extra, f"{directory}: golden files the compiler no longer produces: {extra}"
    for rel in sorted(expected):
        assert actual[rel].decode() == expected[rel].decode(), f"{directory / rel} differs"


@pytest.mark.parametrize("recipe_id", RECIPE_IDS)
def test_golden_plan_and_units(recipe_id):
    """A fleet recipe's golden tree is its head's plan plus, under hosts/<name>/, each worker's."""
    plan = compiled(recipe_id)
    tree = golden_tree(plan)
    for worker in (plan.get("fleet") or {}).get("workers", []):
        tree |= {f"hosts/{worker['name']}/{rel}": data
                 for rel, data in golden_tree(compiled(recipe_id, host=worker["name"])).items()}
    compare_tree(GOLDEN / recipe_id, tree)


def test_golden_covers_every_recipe():
    on_disk = sorted(p.name for p in GOLDEN.iterdir() if p.is_dir() and p.name != "cli")
    assert on_disk == RECIPE_IDS


def test_entrypoint_file_is_the_recipe_bytes():
    recipe = recipes.load("glm-5.3")
    plan = compiled("glm-5.3")
    (path, f), = plan["files"].items()
    assert path == "/var/lib/kiln/files/glm-5.3/glm-5.3.vllm.320k.4x.yml"
    assert f == {"content": recipe["files"]["glm-5.3.vllm.320k.4x.yml"]["content"], "mode": "0555"}


# ---------------------------------------------------------------- the seed commands

def seed_text(name: str) -> str:
    """The seed from ../shared (CI has it); else the copy kept under tests/fixtures/seeds."""
    for d in (REPO.parent / "shared" / "seeds", REPO / "tests" / "fixtures" / "seeds"):
        if (d / name).is_file():
            return (d / name).read_text()
    raise FileNotFoundError(name)


def seed_docker_runs(text: str) -> list[list[str]]:
    """Every `docker run` command of a seed, continuation lines joined, as argv (shell words)."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [shlex.split(line.strip()) for line in joined.splitlines() if line.strip().startswith("docker run")]


FLAGS_WITHOUT_VALUE = {"--rm"}


def split_docker(argv: list[str], image_prefix: str) -> tuple[list[tuple[str, str | None]], str, list[str]]:
    """`docker run` argv → ([(option, value)], image, args after the image)."""
    i = argv.index("run") + 1
    opts: list[tuple[str, str | None]] = []
    while not argv[i].startswith(image_prefix):
        if argv[i] in FLAGS_WITHOUT_VALUE:
            opts.append((argv[i], None))
            i += 1
        else:
            opts.append((argv[i], argv[i + 1]))
            i += 2
    return opts, argv[i], argv[i + 1:]


def kiln_host_path(plan: dict, recipe: dict, seed_host: str) -> str:
    """The seed's ~/models/<dir> and $PWD/<file> map to Kiln's state directories."""
    name = Path(seed_host).name
    if name == recipe["weights"]["dirname"]:
        return plan["paths"]["weights"]
    if "store" in recipe and name == recipe["store"]["dirname"]:
        return plan["paths"]["store"]
    return plan["paths"]["files"][name]


def expected_option(plan: dict, recipe: dict, opt: str, value: str | None) -> tuple[str, str | None]:
    """What Kiln must put where the seed has (opt, value)."""
    if opt == "--user":
        return opt, f"{plan['options']['uid']}:{plan['options']['gid']}"
    if opt == "-v":
        host, target = value.split(":", 1)
        return opt, f"{kiln_host_path(plan, recipe, host)}:{target}"
    if opt == "-p":
        return opt, f"{plan['options']['bindAddress']}:{value}"
    return opt, value


# Options Kiln adds to a seed command; each only narrows what the container may do, or names it.
KILN_ADDED = {("--rm", None), ("--security-opt", "no-new-privileges"), ("--network", "none")}

SEED_STEPS = [
    ("glm-5.3-flash.exllamav3-nvme.128k.rtx-3090.txt", "glm-5.3-flash", ["prepare", "verify", "serve"]),
    ("glm-5.3.vllm.320k.4x-rtx-pro-6000.txt", "glm-5.3", ["serve"]),
]


@pytest.mark.parametrize("seed,recipe_id,steps", SEED_STEPS, ids=[s[1] for s in SEED_STEPS])
def test_argv_reproduces_the_seed_commands(seed, recipe_id, steps):
    recipe = recipes.load(recipe_id).data
    plan = compiled(recipe_id)
    image = recipe["runtime"]["container"]["image"]
    image_prefix = image.split("@")[0]
    seed_runs = seed_docker_runs(seed_text(seed))
    assert len(seed_runs) == len(steps), "the seed's docker run commands, one per step"
    for step, seed_argv in zip(steps, seed_runs):
        argv = plan["steps"][step]["argv"]
        assert argv[:2] == ["/usr/bin/docker", "run"]
        seed_opts, seed_image, seed_args = split_docker(seed_argv, image_prefix)
        opts, got_image, args = split_docker(argv, image_prefix)
        assert got_image == seed_image == image, step
        assert args == seed_args, f"{step}: args after the image differ"
        wanted = [expected_option(plan, recipe, o, v) for o, v in seed_opts]
        missing = [w for w in wanted if w not in opts]
        assert not missing, f"{step}: seed options missing from the plan: {missing}"
        # Nothing else, except Kiln's own narrowing options and the container's name.
        extra = [o for o in opts if o not in wanted and o not in KILN_ADDED and o[0] != "--name"]
        assert not extra, f"{step}: options the seed does not have: {extra}"
        assert len(opts) == len(set(opts)), f"{step}: an option appears twice"


def test_seed_parser_sees_every_option():
    """Guards the test above: the parser must find the seed's options, not an empty list."""
    runs = seed_docker_runs(seed_text(SEED_STEPS[0][0]))
    opts, image, args = split_docker(runs[2], "ghcr.io/sybil-solutions/glm53-flash-offload")
    assert ("--gpus", "all") in opts and ("-p", "8000:30000") in opts and ("--ulimit", "memlock=-1:-1") in opts
    assert len([o for o in opts if o[0] == "-e"]) == 6 and args[-2:] == ["--served-name", "glm-5.3-flash"]


def test_no_privilege_widening_in_any_argv():
    widening = {"--privileged", "--cap-add", "--device", "--pid", "--userns", "--security-opt=seccomp=unconfined"}
    for recipe_id in RECIPE_IDS:
        for step in compiled(recipe_id)["steps"].values():
            if step:
                for argv in step["commands"]:
                    if argv[1:2] == ["run"]:                   # docker's options, not the workload's args
                        assert not widening & set(argv[:argv.index("--entrypoint") if "--entrypoint" in argv else None]), (recipe_id, argv)


def test_options_flow_through_to_the_argv():
    plan = compiled("glm-5.3-flash", stateDir="/srv/kiln", port=9000, bindAddress="0.0.0.0")
    argv = plan["steps"]["serve"]["argv"]
    assert argv[argv.index("-p") + 1] == "0.0.0.0:9000:30000"
    assert "/srv/kiln/models/GLM-5.3-Flash-exl3-332ab457:/models/turboderp-GLM-5.3-Flash-exl3-3.05bpw:ro" in argv
    assert plan["steps"]["check"]["argv"][-1] == "http://127.0.0.1:9000/v1"


# ---------------------------------------------------------------- the CLI

def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_plan_human_output_is_exact(capsys):
    code, out, err = run_cli(capsys, "plan", "glm-5.3-flash", "--uid", "960", "--gid", "960")
    assert (code, err) == (0, "")
    golden = GOLDEN / "cli" / "plan-glm-5.3-flash.txt"
    if REGEN:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(out)
    assert out == golden.read_text()


def test_cli_plan_json_is_the_plan(capsys):
    code, out, err = run_cli(capsys, "plan", "glm-5.3", "--json", "--uid", "960", "--gid", "960")
    assert code == 0
    assert json.loads(out) == compiled("glm-5.3")


def test_cli_plan_uid_defaults_to_the_service_user_or_the_caller(capsys):
    code, out, _ = run_cli(capsys, "plan", "glm-5.3-flash", "--json")
    uid, gid = plans.service_ids()
    argv = json.loads(out)["steps"]["prepare"]["argv"]
    assert argv[argv.index("--user") + 1] == f"{uid}:{gid}"


def test_cli_nix_missing_is_one_line_exit_4(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))          # a PATH without nix-instantiate
    code, out, err = run_cli(capsys, "plan", "glm-5.3-flash")
    assert code == 4 and out == ""
    assert err.count("\n") == 1 and "apt-get install nix-bin" in err and "nixos.org/download" in err


def test_cli_nix_error_names_the_recipe_in_one_line(capsys, tmp_path):
    recipe = json.loads((REPO / "recipes/nvidia/rtx-3090-24gb/glm-5.3-flash.exllamav3-nvme.128k.json").read_text())
    recipe["id"] = "broken"
    del recipe["weights"]["dirname"]                     # the compiler needs it for the host path
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(recipe))
    from tool import nixeval
    with pytest.raises(Exception) as e:
        nixeval.compile_plan(path, GOLDEN_OPTIONS, "broken")
    assert str(e.value).startswith("broken: Nix could not compile it: ")
    assert "dirname" in str(e.value) and "\n" not in str(e.value)


def test_compiler_refuses_swap_below_memory():
    with pytest.raises(Exception) as e:
        compiled("glm-5.3-flash", memoryBytes=2000, memorySwapBytes=1000)
    assert "glm-5.3-flash: memorySwapBytes (1000) is below memoryBytes (2000)" in str(e.value)


@pytest.mark.parametrize("bind", ["not an address", "0.0.0.0 --privileged", "127.0.0.1\nUser=root", "localhost", ""])
@pytest.mark.parametrize("command", ["plan", "materialise"])
def test_cli_bind_must_be_an_ip_address(bind, command, capsys, tmp_path):
    extra = ["--root", str(tmp_path / "root")] if command == "materialise" else []
    code, out, err = run_cli(capsys, command, "smollm2-135m", "--bind", bind, *extra)
    assert code == 2 and out == ""
    reason = [line for line in err.splitlines() if line.startswith("Error:")]
    assert reason == [f"Error: Invalid value for '--bind': {printable(repr(bind))} is not an IP address "
                      "(e.g. 127.0.0.1, 0.0.0.0, ::1)"]
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize("bind,probe", [("0.0.0.0", "http://127.0.0.1:8000/v1"), ("::1", "http://[::1]:8000/v1"),
                                        ("192.168.1.5", "http://192.168.1.5:8000/v1")])
def test_cli_bind_takes_ip_literals(bind, probe, capsys):
    code, out, _ = run_cli(capsys, "plan", "smollm2-135m", "--json", "--bind", bind)
    assert code == 0 and json.loads(out)["endpoint"] == probe


@pytest.mark.parametrize("bind", ["not an address", "1.2.3.4\nUser=root", "0.0.0.0 -v /:/host"])
def test_compiler_refuses_a_bind_address_that_is_not_an_ip(bind):
    """The NixOS module's bindAddress reaches nix/lib without the CLI's check."""
    with pytest.raises(Exception) as e:
        compiled("glm-5.3-flash", bindAddress=bind)
    assert f"glm-5.3-flash: bindAddress {json.dumps(bind)} is not an IP address" in str(e.value)
