"""`tool` never prints a traceback for any file it is given: one line on stderr, an exit code from Exit.

Two parts. Hostile files, each through every command that takes a recipe: bytes that are not UTF-8,
a lone surrogate, 1,000-deep nesting, a 5,000-digit integer, NaN, duplicate keys, a symlink loop,
a FIFO and a device (refused without being opened: the test would hang otherwise), a directory, a
file over the size limit. Then a seeded fuzz: a few hundred mutations of the bundled recipes (type
swaps, deletions, huge values, hostile unicode, deep nesting, byte damage), each through `tool
validate`, `tool plan` and `tool preflight` in-process (click's CliRunner via tool.cli.main), and
`tool list` over all of them; a few through the real console script too.
"""
from __future__ import annotations

import copy
import json
import os
import random
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tool.cli import main
from tool.errors import Exit
from tool.recipe_file import MAX_RECIPE_BYTES

REPO = Path(__file__).resolve().parent.parent
TOOL = str(Path(sys.executable).parent / "tool")
BASES = sorted((REPO / "recipes").rglob("*.json"))
BASES = [p for p in BASES if p.name != "schema.json"]
EXITS = {int(e) for e in Exit} - {int(Exit.INTERNAL)}   # INTERNAL is the catch-all: a bug, never expected

needs_nix = pytest.mark.skipif(shutil.which("nix-instantiate") is None, reason="plans are compiled by Nix")


SMOL = REPO / "recipes/cpu/any/smollm2-135m.kiln.8k.json"


def base() -> dict:
    return json.loads(SMOL.read_text())


def hostile_files(d: Path) -> dict[str, tuple[Path, str]]:
    """name -> (path, what the one line must say)."""
    d.mkdir(parents=True, exist_ok=True)
    out = {}

    def put(name, data: bytes, says):
        p = d / f"{name}.json"
        p.write_bytes(data)
        out[name] = (p, says)

    good = json.dumps(base())
    put("not-utf8", good.replace('"title": "', '"title": "\xff').encode("latin-1", "replace"), "not UTF-8: byte 0xff")
    put("lone-surrogate-id", good.replace('"id": "smollm2-135m"', '"id": "\\ud800"').encode(),
        "$.id: string holds a lone surrogate U+D800")
    put("deep-1000", b'{"a": ' + b"[" * 1000 + b"]" * 1000 + b"}", "nested more than 64 levels deep (a recipe is at most 64)")
    put("deep-100", b'{"a": ' + b"[" * 100 + b"]" * 100 + b"}", "nested more than 64 levels deep (a recipe is at most 64)")
    put("int-5000-digits", b'{"a": ' + b"9" * 5000 + b"}", "an integer of 5000 digits is out of range")
    put("nan", good.replace('"context": 8192', '"context": NaN').encode(), "NaN is not JSON")
    put("duplicate-key", good.replace('"id": "smollm2-135m"', '"id": "a", "id": "smollm2-135m"').encode(),
        'key "id" appears twice in one object')
    put("too-big", b'{"a": "' + b"x" * (MAX_RECIPE_BYTES + 10) + b'"}', f"a recipe file is at most {MAX_RECIPE_BYTES} bytes")
    put("empty", b"", "not valid JSON: Expecting value (line 1, column 1)")
    put("bom", b"\xef\xbb\xbf" + good.encode(), "not valid JSON: Unexpected UTF-8 BOM")
    loop = d / "loop.json"
    loop.symlink_to(loop.name)
    out["symlink-loop"] = (loop, "cannot read (Too many levels of symbolic links)")
    fifo = d / "fifo.json"
    os.mkfifo(fifo)
    out["fifo"] = (fifo, "is a FIFO, not a recipe file")
    dev = d / "device.json"
    dev.symlink_to("/dev/zero")
    out["device"] = (dev, "is a character device, not a recipe file")
    directory = d / "directory.json"
    directory.mkdir()
    out["directory"] = (directory, "is a directory, not a recipe file")
    return out


# every command that takes a recipe, with what it needs beside it to get as far as loading it
RECIPE_COMMANDS = {
    "plan": [], "materialise": ["--root", "{tmp}/root"], "preflight": [], "fetch": [], "verify": [],
    "prepare": [], "up": ["--once"], "check": ["--endpoint", "http://127.0.0.1:9/v1"],
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return hostile_files(tmp_path_factory.mktemp("hostile"))


def run(argv: list[str], env: dict | None = None) -> tuple[int, str, str]:
    """tool.cli.main (the console script's own entry) inside click's CliRunner isolation: stdout and stderr
    apart, stdin empty, the environment as given."""
    with CliRunner().isolation(env=env) as (out, err, _):
        code = main(argv)
    return code, out.getvalue().decode("utf-8", "replace"), err.getvalue().decode("utf-8", "replace")


def assert_one_line(code: int, err: str, argv) -> None:
    assert code in EXITS, (argv, code, err)
    assert "Traceback" not in err, (argv, err)
    if code != 0:
        assert err.count("\n") == 1 and err.endswith("\n"), (argv, err)


@pytest.mark.parametrize("name", ["not-utf8", "lone-surrogate-id", "deep-1000", "deep-100", "int-5000-digits", "nan",
                                  "duplicate-key", "too-big", "empty", "bom", "symlink-loop", "fifo", "device", "directory"])
def test_validate_refuses_each_hostile_file_in_one_located_line(name, files):
    path, says = files[name]
    code, out, err = run(["validate", str(path)])
    if name == "directory":                       # a directory is searched for recipes: this one holds none
        assert (code, out, err) == (0, "", "0 recipes, 0 errors\n")
        return
    assert code == Exit.BAD_RECIPE and "Traceback" not in out + err
    assert says in out.splitlines()[0] and out.splitlines()[0].startswith(f"{path}::$")
    assert err == f"1 recipe, {len(out.splitlines())} error{'s' if len(out.splitlines()) > 1 else ''}\n"


@pytest.mark.parametrize("command", sorted(RECIPE_COMMANDS))
@pytest.mark.parametrize("name", ["not-utf8", "lone-surrogate-id", "deep-1000", "int-5000-digits", "duplicate-key",
                                  "too-big", "symlink-loop", "fifo", "device", "directory"])
def test_every_recipe_command_refuses_each_hostile_file_in_one_line(name, command, files, tmp_path):
    path, says = files[name]
    argv = [command, str(path)] + [a.format(tmp=tmp_path) for a in RECIPE_COMMANDS[command]]
    code, out, err = run(argv, env={"KILN_STATE_DIR": str(tmp_path / "state")})
    assert code == Exit.BAD_RECIPE, (argv, code, out, err)
    assert err.startswith("tool: ") and err.count("\n") == 1 and says in err, err
    err.encode("utf-8")                                   # printable: no lone surrogate reaches the terminal
    assert not (tmp_path / "root").exists() and not (tmp_path / "state").exists()


def test_a_fifo_is_refused_by_the_real_console_script_without_blocking(files):
    """If the FIFO were opened for reading, this would wait for a writer until the timeout."""
    path, _ = files["fifo"]
    for cmd in ("validate", "plan", "preflight"):
        r = subprocess.run([TOOL, cmd, str(path)], capture_output=True, text=True, timeout=30)
        assert r.returncode == Exit.BAD_RECIPE and "Traceback" not in r.stderr
        assert "is a FIFO, not a recipe file" in (r.stdout if cmd == "validate" else r.stderr)
    assert stat.S_ISFIFO(os.stat(path).st_mode)


def test_list_leaves_out_hostile_files_and_lists_the_rest(files, tmp_path):
    d = files["fifo"][0].parent
    good = d / "cpu" / "any" / SMOL.name                 # placed as a recipes tree wants it
    good.parent.mkdir(parents=True, exist_ok=True)
    good.write_bytes(SMOL.read_bytes().replace(b'"smollm2-135m"', b'"hostile-neighbour"', 1))
    try:
        code, out, err = run(["list", "--json"], env={"KILN_RECIPES": str(d)})
    finally:
        shutil.rmtree(d / "cpu")
    assert code == 0 and "Traceback" not in err
    assert {"hostile-neighbour", "smollm2-135m"} <= {row["id"] for row in json.loads(out)}
    left_out = err.splitlines()
    assert left_out and all(line.startswith("tool: left out an invalid recipe: ") for line in left_out), err


# ---------------------------------------------------------------- the fuzz

SEED = 20261201
N = 300
STRANGE = ["", " ", "\n", "x" * 100_000, "\ud800", "\udfff", "\u2028", "\x00", "\x1b[31m", "[/]", "[red]x",
           "%n%%", "$(id)", "\\", '"', "\u202e", "🙂", "ｆｕｌｌ", "../../etc", "-" * 3, "--host=0.0.0.0"]
VALUES = [None, True, False, 0, -1, 1, 2**31, 2**63, -(2**63) - 1, 10**40, 1.5, -0.0, 1e308, "", "1", [], {}, [[]],
          {"a": {}}, ["x"] * 1000]


def nodes(data):
    """(parent, key) of every value, depth-first, in document order."""
    out = []
    if isinstance(data, dict):
        for k, v in data.items():
            out.append((data, k))
            out += nodes(v)
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out.append((data, i))
            out += nodes(v)
    return out


def nest(value, depth: int):
    for _ in range(depth):
        value = [value]
    return value


def mutate(rng: random.Random, recipe: dict) -> bytes:
    """One mutation of a recipe, as the bytes of a file."""
    r = copy.deepcopy(recipe)
    how = rng.choice(["swap", "swap", "delete", "delete", "strange", "strange", "key", "nest", "bytes", "several"])
    for _ in range(rng.randint(2, 6) if how == "several" else 1):
        parent, key = rng.choice(nodes(r))
        kind = rng.choice(["swap", "delete", "strange", "key", "nest"]) if how == "several" else how
        if kind == "swap":
            parent[key] = copy.deepcopy(rng.choice(VALUES))
        elif kind == "delete":
            del parent[key]
        elif kind == "strange":
            old = parent[key]
            s = rng.choice(STRANGE)
            parent[key] = (old[: rng.randint(0, len(old))] + s + old[rng.randint(0, len(old)):]) if isinstance(old, str) else s
        elif kind == "key" and isinstance(parent, dict):
            parent[rng.choice(STRANGE)[:40] or "k"] = parent.pop(key)
        elif kind == "nest":
            parent[key] = nest(parent[key], rng.choice([10, 63, 64, 65, 200]))
    if how == "bytes":
        raw = bytearray(json.dumps(r, indent=1).encode())
        for _ in range(rng.randint(1, 4)):
            op, i = rng.choice(["flip", "cut", "insert"]), rng.randrange(len(raw))
            if op == "flip":
                raw[i] ^= 1 << rng.randrange(8)
            elif op == "cut":
                del raw[i:]
            else:
                raw[i:i] = rng.choice([b"\xff", b"\xc3", b"\x00", b"[" * 2000, b"9" * 5000, b"NaN", b",", b"}"])
        return bytes(raw)
    return json.dumps(r, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")


@pytest.fixture(scope="module")
def mutants(tmp_path_factory):
    rng = random.Random(SEED)
    d = tmp_path_factory.mktemp("mutants")
    bases = [json.loads(p.read_text()) for p in BASES]
    paths = []
    for i in range(N):
        p = d / f"m{i:03d}.json"
        p.write_bytes(mutate(rng, bases[i % len(bases)]))
        paths.append(p)
    return paths


def test_the_fuzz_is_deterministic(tmp_path):
    bases = [json.loads(p.read_text()) for p in BASES]
    a = [mutate(random.Random(SEED), bases[0]) for _ in range(3)]
    b = [mutate(random.Random(SEED), bases[0]) for _ in range(3)]
    assert a == b


def test_validate_never_crashes_on_mutated_recipes(mutants):
    outcomes = {"valid": 0, "invalid": 0}
    for p in mutants:
        code, out, err = run(["validate", str(p)])
        assert code in (Exit.OK, Exit.BAD_RECIPE) and "Traceback" not in out + err, (p.name, code, err)
        n = len(out.splitlines())
        assert err == f"1 recipe, {n} error{'' if n == 1 else 's'}\n" and (code == 0) == (n == 0), (p.name, err)
        for line in out.splitlines():
            assert line.startswith(f"{p}::$"), (p.name, line)
            line.encode("utf-8")
        outcomes["valid" if code == 0 else "invalid"] += 1
    assert outcomes["invalid"] > N // 2 and outcomes["valid"] > 10, outcomes   # the fuzz reaches both sides


@needs_nix
def test_plan_and_preflight_never_crash_on_mutated_recipes(mutants, tmp_path):
    env = {"KILN_STATE_DIR": str(tmp_path / "state"), "DOCKER_HOST": f"unix://{tmp_path}/no-docker.sock"}
    for p in mutants:
        for argv in (["plan", str(p)], ["preflight", str(p), "--json"]):
            code, out, err = run(argv, env=env)
            if argv[0] == "preflight" and code in (Exit.OK, Exit.FAILED) and not err:
                assert json.loads(out)["verdict"] in ("go", "no-go")      # an answer: the host's go / no-go
                continue
            assert_one_line(code, err, [*argv[:1], p.name])


def test_list_over_every_mutant_at_once(mutants):
    code, out, err = run(["list", "--json"], env={"KILN_RECIPES": str(mutants[0].parent)})
    assert code == 0 and "Traceback" not in err, err
    assert all(line.startswith("tool: left out an invalid recipe: ") for line in err.splitlines())
    json.loads(out)


def test_a_few_mutants_through_the_real_console_script(mutants):
    for p in mutants[::50]:
        for cmd in ("validate", "plan"):
            r = subprocess.run([TOOL, cmd, str(p)], capture_output=True, text=True, timeout=60,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
            assert r.returncode in EXITS and "Traceback" not in r.stderr, (p.name, cmd, r.stderr)
            assert r.stderr.count("\n") == (1 if r.returncode or cmd == "validate" else 0), (p.name, cmd, r.stderr)


def test_a_file_name_that_is_not_utf8_prints_as_one_printable_line(tmp_path):
    """Through the real console script, whose stdout is a strict UTF-8 pipe: a lone surrogate would crash it."""
    good = os.fsdecode(bytes(tmp_path) + b"/good\xff.json")
    bad = os.fsdecode(bytes(tmp_path) + b"/bad\xfe.json")
    shutil.copy(SMOL, good)
    Path(bad).write_bytes(b"{")
    for extra in ([], ["--json"]):
        r = subprocess.run([TOOL, "validate", *extra, good, bad], capture_output=True, cwd=tmp_path, timeout=60,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
        assert r.returncode == Exit.BAD_RECIPE and b"Traceback" not in r.stderr, r.stderr
        out = r.stdout.decode("utf-8")                                   # strict: valid UTF-8 throughout
        if extra:
            assert json.loads(out)["files"] == ["good\\udcff.json", "bad\\udcfe.json"]
        else:
            assert out == "bad\\udcfe.json::$: not valid JSON: Expecting property name enclosed in double quotes (line 1, column 2)\n"
        assert r.stderr == b"2 recipes, 1 error\n"
