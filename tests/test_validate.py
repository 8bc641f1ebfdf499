"""Recipe validation: the schema, the rules beyond it, and `tool validate`.

Each invalid fixture under tests/fixtures/recipes/invalid/ is named for the rule it breaks
and must produce exactly its own errors, located. Everything here is real: the real
schema, the real recipes, the click command and (once) the installed console script.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from jsonschema import Draft202012Validator

from tool import recipe_file, recipes, validate
from tool.cli import cli
from tool.errors import Exit, RecipeError

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "recipes"
VALID, INVALID = FIXTURES / "valid", FIXTURES / "invalid"
TREE = INVALID / "file-name-mismatch"   # a recipes tree: only there does a file's place matter
REL = "tests/fixtures/recipes/invalid/"

REAL = [
    "recipes/nvidia/rtx-3090-24gb/glm-5.3-flash.exllamav3-nvme.128k.json",
    "recipes/nvidia/rtx-pro-6000-blackwell-96gb/glm-5.3.vllm.320k.4x.json",
    "recipes/cpu/any/smollm2-135m.kiln.8k.json",
]


def placed(at: str, says: str) -> str:
    return (f"placed at {at}, but its fields say {says} "
            "(vendor/card/<model>.<engine>.<context/1024>k[.<gpu_count>x].json)")


PLAIN = "recipe text reaches unit files, command lines and terminals, and none belongs there"
OPERATOR_SETS = "the operator sets it (the environment file, or the NixOS module's extraEnv), never a recipe"
FLEET_KNOB = "which is the operator's (tool plan --fleet-address, the NixOS module's fleet options); Kiln adds it"
SECRET_FLAG = "which is the operator's, not the recipe's (a secret goes in the operator's environment file)"

# invalid/<entry> -> every (file under invalid/, JSON path, message) it must produce, and nothing else
EXPECTED: dict[str, list[tuple[str, str, str]]] = {
    # rules beyond the schema
    "image-not-pinned-by-digest.json": [
        ("image-not-pinned-by-digest.json", "$.runtime.container.image",
         'image "ghcr.io/kiln-tests/server:v1" is not pinned by digest: a tag can move; append @sha256:<64 hex digits>'),
    ],
    "image-digest-malformed.json": [
        ("image-digest-malformed.json", "$.runtime.container.image",
         'image "ghcr.io/kiln-tests/server@sha256:abc123" has no valid digest: it must end in @sha256:<64 lower-case hex digits>'),
    ],
    "revision-not-a-commit.json": [
        ("revision-not-a-commit.json", "$.weights.revision",
         'revision "main" is not a commit: pin the 40-hex commit id (a branch or tag name can move)'),
    ],
    "decode-baseline-on-a-container.json": [
        ("decode-baseline-on-a-container.json", "$.checks.decode_baseline",
         "decode_baseline runs the recipe's native program: it needs runtime.kind native"),
    ],
    "memory-swap-below-memory.json": [
        ("memory-swap-below-memory.json", "$.runtime.container.memory_swap_bytes",
         "memory_swap_bytes 4294967296 is below memory_bytes 8589934592: it must be at least that (equal turns swap off)"),
    ],
    "prepare-writes-under-read-only-mount.json": [
        ("prepare-writes-under-read-only-mount.json", "$.steps.prepare.writes[1]",
         'step prepare writes "/weights/cache", which lies under read-only mount "/weights" (the weights)'),
    ],
    "prepare-writes-outside-writable-mounts.json": [
        ("prepare-writes-outside-writable-mounts.json", "$.steps.prepare.writes[0]",
         'step prepare writes "/tmp/out", which lies under no writable mount (read_only: false)'),
    ],
    "native-prepare-writes-weights.json": [
        ("native-prepare-writes-weights.json", "$.steps.prepare.writes[1]",
         'step prepare writes "@weights@/model", which lies under read-only mount "@weights@" (the weights)'),
    ],
    "serve-mounts-store-writable.json": [
        ("serve-mounts-store-writable.json", "$.steps.serve.mounts[0].read_only",
         "step serve mounts the store writable; only prepare writes (read_only: true here)"),
    ],
    "prepare-mounts-weights-writable.json": [
        ("prepare-mounts-weights-writable.json", "$.steps.prepare.mounts[1].read_only",
         "step prepare mounts the weights writable; only the store may be (read_only: true here)"),
    ],
    "id-not-unique": [
        ("id-not-unique/a.json", "$.id", f'id "id-not-unique" is also used by {REL}id-not-unique/b.json'),
        ("id-not-unique/b.json", "$.id", f'id "id-not-unique" is also used by {REL}id-not-unique/a.json'),
    ],
    "mounted-file-not-in-files.json": [
        ("mounted-file-not-in-files.json", "$.steps.serve.mounts[2].source",
         'mounts file "entrypoint.bash", which is not in files (files: entrypoint.sh)'),
    ],
    "store-mounted-but-not-defined.json": [
        ("store-mounted-but-not-defined.json", "$.steps.prepare.mounts[0].source",
         "step prepare mounts the store, but the recipe has no store"),
        ("store-mounted-but-not-defined.json", "$.steps.serve.mounts[0].source",
         "step serve mounts the store, but the recipe has no store"),
    ],
    "store-quant-gguf-without-gguf-file.json": [
        ("store-quant-gguf-without-gguf-file.json", "$.store", 'missing required field "gguf_file"'),
    ],
    "store-gguf-file-without-quant-gguf.json": [
        ("store-gguf-file-without-quant-gguf.json", "$.store.gguf_file", "gguf_file goes with quant gguf"),
    ],
    "store-gguf-file-escapes-weights.json": [
        ("store-gguf-file-escapes-weights.json", "$.store.gguf_file",
         '"@weights@/../../etc/shadow" does not match ^@weights@(/[A-Za-z0-9_][A-Za-z0-9._-]*)+$'),
    ],
    "store-placeholder-but-not-defined.json": [
        ("store-placeholder-but-not-defined.json", "$.steps.prepare.writes[0]",
         "step prepare uses @store@, but the recipe has no store"),
        ("store-placeholder-but-not-defined.json", "$.steps.serve.args[2]",
         "step serve uses @store@, but the recipe has no store"),
    ],
    "file-name-mismatch": [
        ("file-name-mismatch/nvidia/depth-mismatch.exllamav3-nvme.128k.json", "$",
         placed("nvidia/depth-mismatch.exllamav3-nvme.128k.json", "nvidia/rtx-3090-24gb/<model>.exllamav3-nvme.128k.json")),
        ("file-name-mismatch/nvidia/rtx-3090-24gb/context-mismatch.exllamav3-nvme.64k.json", "$",
         placed("nvidia/rtx-3090-24gb/context-mismatch.exllamav3-nvme.64k.json",
                "nvidia/rtx-3090-24gb/<model>.exllamav3-nvme.128k.json")),
        ("file-name-mismatch/nvidia/rtx-3090-24gb/engine-mismatch.vllm.128k.json", "$",
         placed("nvidia/rtx-3090-24gb/engine-mismatch.vllm.128k.json",
                "nvidia/rtx-3090-24gb/<model>.exllamav3-nvme.128k.json")),
        ("file-name-mismatch/nvidia/rtx-3090-24gb/gpu-count-mismatch.exllamav3-nvme.128k.json", "$",
         placed("nvidia/rtx-3090-24gb/gpu-count-mismatch.exllamav3-nvme.128k.json",
                "nvidia/rtx-3090-24gb/<model>.exllamav3-nvme.128k.2x.json")),
        ("file-name-mismatch/nvidia/rtx-4090-24gb/card-mismatch.exllamav3-nvme.128k.json", "$",
         placed("nvidia/rtx-4090-24gb/card-mismatch.exllamav3-nvme.128k.json",
                "nvidia/rtx-3090-24gb/<model>.exllamav3-nvme.128k.json")),
        # placed-right.exllamav3-nvme.128k.json, the tree's control, has no error
    ],
    # the schema
    "missing-required-field.json": [
        ("missing-required-field.json", "$.model", 'missing required field "engine"'),
    ],
    "local-weights-without-sha256.json": [        # a local file is served only as the copy its pin covers
        ("local-weights-without-sha256.json", "$.weights", 'missing required field "sha256"'),
    ],
    "prepare-without-writes.json": [
        ("prepare-without-writes.json", "$.steps.prepare", 'missing required field "writes"'),
    ],
    "wrong-type.json": [
        ("wrong-type.json", "$.serve.port", 'expected integer, got string "8000"'),
    ],
    "id-not-matching-pattern.json": [
        ("id-not-matching-pattern.json", "$.id", '"Bad_Id" does not match ^[a-z0-9][a-z0-9.-]*$'),
    ],
    "unknown-field.json": [
        ("unknown-field.json", "$.steps.serve.ready_timeout", 'unknown field "ready_timeout"; did you mean "ready_timeout_s"?'),
    ],
    "gate-not-known.json": [
        ("gate-not-known.json", "$.checks.gates[2]",
         '"vibes" is not one of "load", "chat", "reasoning", "tools", "context", "speed"'),
    ],
    "date-not-a-date.json": [
        ("date-not-a-date.json", "$.proof[0].date", '"2026-02-30" is not a valid date'),
    ],
    "env-value-not-a-string.json": [
        ("env-value-not-a-string.json", "$.env.GLM53_EC_MAX_SLOTS", "expected string, got integer 1376"),
    ],
    "gpu-recipe-with-no-gpus.json": [
        ("gpu-recipe-with-no-gpus.json", "$.hardware.gpu_count", "a GPU recipe has gpu_count >= 1"),
    ],
    "runtime-object-of-other-kind.json": [
        ("runtime-object-of-other-kind.json", "$.runtime", 'missing required field "native"'),
        ("runtime-object-of-other-kind.json", "$.runtime.container",
         "runtime kind is native: this object belongs to a container runtime"),
    ],
    "container-step-with-commands.json": [
        ("container-step-with-commands.json", "$.steps.prepare.commands",
         "a container step runs one command: put its words in args (after the image), not commands"),
    ],
    "native-step-without-args-or-commands.json": [
        ("native-step-without-args-or-commands.json", "$.steps.serve",
         "a native step runs args (one command) or commands (several), exactly one of them"),
    ],
    "native-step-with-args-and-commands.json": [
        ("native-step-with-args-and-commands.json", "$.steps.prepare",
         "a native step runs args (one command) or commands (several), exactly one of them"),
    ],
    # hostile text, numbers and knobs (tool/validate.py: text_is_plain, numbers_fit, operator_knobs_stay_the_operators)
    "text-with-control-characters.json": [
        ("text-with-control-characters.json", path, f"string holds control character {char}: {PLAIN}")
        for path, char in [("$.env.X", "U+000A (newline)"), ("$.serve.served_name", "U+0009 (tab)"),
                           ("$.steps.serve.env.Y", "U+000D (carriage return)"), ("$.title", "U+000A (newline)")]
    ],
    "text-with-lone-surrogate.json": [
        ("text-with-lone-surrogate.json", "$.id",
         "string holds a lone surrogate U+D800, which is not Unicode text (no file or unit can hold it)"),
    ],
    "integer-beyond-64-bits.json": [
        ("integer-beyond-64-bits.json", "$.runtime.native.memory_max_bytes",
         "integer of 20 digits is out of range: integers fit in 64 bits (at most 9223372036854775807)"),
    ],
    "native-serve-sets-operator-flags.json": [
        ("native-serve-sets-operator-flags.json", "$.steps.serve.args[7]",
         "step serve: --host \"0.0.0.0\": the bind address is the operator's (tool plan --bind, the NixOS module's "
         "options); write --host @host@"),
        ("native-serve-sets-operator-flags.json", "$.steps.serve.args[9]",
         "step serve: --port \"9999\": the port is the operator's (tool plan --port, the NixOS module's options); "
         "write --port @port@"),
        ("native-serve-sets-operator-flags.json", "$.steps.serve.args[19]", f"step serve: --api-key sets the API key, {SECRET_FLAG}"),
    ],
    "env-sets-operator-variables.json": [
        ("env-sets-operator-variables.json", "$.env.KILN_API_KEY",
         f"KILN_API_KEY is one of Kiln's own settings (the API key, its directories): {OPERATOR_SETS}"),
        ("env-sets-operator-variables.json", "$.env.LD_PRELOAD",
         f"LD_PRELOAD is a dynamic-loader variable (it loads code into the process): {OPERATOR_SETS}"),
        ("env-sets-operator-variables.json", "$.steps.serve.env.HF_TOKEN", f"HF_TOKEN is a secret: {OPERATOR_SETS}"),
        ("env-sets-operator-variables.json", "$.steps.serve.env.PYTHONPATH",
         f"PYTHONPATH is an interpreter search path (it loads code): {OPERATOR_SETS}"),
    ],
    "container-recipe-carries-a-secret.json": [
        ("container-recipe-carries-a-secret.json", "$.env.VLLM_API_KEY", f"VLLM_API_KEY is a secret: {OPERATOR_SETS}"),
        ("container-recipe-carries-a-secret.json", "$.steps.serve.args[16]", f"step serve: --api-key sets the API key, {SECRET_FLAG}"),
    ],
    # fleets (tool/validate.py: fleet_is_one_head_and_its_workers; the schema's fleetHost and llamaCpp)
    "fleet-without-a-head.json": [
        ("fleet-without-a-head.json", "$.fleet.hosts", "a fleet has exactly one host with role head, this one has 0"),
    ],
    "fleet-with-two-heads.json": [
        ("fleet-with-two-heads.json", "$.fleet.hosts",
         "a fleet has exactly one host with role head, this one has 2 (head, worker-b)"),
    ],
    "fleet-on-native-runtime.json": [
        ("fleet-on-native-runtime.json", "$.runtime.kind",
         "runtime \"native\" cannot span hosts: a fleet deploys llama.cpp's RPC backend (llama-cpp) or vLLM on Ray "
         "(container)"),
    ],
    "fleet-worker-sets-its-address.json": [
        ("fleet-worker-sets-its-address.json", "$.fleet.worker.args[0]", f"--host sets the worker's fleet address, {FLEET_KNOB}"),
        ("fleet-worker-sets-its-address.json", "$.fleet.worker.args[2]", f"-p sets the worker's fleet port, {FLEET_KNOB}"),
    ],
    "fleet-head-names-its-workers.json": [
        ("fleet-head-names-its-workers.json", "$.steps.serve.args[19]", f"--rpc sets the workers' fleet addresses, {FLEET_KNOB}"),
    ],
    "fleet-host-with-gpus-but-no-card.json": [
        ("fleet-host-with-gpus-but-no-card.json", "$.fleet.hosts['worker-a']", 'missing required field "card"'),
        ("fleet-host-with-gpus-but-no-card.json", "$.fleet.hosts['worker-a']", 'missing required field "min_vram_bytes"'),
    ],
    "llama-cpp-runtime-without-its-object.json": [
        ("llama-cpp-runtime-without-its-object.json", "$.runtime", 'missing required field "llama_cpp"'),
        ("llama-cpp-runtime-without-its-object.json", "$.runtime.native",
         "runtime kind is llama-cpp: this object belongs to a native runtime"),
    ],
    # JSON a recipe may not be (tool/recipes.py: decode)
    "duplicate-key.json": [
        ("duplicate-key.json", "$",
         'not valid JSON for a recipe: key "id" appears twice in one object (which one counts is ambiguous)'),
    ],
    "not-utf-8.json": [
        ("not-utf-8.json", "$", "not UTF-8: byte 0xff at offset 100 (line 5)"),
    ],
    "number-not-finite.json": [
        ("number-not-finite.json", "$",
         "not valid JSON for a recipe: number 1e999 is out of range (a recipe's numbers are finite)"),
    ],
    # not a recipe at all
    "malformed-json.json": [
        ("malformed-json.json", "$", "not valid JSON: Expecting property name enclosed in double quotes (line 4, column 1)"),
    ],
    "not-an-object.json": [
        ("not-an-object.json", "$", "a recipe is a JSON object, not list"),
    ],
    # every error at once
    "several-problems.json": [
        ("several-problems.json", "$", 'missing required field "checks"'),
        ("several-problems.json", "$.hardware.min_vram_bytes", 'expected integer, got string "24 GiB"'),
        ("several-problems.json", "$.runtime.container.image",
         'image "ghcr.io/kiln-tests/server:latest" is not pinned by digest: a tag can move; append @sha256:<64 hex digits>'),
        ("several-problems.json", "$.runtime.container.memory_swap_bytes",
         "memory_swap_bytes 1073741824 is below memory_bytes 8589934592: it must be at least that (equal turns swap off)"),
        ("several-problems.json", "$.serve.contxt", 'unknown field "contxt"; did you mean "context"?'),
        ("several-problems.json", "$.weights.revision",
         'revision "v1.0" is not a commit: pin the 40-hex commit id (a branch or tag name can move)'),
    ],
}


def lines(entry: str) -> list[str]:
    return [f"{REL}{file}::{path}: {message}" for file, path, message in EXPECTED[entry]]


@pytest.fixture
def at_repo(monkeypatch):
    """Run from the repo root (paths print relative to it) with the fixture tree as a recipes dir."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("KILN_RECIPES", str(TREE))


# ---------------------------------------------------------------- the schema itself

def test_schema_is_a_valid_2020_12_schema():
    Draft202012Validator.check_schema(validate.schema())
    assert validate.schema()["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_every_field_of_the_schema_is_described():
    """The schema doubles as the recipe reference: every field says what it is."""
    undescribed = []

    def walk(node, where):
        if isinstance(node, dict):
            for name, sub in node.get("properties", {}).items():
                if "description" not in sub:
                    undescribed.append(f"{where}.{name}")
            for key, sub in node.items():
                if key not in ("if", "then", "else"):  # conditions restate fields, they do not define them
                    walk(sub, f"{where}/{key}")
        elif isinstance(node, list):
            for i, sub in enumerate(node):
                walk(sub, f"{where}[{i}]")

    walk(validate.schema(), "#")
    assert undescribed == []


# ---------------------------------------------------------------- real recipes and valid fixtures

def test_the_real_recipes_are_valid(at_repo):
    assert validate.validate_paths([REPO / p for p in REAL]) == []
    assert validate.validate_paths([REPO / "recipes"]) == []


@pytest.mark.parametrize("rid", ["glm-5.3-flash", "glm-5.3", "smollm2-135m"])
def test_load_by_id_validates(rid, at_repo):
    recipe = recipes.load(rid)
    assert recipe.id == rid
    assert validate.validate_recipe(recipe) == []


def test_valid_fixtures_are_valid(at_repo):
    files, problems = validate.check_paths([VALID])
    assert sorted(f.name for f in files) == ["container-minimal.json", "container.json", "fleet-container.json",
                                             "fleet-llama-cpp.json", "native.json"]
    assert problems == []


# ---------------------------------------------------------------- one invalid fixture per rule

@pytest.mark.parametrize("entry", sorted(EXPECTED))
def test_invalid_fixture_gives_exactly_its_own_errors(entry, at_repo):
    assert validate.validate_paths([INVALID / entry]) == lines(entry)


def test_every_invalid_fixture_is_expected():
    assert sorted(p.name for p in INVALID.iterdir()) == sorted(EXPECTED)


def test_the_whole_invalid_directory_at_once(at_repo):
    """Validated together, the fixtures give the union of their errors, sorted by location."""
    by_file = sorted((t for entry in EXPECTED for t in EXPECTED[entry]), key=lambda t: t[0])  # stable: keeps location order
    everything = [f"{REL}{file}::{path}: {message}" for file, path, message in by_file]
    assert validate.validate_paths([INVALID]) == everything


def test_file_place_matters_only_inside_a_recipes_tree(at_repo, monkeypatch):
    """A loose copy (a draft, another test's temp file) is checked for everything but its place."""
    monkeypatch.delenv("KILN_RECIPES")
    assert validate.validate_paths([TREE]) == []


def test_a_rule_error_supersedes_the_schema_pattern_at_the_same_spot(at_repo):
    """The image and revision fail the schema's patterns too; only the rule's reason is printed."""
    raw = [(tuple(e.absolute_path), e.validator) for e in validate._validator().iter_errors(
        json.loads((INVALID / "image-not-pinned-by-digest.json").read_text()))]
    assert raw == [(("runtime", "container", "image"), "pattern")]
    assert len(validate.validate_paths([INVALID / "image-not-pinned-by-digest.json"])) == 1


def test_rules_never_crash_on_malformed_parts(at_repo, tmp_path):
    """Every value of a valid recipe replaced by each wrong type: located errors, never an exception."""
    base = json.loads((VALID / "container.json").read_text())
    native = json.loads((VALID / "native.json").read_text())

    def spots(node, where=()):
        yield where
        if isinstance(node, dict):
            for k, v in node.items():
                yield from spots(v, where + (k,))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                yield from spots(v, where + (i,))

    checked = 0
    for doc in (base, native):
        for where in list(spots(doc))[1:]:
            for wrong in (None, 7, "x", [], {}, [1], {"a": 1}):
                d = copy.deepcopy(doc)
                node = d
                for k in where[:-1]:
                    node = node[k]
                if node[where[-1]] == wrong:
                    continue
                node[where[-1]] = wrong
                problems = validate.check_recipe(recipe_file.Recipe(tmp_path / "r.json", d, b""))
                assert all(p.message for p in problems)
                checked += 1
    assert checked > 500


# ---------------------------------------------------------------- locating

def test_json_path_brackets_keys_that_are_not_identifiers():
    assert validate.json_path(("steps", "serve", "ports", 0, "host")) == "$.steps.serve.ports[0].host"
    assert validate.json_path(("files", "glm-5.3.vllm.320k.4x.yml", "mode")) == "$.files['glm-5.3.vllm.320k.4x.yml'].mode"
    assert validate.json_path(()) == "$"


def test_errors_sort_by_location_with_numeric_indices(at_repo, tmp_path):
    d = json.loads((VALID / "container.json").read_text())
    d["steps"]["serve"]["args"] = ["ok"] * 9 + [10] + [11]      # [10] must come after [9], not after [1]
    d["steps"]["serve"]["args"][2] = 2
    path = tmp_path / "r.json"
    path.write_text(json.dumps(d))
    assert [p.path for p in validate.check_paths([path])[1]] == [
        "$.steps.serve.args[2]", "$.steps.serve.args[9]", "$.steps.serve.args[10]"]


# ---------------------------------------------------------------- ids across files, unknown ids

def test_a_duplicate_id_across_recipes_dirs_names_both_files(at_repo, monkeypatch, tmp_path):
    tree = tmp_path / "mine"
    copy_at = tree / "nvidia" / "rtx-pro-6000-blackwell-96gb" / "glm-5.3.vllm.320k.4x.json"
    copy_at.parent.mkdir(parents=True)
    shutil.copy(REPO / REAL[1], copy_at)
    monkeypatch.setenv("KILN_RECIPES", str(tree))
    assert validate.validate_paths() == [  # sorted by file: /tmp/… before recipes/…
        f'{copy_at}::$.id: id "glm-5.3" is also used by {REAL[1]}',
        f'{REAL[1]}::$.id: id "glm-5.3" is also used by {copy_at}',
    ]


def test_the_same_file_named_twice_is_validated_once(at_repo):
    files, problems = validate.check_paths([REPO / REAL[0], REAL[0], REPO / "recipes" / "nvidia"])
    assert len(files) == len(list((REPO / "recipes" / "nvidia").rglob("*.json"))) and problems == []


def test_unknown_recipe_id_suggests_close_ids(at_repo):
    with pytest.raises(RecipeError) as e:
        recipes.load("glm-5.3-flsh")
    assert e.value.message == "unknown recipe 'glm-5.3-flsh'; did you mean glm-5.3-flash, glm-5.3, glm-5.3-2-hosts?"
    assert e.value.exit_code == Exit.BAD_RECIPE


def test_load_refuses_an_invalid_recipe_with_its_first_error(at_repo):
    with pytest.raises(RecipeError) as e:
        recipes.load(f"{REL}several-problems.json")
    assert e.value.message == (f"{lines('several-problems.json')[0]} "
                               f"(+5 more: run `tool validate {REL}several-problems.json`)")


# ---------------------------------------------------------------- the command

def invoke(*args):
    return CliRunner().invoke(cli, ["validate", *args])


def test_cli_default_validates_every_recipe(at_repo, monkeypatch):
    monkeypatch.delenv("KILN_RECIPES")
    result = invoke()
    n = len([p for p in (REPO / "recipes").rglob("*.json") if p.name != "schema.json"])
    assert (result.exit_code, result.stdout, result.stderr) == (0, "", f"{n} recipes, 0 errors\n")


def test_cli_prints_every_error_then_a_summary(at_repo):
    result = invoke(f"{REL}several-problems.json", f"{REL}wrong-type.json")
    want = lines("several-problems.json") + lines("wrong-type.json")
    assert result.exit_code == Exit.BAD_RECIPE == 3
    assert result.stdout == "".join(line + "\n" for line in want)
    assert result.stderr == "2 recipes, 7 errors\n"


def test_cli_searches_directories_recursively(at_repo):
    result = invoke(f"{REL}id-not-unique")
    assert (result.exit_code, result.stdout, result.stderr) == (
        3, "".join(line + "\n" for line in lines("id-not-unique")), "2 recipes, 2 errors\n")


def test_cli_malformed_json_is_one_located_line(at_repo):
    result = invoke(f"{REL}malformed-json.json")
    assert (result.exit_code, result.stdout, result.stderr) == (
        3, lines("malformed-json.json")[0] + "\n", "1 recipe, 1 error\n")
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_cli_a_missing_file_is_an_error_not_a_crash(at_repo):
    result = invoke("recipes/nope.json")
    assert (result.exit_code, result.stdout, result.stderr) == (
        3, "recipes/nope.json::$: cannot read (No such file or directory)\n", "1 recipe, 1 error\n")


def test_cli_json(at_repo):
    result = invoke("--json", f"{REL}wrong-type.json", REAL[2])
    assert result.exit_code == 3
    assert json.loads(result.stdout) == {
        "files": [f"{REL}wrong-type.json", REAL[2]],
        "errors": [{"file": f"{REL}wrong-type.json", "path": "$.serve.port",
                    "message": 'expected integer, got string "8000"'}],
    }
    assert result.stderr == "2 recipes, 1 error\n"


def test_the_installed_console_script(at_repo):
    """Once through the real entry point: exit code, streams, and no traceback."""
    tool = Path(sys.executable).parent / "tool"           # the venv's console script, as `make test` installs it
    assert tool.exists(), f"{tool}: the project is not installed in this interpreter's environment"
    env = {k: v for k, v in os.environ.items() if k != "KILN_RECIPES"}
    bad = subprocess.run([str(tool), "validate", f"{REL}image-not-pinned-by-digest.json", f"{REL}malformed-json.json"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert (bad.returncode, bad.stdout, bad.stderr) == (
        3, "".join(line + "\n" for line in lines("image-not-pinned-by-digest.json") + lines("malformed-json.json")),
        "2 recipes, 2 errors\n")
    good = subprocess.run([str(tool), "validate"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    n = len([p for p in (REPO / "recipes").rglob("*.json") if p.name != "schema.json"])
    assert (good.returncode, good.stdout, good.stderr) == (0, "", f"{n} recipes, 0 errors\n")


def test_recipe_modules_import_one_way():
    """recipes → validate → recipe_file, no circle: the validator and the file reader load without the loader
    (before, tool.validate imported tool.recipes, which imported tool.validate back inside load())."""
    for code in ("import sys, tool.validate; assert 'tool.recipes' not in sys.modules; print('ok')",
                 "import sys, tool.recipe_file; "
                 "assert not {'tool.recipes', 'tool.validate'} & set(sys.modules); print('ok')"):
        r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                           capture_output=True, text=True, timeout=60)
        assert (r.returncode, r.stdout) == (0, "ok\n"), r.stderr
    source = (REPO / "tool" / "recipes.py").read_text()
    assert "import validate_recipe" in source.split('"""', 2)[2].split("\ndef ", 1)[0], \
        "tool.recipes imports the validator at the top, not lazily inside load()"
