"""A recipe cannot add a line to a unit file, nor widen the bind address, auth or loader paths.

A family of hostile recipes, each a bundled recipe with one value changed, goes through the three
paths a recipe can take: `tool validate` (each refused with its located message), `tool plan` /
`tool materialise` (the same refusal, through load), and nix/lib evaluated directly on the unvalidated
file, as the NixOS module does (refused by the compiler itself, with a message naming the value, or
compiled into units that gained no line). The values systemd has an escape for (%, $, quotes,
backslashes, unicode) are accepted, materialised and pass real `systemd-analyze verify`.
"""
from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest

from tool import nixeval, validate
from tool.cli import main
from tool.errors import Exit, RecipeError
from tests.test_units import real_bins, verify

REPO = Path(__file__).resolve().parent.parent
NATIVE = json.loads((REPO / "recipes/cpu/any/smollm2-135m.kiln.8k.json").read_text())
CONTAINER = json.loads((REPO / "recipes/nvidia/rtx-3090-24gb/glm-5.3-flash.exllamav3-nvme.128k.json").read_text())
PWN = "1\nExecStartPre=+/bin/touch /tmp/PWNED"

needs_nix = pytest.mark.skipif(shutil.which("nix-instantiate") is None, reason="plans are compiled by Nix")


def serve_arg_index(recipe: dict, word: str) -> int:
    return recipe["steps"]["serve"]["args"].index(word)


def put(path: tuple, value, base=NATIVE):
    """base with the value at path set (dicts created as needed)."""
    r = copy.deepcopy(base)
    d = r
    for k in path[:-1]:
        d = d.setdefault(k, {}) if isinstance(k, str) else d[k]
    d[path[-1]] = value
    return r


CONTROL = "holds control character"
# name -> (recipe, located path, what the message says)
REFUSED = {
    "env-value-newline-execstartpre": (put(("env", "X"), PWN), "$.env.X", f"string {CONTROL} U+000A (newline)"),
    "title-newline": (put(("title",), "t\nUser=root"), "$.title", f"string {CONTROL} U+000A (newline)"),
    "step-env-newline-user-root": (put(("steps", "serve", "env"), {"X": "1\nUser=root"}), "$.steps.serve.env.X",
                                   f"string {CONTROL} U+000A (newline)"),
    "container-step-env-newline": (put(("steps", "serve", "env"), {"X": "1\nUser=root"}, CONTAINER),
                                   "$.steps.serve.env.X", f"string {CONTROL} U+000A (newline)"),
    "title-carriage-return": (put(("title",), "t\rUser=root"), "$.title", f"string {CONTROL} U+000D (carriage return)"),
    "arg-newline": (put(("steps", "serve", "args", 0), "serve\nExecStartPre=+/bin/sh"), "$.steps.serve.args[0]",
                    f"string {CONTROL} U+000A (newline)"),
    "served-name-tab": (put(("serve", "served_name"), "a\tb"), "$.serve.served_name", f"string {CONTROL} U+0009 (tab)"),
    "env-value-nul": (put(("env", "X"), "a\x00b"), "$.env.X", f"string {CONTROL} U+0000 (NUL)"),
    "title-escape-sequence": (put(("title",), "\x1b[2Jgone"), "$.title", f"string {CONTROL} U+001B (escape)"),
    "title-line-separator": (put(("title",), "a\u2028b"), "$.title", f"string {CONTROL} U+2028 (line separator)"),
    "summary-next-line": (put(("summary",), "a\x85b"), "$.summary", f"string {CONTROL} U+0085 (next line)"),
    "env-name-newline": (put(("env", "A\nB"), "1"), "$.env['A\\nB']", f"key {CONTROL} U+000A (newline)"),
    "id-lone-surrogate": (put(("id",), "smol\ud800"), "$.id", "string holds a lone surrogate U+D800"),
    "native-host-all-addresses": (
        put(("steps", "serve", "args", serve_arg_index(NATIVE, "@host@")), "0.0.0.0"),
        f"$.steps.serve.args[{serve_arg_index(NATIVE, '--host')}]",
        'step serve: --host "0.0.0.0": the bind address is the operator\'s'),
    "native-host-inline": (
        put(("steps", "serve", "args", serve_arg_index(NATIVE, "--host")), "--host=0.0.0.0"),
        f"$.steps.serve.args[{serve_arg_index(NATIVE, '--host')}]", 'step serve: --host "0.0.0.0"'),
    "native-second-port": (put(("steps", "serve", "args"), NATIVE["steps"]["serve"]["args"] + ["--port", "9"]),
                           f"$.steps.serve.args[{len(NATIVE['steps']['serve']['args'])}]",
                           'step serve: --port "9": the port is the operator\'s'),
    "native-api-key-in-args": (put(("steps", "serve", "args"), NATIVE["steps"]["serve"]["args"] + ["--api-key", "k"]),
                               f"$.steps.serve.args[{len(NATIVE['steps']['serve']['args'])}]",
                               "step serve: --api-key sets the API key, which is the operator's"),
    "container-api-key-in-args": (
        put(("steps", "serve", "args"), CONTAINER["steps"]["serve"]["args"] + ["--api-key=k"], CONTAINER),
        f"$.steps.serve.args[{len(CONTAINER['steps']['serve']['args'])}]", "--api-key sets the API key"),
    "env-kiln-api-key": (put(("env", "KILN_API_KEY"), ""), "$.env.KILN_API_KEY",
                         "KILN_API_KEY is one of Kiln's own settings (the API key, its directories): the operator sets it"),
    "env-ld-preload": (put(("steps", "serve", "env"), {"LD_PRELOAD": "/x.so"}), "$.steps.serve.env.LD_PRELOAD",
                       "LD_PRELOAD is a dynamic-loader variable"),
    "env-pythonpath": (put(("env", "PYTHONPATH"), "/var/lib/kiln/files"), "$.env.PYTHONPATH",
                       "PYTHONPATH is an interpreter search path"),
    "container-env-secret": (put(("env", "VLLM_API_KEY"), "", CONTAINER), "$.env.VLLM_API_KEY", "VLLM_API_KEY is a secret"),
    "integer-beyond-64-bits": (put(("serve", "context"), 2**70), "$.serve.context", "integer of 22 digits is out of range"),
}


def write(tmp_path: Path, name: str, recipe: dict) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(recipe, ensure_ascii=True))     # \ud800 survives only as an escape
    return path


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_validate_refuses_each_injection_with_its_located_message(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe, where, says = REFUSED[name]
    problems = validate.check_paths([write(tmp_path, name, recipe)])[1]
    located = [p for p in problems if p.path == where]
    assert located and says in located[0].message, [str(p) for p in problems]
    for p in problems:                                        # every line printable: one line, no surrogate
        assert "\n" not in str(p) and "\r" not in str(p)
        str(p).encode("utf-8")


@needs_nix
@pytest.mark.parametrize("name", ["env-value-newline-execstartpre", "title-newline", "native-host-all-addresses",
                                  "env-kiln-api-key"])
def test_plan_and_materialise_refuse_before_anything_is_written(name, tmp_path, capsys):
    path = write(tmp_path, name, REFUSED[name][0])
    for argv in (["plan", str(path)], ["materialise", str(path), "--root", str(tmp_path / "root")]):
        assert main(argv) == Exit.BAD_RECIPE
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and err.startswith("tool: ") and REFUSED[name][1] in err
    assert not (tmp_path / "root").exists()


# ---------------------------------------------------------------- nix/lib on recipes that never met the validator

def unit_keys(text: str) -> list[str]:
    """The keys of a unit file, one per line that is neither a section, a comment nor blank."""
    out = []
    for line in text.split("\n"):
        if not line or line.startswith(("#", "[")):
            continue
        m = re.fullmatch(r"([A-Za-z]+)=.*", line)
        assert m, f"a line that is no key=value: {line!r}"
        out.append(m.group(1))
    return out


def section_keys(sections: dict) -> list[str]:
    return [k for s in sections.values() for k, v in s.items() if v is not None
            for _ in (v if isinstance(v, list) else [v])]


def compile_raw(path: Path) -> dict:
    return nixeval.compile_plan(path, {"uid": 1000, "gid": 1000})


@needs_nix
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_nix_lib_alone_refuses_or_writes_no_extra_line(name, tmp_path):
    """The compiler on the raw file (the NixOS module's path): a throw whose one line names the value, or
    units whose every line is a key the unit's sections hold — the text gained nothing."""
    recipe, where, _ = REFUSED[name]
    path = write(tmp_path, name, recipe)
    try:
        plan = compile_raw(path)
    except RecipeError as e:
        # refused by nix/lib (kiln: …), or by Nix's own JSON parser (a lone surrogate is not JSON text to it)
        assert ("kiln: " in e.message or "parse_error" in e.message) and "\n" not in e.message, e.message
        return
    for unit, text in plan["units"].items():
        assert sorted(unit_keys(text)) == sorted(section_keys(plan["unitSections"][unit])), unit
        assert "PWNED" not in text or "\\nExecStartPre" in text
        assert "\nUser=root" not in text


@needs_nix
@pytest.mark.parametrize("name,where", [
    ("env-value-newline-execstartpre", "$.env.X"), ("title-newline", "$.title"),
    ("step-env-newline-user-root", "$.steps.serve.env.X"), ("title-carriage-return", "$.title"),
    ("arg-newline", "$.steps.serve.args[0]"), ("env-name-newline", "$.env"),
])
def test_nix_lib_alone_names_the_value_it_refuses(name, where, tmp_path):
    with pytest.raises(RecipeError) as e:
        compile_raw(write(tmp_path, name, REFUSED[name][0]))
    assert f"kiln: recipe {where}" in e.value.message and "control character" in e.value.message


@needs_nix
def test_nix_lib_alone_refuses_a_host_override_in_native_args(tmp_path):
    with pytest.raises(RecipeError) as e:
        compile_raw(write(tmp_path, "h", REFUSED["native-host-all-addresses"][0]))
    assert 'step serve: --host "0.0.0.0": the bind address and port are the operator\'s options' in e.value.message


@needs_nix
def test_nix_lib_alone_refuses_a_path_that_is_not_one_component(tmp_path):
    recipe = put(("store", "dirname"), "../../etc")
    with pytest.raises(RecipeError) as e:
        compile_raw(write(tmp_path, "d", recipe))
    assert "kiln: recipe $.store.dirname: \"../../etc\" is not one path component" in e.value.message


# ---------------------------------------------------------------- what systemd can escape is accepted, harmlessly

HARMLESS = {
    "percent": (("title",), "100% of a 50%s title %n"),
    "dollar-args": (("steps", "serve", "args"), NATIVE["steps"]["serve"]["args"] + ["--served-name", "$HOME ${PATH} $$"]),
    "quote-and-backslash-env": (("env", "X"), 'a "quoted" \\ value ending in \\'),
    "backslash-ending-title": (("title",), "ends in a backslash \\"),
    "unicode-title": (("title",), "SmolLM2 · 中文 · Ωμέγα · 🙂"),
    "semicolon-and-spaces-arg": (("steps", "serve", "args"), NATIVE["steps"]["serve"]["args"] + ["--served-name", "a ; b  c"]),
}


@needs_nix
@pytest.mark.parametrize("name", sorted(HARMLESS))
def test_what_systemd_can_escape_is_materialised_and_verifies(name, tmp_path, capsys, monkeypatch):
    path_, value = HARMLESS[name]
    recipe = put(path_, value)
    path = write(tmp_path, name, recipe)
    monkeypatch.chdir(tmp_path)
    assert validate.validate_paths([path]) == []
    root, bins = tmp_path / "root", real_bins(tmp_path)
    assert main(["materialise", str(path), "--root", str(root), "--state-dir", str(tmp_path / "state"), *bins]) == 0
    capsys.readouterr()
    unit_dir = root / "etc/systemd/system"
    assert verify(unit_dir, False) == "rc=0"
    flags = dict(b.removeprefix("--").split("=", 1) for b in bins)
    plan = nixeval.compile_plan(path, {"uid": 1000, "gid": 1000, "stateDir": str(tmp_path / "state"), "toolBin": flags["tool-bin"],
                                       "engineBin": flags["engine-bin"], "dockerBin": flags["docker-bin"]})
    for unit, sections in plan["unitSections"].items():
        assert sorted(unit_keys((unit_dir / unit).read_text())) == sorted(section_keys(sections)), unit


@needs_nix
def test_percent_and_dollar_are_written_as_systemd_literals(tmp_path):
    recipe = put(("steps", "serve", "args"), NATIVE["steps"]["serve"]["args"] + ["--served-name", "$HOME 50%"])
    recipe = put(("title",), "50% off", recipe)
    recipe = put(("env", "X"), '50% "q"', recipe)
    serve = compile_raw(write(tmp_path, "lit", recipe))["units"]["kiln-smollm2-135m.service"]
    assert "Description=Kiln smollm2-135m: serve (50%% off)\n" in serve
    assert ' "$$HOME 50%%" ' in serve or ' "$$HOME 50%%"\n' in serve    # the recipe's serve flags may follow
    assert 'Environment="X=50%% \\"q\\""\n' in serve


@needs_nix
def test_a_container_recipe_host_stays_inside_the_container(tmp_path):
    """A container server's --host is its own interface; the host side is docker's -p on the operator's address."""
    plan = compile_raw(REPO / "recipes/nvidia/rtx-3090-24gb/glm-5.3-flash.exllamav3-nvme.128k.json")
    argv = plan["steps"]["serve"]["argv"]
    assert argv[argv.index("--host") + 1] == "0.0.0.0"                  # after the image: the server's own flag
    assert argv[argv.index("-p") + 1] == "127.0.0.1:8000:30000"
    assert not {"--network", "--net", "--privileged", "--cap-add", "--pid", "--device"} & set(argv)
