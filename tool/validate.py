"""Validate recipes: recipes/schema.json plus the rules a schema cannot say.

Every problem is reported at once, each located as `file::$.json.path: message`
(check-jsonschema's manner), sorted by file, then by path (indices numerically). The rules are
small named functions, one per rule, that read whatever parts of a recipe are well
formed and skip the rest (the schema reports those), so they never crash on bad input.
Where a rule and the schema find the same spot (an image without a digest fails both
the schema's pattern and `image_pinned_by_digest`), the rule's message, which says why,
is the one reported.

`tool.recipes.load` calls `validate_recipe` on every load, so the compiled validator is
cached for the process.
"""
from __future__ import annotations

import ast
import difflib
import functools
import json
import os
import posixpath
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError, best_match

from tool import REPO_ROOT
from tool.errors import RecipeError, printable
from tool.recipe_file import Recipe, parse, real_path, recipe_files, recipes_dirs

SCHEMA_PATH = REPO_ROOT / "recipes" / "schema.json"

Where = tuple  # a location in the document: keys and list indices from the root


@dataclass(frozen=True)
class Problem:
    file: str
    where: Where
    message: str

    @property
    def path(self) -> str:
        return json_path(self.where)

    def __str__(self) -> str:
        # one line whatever the recipe held: a key or a value may carry a newline or a lone surrogate
        return printable(f"{self.file}::{self.path}: {self.message}")

    def sort_key(self):
        # document order would need the parser's positions; key order with numeric
        # indices (so [10] comes after [9]) is stable and reads the same
        return (self.file, tuple((isinstance(p, str), p) for p in self.where), self.message)

    def as_dict(self) -> dict:
        return {"file": printable(self.file), "path": printable(self.path), "message": printable(self.message)}


_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def json_path(where: Iterable) -> str:
    """('steps', 'serve', 'ports', 0, 'host') -> $.steps.serve.ports[0].host; odd keys bracketed."""
    out = "$"
    for part in where:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _IDENT.match(part):
            out += f".{part}"
        else:
            out += "[" + json.dumps(part, ensure_ascii=False).replace('"', "'") + "]"
    return out


def _show(value, limit: int = 60) -> str:
    """A value as it is written in JSON, cut short: messages stay one readable line."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def display_path(path: Path) -> str:
    """Paths under the working directory print relative to it (as the user typed them)."""
    try:
        return str(real_path(path).relative_to(real_path(Path.cwd())))
    except ValueError:
        return str(path)


# ---------------------------------------------------------------- the schema

@functools.cache
def schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


@functools.cache
def _validator() -> Draft202012Validator:
    # format_checker makes "format": "date" an assertion (2026-02-30 is refused)
    return Draft202012Validator(schema(), format_checker=Draft202012Validator.FORMAT_CHECKER)


_JSON_TYPE = {bool: "boolean", int: "integer", float: "number", str: "string",
              list: "array", dict: "object", type(None): "null"}


def _explain(error: ValidationError) -> Iterator[tuple[Where, str]]:
    """One jsonschema error → located messages that name the field and the limit."""
    # a schema object may carry its own message (ajv-errors' "errorMessage", string form)
    own = error.schema.get("errorMessage") if isinstance(error.schema, dict) else None
    if own:
        yield tuple(error.absolute_path), own
        return
    best = best_match([error])  # descends anyOf/oneOf to the sub-error that matters
    if best is not error:
        yield from _explain(best)
        return
    where, v, value, inst = tuple(error.absolute_path), error.validator, error.validator_value, error.instance
    if v == "additionalProperties":
        known = list(error.schema.get("properties", {}))
        patterns = list(error.schema.get("patternProperties", {}))
        for key in inst:
            if key in known or any(re.search(p, key) for p in patterns):
                continue
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"; did you mean {_show(close[0])}?" if close else f" (allowed: {', '.join(known)})"
            yield where + (key,), f"unknown field {_show(key)}{hint}"
    elif v == "required":
        m = re.match(r"^(.*) is a required property$", error.message)  # jsonschema names it only here
        name = _show(ast.literal_eval(m.group(1))) if m else error.message
        yield where, f"missing required field {name}"
    elif v == "type":
        want = " or ".join(value) if isinstance(value, list) else value
        yield where, f"expected {want}, got {_JSON_TYPE.get(type(inst), type(inst).__name__)} {_show(inst)}"
    elif v == "enum":
        yield where, f"{_show(inst)} is not one of {', '.join(_show(x) for x in value)}"
    elif v == "const":
        yield where, f"must be {_show(value)}, not {_show(inst)}"
    elif v == "pattern":
        yield where, f"{_show(inst)} does not match {value}"
    elif v == "format":
        yield where, f"{_show(inst)} is not a valid {value}"
    elif v in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        rel = {"minimum": "below the minimum", "maximum": "above the maximum",
               "exclusiveMinimum": "not above", "exclusiveMaximum": "not below"}[v]
        yield where, f"{_show(inst)} is {rel} {value}"
    elif v in ("minItems", "maxItems"):
        rel = "at least" if v == "minItems" else "at most"
        yield where, f"has {len(inst)} item{'s' if len(inst) != 1 else ''}; {rel} {value} allowed"
    elif v in ("minLength", "maxLength"):
        rel = "at least" if v == "minLength" else "at most"
        yield where, f"{_show(inst)} has {len(inst)} characters; {rel} {value} allowed"
    elif v == "uniqueItems":
        yield where, "has repeated items; each may appear once"
    else:  # dependentRequired, multipleOf, propertyNames…: jsonschema's message is short and exact
        message = " ".join(error.message.split())  # one line, whatever the instance held
        yield where, message if len(message) <= 200 else message[:199] + "…"


def _forbidden(error: ValidationError) -> bool:
    """`"not": {}`: the field may not be here at all (e.g. runtime.native of a container recipe)."""
    return error.validator == "not" and error.validator_value == {}


def schema_problems(data) -> list[tuple[Where, str]]:
    errors = list(_validator().iter_errors(data))
    # what is inside a field that may not be there at all is not worth a line of its own
    gone = [tuple(e.absolute_path) for e in errors if _forbidden(e)]
    return [(where, msg) for e in errors for where, msg in _explain(e)
            if _forbidden(e) or not any(where[: len(g)] == g for g in gone)]


# ---------------------------------------------------------------- the rules beyond the schema

def _get(data, *keys):
    """data[k1][k2]… or None where a level is missing or not an object."""
    for key in keys:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _steps(data) -> Iterator[tuple[str, dict]]:
    steps = _get(data, "steps")
    if isinstance(steps, dict):
        for name, step in steps.items():
            if isinstance(step, dict):
                yield name, step


def _mounts(step: dict) -> Iterator[tuple[int, dict]]:
    mounts = step.get("mounts")
    if isinstance(mounts, list):
        for i, m in enumerate(mounts):
            if isinstance(m, dict):
                yield i, m


_DIGEST_PINNED = re.compile(r"^[^@\s]+@sha256:[0-9a-f]{64}$")


def image_pinned_by_digest(recipe: Recipe) -> Iterator[tuple[Where, str]]:
    """A tag can be moved to other bytes; only a digest names the image that was tested."""
    image = _get(recipe.data, "runtime", "container", "image")
    if not isinstance(image, str) or _DIGEST_PINNED.match(image):
        return
    where = ("runtime", "container", "image")
    if "@" not in image:
        yield where, f"image {_show(image)} is not pinned by digest: a tag can move; append @sha256:<64 hex digits>"
    else:
        yield where, f"image {_show(image)} has no valid digest: it must end in @sha256:<64 lower-case hex digits>"


_HEX40 = re.compile(r"^[0-9a-f]{40}$")


def revision_is_a_commit(recipe: Recipe) -> Iterator[tuple[Where, str]]:
    """A branch or tag name can move; the weights are pinned by the full commit id."""
    weights = _get(recipe.data, "weights")
    rev = _get(weights, "revision")
    if _get(weights, "source") != "huggingface" or not isinstance(rev, str) or _HEX40.match(rev):
        return
    if re.fullmatch(r"[0-9a-fA-F]+", rev) and len(rev) < 40:
        why = f"a short commit id ({len(rev)} hex digits); write all 40"
    else:
        why = "pin the 40-hex commit id (a branch or tag name can move)"
    yield ("weights", "revision"), f"revision {_show(rev)} is not a commit: {why}"


def swap_not_below_memory(recipe: Recipe) -> Iterator[tuple[Where, str]]:
    """docker refuses --memory-swap below --memory; equal turns swap off (the seeds' choice)."""
    c = _get(recipe.data, "runtime", "container")
    mem, swap = _get(c, "memory_bytes"), _get(c, "memory_swap_bytes")
    if _is_int(mem) and _is_int(swap) and swap < mem:
        yield (("runtime", "container", "memory_swap_bytes"),
               f"memory_swap_bytes {swap} is below memory_bytes {mem}: it must be at least that "
               "(equal turns swap off)")


def decode_baseline_needs_native(recipe: Recipe) -> Iterator[tuple[Where, str]]:
    """The speed gate's baseline runs the recipe's native program; a container recipe has none to run."""
    if _get(recipe.data, "checks", "decode_baseline") is not None and _get(recipe.data, "runtime", "kind") != "native":
        yield (("checks", "decode_baseline"),
               "decode_baseline runs the recipe's native program: it needs runtime.kind native")


def _under(path: str, root: str) -> bool:
    path, root = posixpath.normpath(path), posixpath.normpath(root)
    return path == root or path.startswith(root.rstrip("/") + "/")


def _mount_label(source) -> str:
    if isinstance(source, str) and source.startswith("file:"):
        return f"file {_show(source[5:])}"
    return f"the {source}" if source in ("store", "weights") else _show(source)


def writes_only_on_writable_mounts(recipe: Recipe) -> Iterator[tuple[Where, str]]:
    """A step may write only below a writable mount and below no read-only one: inputs
    (weights, files) stay untouched, whatever the mount order makes the paths overlap."""
    native = isinstance(_get(recipe.data, "runtime", "kind"), str) and _get(recipe.data, "runtime", "kind") in NATIVE_KINDS
    for name, step in _steps(recipe.data):
        writes = step.get("writes")
        if not isinstance(writes, list):
            continue
        mounts = [(m["target"], m["read_only"], _mount_label(m.get("source")))
                  for _, m in _mounts(step)
                  if isinstance(m.get("target"), str) and isinstance(m.get("read_only"), bool)]
        if native:  # native steps see the store and weights by placeholder, not by mount
            mounts += [("@store@", name != "prepare", "the store"), ("@weights@", True, "the weights")]
        for i, path in enumerate(writes):
            if not isinstance(path, str):
                continue
            read_only = [(t, s) for t, ro, s in mounts if ro and _under(path, t)]
            if read_only:
                target, source = read_only[0]
                yield (("steps", name, "writes", i),
                       f"step {name} writes {_show(path)}, which lies under read-only mount {_show(target)} ({source})")
            elif not any(not ro and _under(path, t) for t, ro, _ in mounts):
                yield (("steps", name, "writes", i),
                       f"step {name} writes {_show(path)}, which lies under no writable mount (read_only: false)")


def only_prepare_writes_the_store(recipe: Recipe) -> Iterator[tuple[Where, str]]:
    """Mounts are inputs: the weights and files are never writable, and the store only while
    prepare builds it (verify and serve see it read-only, as the seed serves /nvx:ro)."""
    for name, step in _steps(recipe.data):
        for i, m in _mounts(step):
            if m.get("read_only") is not False:
                continue
            source = m.get("source")
            if name != "prepare":
                yield (("steps", name, "mounts", i, "read_only"),
                       f"step {name} mounts {_mount_label(source)} writable; only prepare writes (read_only: true here)")
            elif source != "store":
                yield (("steps", name, "mounts", i, "read_only"),
                       f"step prepare mounts {_mount_label(source)} writable; only the store may be (read_only: true here)")


def mounted_files_exist(recipe: Recipe) -> Iterator[tuple[Where, str]]:
    """`file:<name>` mounts a file the recipe carries; the name must be one of `files`."""
    files = _get(recipe.data, "files")
    names = list(files) if isinstance(files, dict) else []
    for name, step in _steps(recipe.data):
        for i, m in _mounts(step):
            source = m.get("source")
            if isinstance(source, str) and source.startswith("file:") and source[5:] not in names:
                known = f" (files: {', '.join(names)})" if names else " (the recipe has no files)"
                yield (("steps", name, "mounts", i, "source"),
                       f"mounts file {_show(source[5:])}, which is not in files{known}")


def _store_placeholders(step: dict) -> Iterator[Where]:
    for key in ("writes", "args"):
        words = step.get(key)
        if isinstance(words, list):
            yield from ((key, i) for i, w in enumerate(words) if isinstance(w, str) and "@store@" in w)
    commands = step.get("commands")
    if isinstance(commands, list):
        for i, cmd in enumerate(commands):
            if isinstance(cmd, list):
                yield from (("commands", i, j) for j, w in enumerate(cmd) if isinstance(w, str) and "@store@" in w)


def store_defined_when_used(recipe: Recipe) -> Iterator[tuple[Where, str]]:
    """A step that mounts the store (or names @store@) needs the store's facts: its
    directory, size and filesystem needs come from `store`."""
    if "store" in recipe.data:
        return
    for name, step in _steps(recipe.data):
        for i, m in _mounts(step):
            if m.get("source") == "store":
                yield (("steps", name, "mounts", i, "source"),
                       f"step {name} mounts the store, but the recipe has no store")
        first = next(_store_placeholders(step), None)
        if first is not None:
            yield ("steps", name) + first, f"step {name} uses @store@, but the recipe has no store"


_MODEL_PART = re.compile(r"^[a-z0-9][a-z0-9.-]*$")


def _place_in_tree(path: Path) -> Path | None:
    """The path relative to the recipes tree that holds it, or None for a loose file."""
    resolved = real_path(path)
    for d in recipes_dirs():
        try:
            return resolved.relative_to(real_path(d))
        except (ValueError, OSError):
            continue
    return None


def file_name_matches_recipe(recipe: Recipe) -> Iterator[tuple[Where, str]]:
    """In a recipes tree, a recipe's place says what it is: <vendor>/<card>/<model>.<engine>.<ctx>k[.<n>x].json,
    ctx = serve.context/1024, n = hardware.gpu_count when > 1. A loose file (a draft, a
    test's copy) is checked for everything but its place."""
    rel = _place_in_tree(recipe.path)
    if rel is None:
        return
    d = recipe.data
    vendor, card = _get(d, "hardware", "vendor"), _get(d, "hardware", "card")
    engine, context, gpus = _get(d, "model", "engine"), _get(d, "serve", "context"), _get(d, "hardware", "gpu_count")
    if not (all(isinstance(x, str) and x for x in (vendor, card, engine))
            and _is_int(context) and context > 0 and _is_int(gpus)):
        return  # the schema reports the missing or mistyped field
    suffix = f".{engine}.{round(context / 1024)}k" + (f".{gpus}x" if gpus > 1 else "") + ".json"
    parts = rel.parts
    fits = (len(parts) == 3 and parts[0] == vendor and parts[1] == card and parts[2].endswith(suffix)
            and _MODEL_PART.match(parts[2][: -len(suffix)]) is not None)
    if not fits:
        yield (), (f"placed at {rel.as_posix()}, but its fields say {vendor}/{card}/<model>{suffix} "
                   "(vendor/card/<model>.<engine>.<context/1024>k[.<gpu_count>x].json)")


# ---------------------------------------------------------------- hostile text, numbers and knobs

def _walk(data, where: Where = ()) -> Iterator[tuple[Where, object, bool]]:
    """Every value and every key of the document: (where, value, is_key). Iterative; parse() bounds the depth."""
    stack = [(where, data)]
    while stack:
        where, value = stack.pop()
        yield where, value, False
        if isinstance(value, dict):
            for k, v in value.items():
                yield where + (k,), k, True
                stack.append((where + (k,), v))
        elif isinstance(value, list):
            stack += [(where + (i,), v) for i, v in enumerate(value)]


_NAMES = {"\n": "newline", "\r": "carriage return", "\t": "tab", "\x00": "NUL", "\x1b": "escape",
          "\u2028": "line separator", "\u2029": "paragraph separator", "\x85": "next line"}
# Recipe text reaches unit files (systemd ends a line at \n, \r and NUL; it has no escape for them in
# Description=), command lines and terminals; no control character there is ever meant.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _is_file_content(where: Where) -> bool:
    return len(where) == 3 and where[0] == "files" and where[2] == "content"


def _char(c: str) -> str:
    name = _NAMES.get(c)
    return f"U+{ord(c):04X}" + (f" ({name})" if name else "")


def text_is_plain(recipe: Recipe) -> Iterator[tuple[Where, str]]:
    """Strings are valid Unicode everywhere, and free of control characters everywhere but a carried
    file's content (a script has newlines; it is written to its own file, never into a unit)."""
    for where, value, is_key in _walk(recipe.data):
        if not isinstance(value, str):
            continue
        what = "key" if is_key else "string"
        bad = _SURROGATE.search(value)
        if bad:
            yield where, (f"{what} holds a lone surrogate {_char(bad.group())}, which is not Unicode text "
                          "(no file or unit can hold it)")
        elif _is_file_content(where) and not is_key:
            if "\x00" in value:
                yield where, "content holds U+0000 (NUL), which Nix strings cannot carry (the file would be cut short)"
        else:
            bad = _CONTROL.search(value)
            if bad:
                yield where, (f"{what} holds control character {_char(bad.group())}: recipe text reaches unit files, "
                              "command lines and terminals, and none belongs there")


INT64 = (-(2**63), 2**63 - 1)


def numbers_fit(recipe: Recipe) -> Iterator[tuple[Where, str]]:
    """Nix (the compiler) holds integers in 64 bits; a larger one cannot reach a plan as written."""
    for where, value, is_key in _walk(recipe.data):
        if _is_int(value) and not is_key and not INT64[0] <= value <= INT64[1]:
            digits = len(str(abs(value)))
            yield where, f"integer of {digits} digits is out of range: integers fit in 64 bits (at most {INT64[1]})"


# Knobs that are the operator's, never the recipe's (README, Reliability). The bind address and port come
# from `tool plan --bind/--port` or the NixOS module, reaching native args only as @host@/@port@; a
# secret lives in the operator's environment file, never in a unit file or an argv anyone can read.
PLACEHOLDER_FLAGS = {"--host": "@host@", "--port": "@port@"}
OPERATOR_FLAGS = {"--bind": "the bind address", "--api-key": "the API key", "--api-key-file": "the API key"}
# Environment that belongs to the operator (Kiln's own settings and secrets) or that would turn a recipe's
# data into code in the process (loader and interpreter search paths).
OPERATOR_ENV = {"HF_TOKEN": "a secret", "HUGGING_FACE_HUB_TOKEN": "a secret",
                "PATH": "the program search path", "PYTHONPATH": "an interpreter search path (it loads code)",
                "PYTHONHOME": "an interpreter search path (it loads code)", "PYTHONSTARTUP": "code run at start",
                "PYTHONUSERBASE": "an interpreter search path (it loads code)", "BASH_ENV": "code run at start",
                "ENV": "code run at start"}
# A secret in a recipe would sit in world-readable unit files and argv, and for a container a recipe's -e
# wins over the operator's --env-file (docker applies -e last): no recipe names one.
SECRET_ENV = re.compile(r"(^|_)(API_KEY|TOKEN|SECRET|PASSWORD)$")
OPERATOR_ENV_PREFIXES = {"KILN_": "one of Kiln's own settings (the API key, its directories)",
                         "LD_": "a dynamic-loader variable (it loads code into the process)"}


def _argv_words(step: dict) -> Iterator[tuple[Where, list]]:
    args = step.get("args")
    if isinstance(args, list):
        yield ("args",), args
    commands = step.get("commands")
    if isinstance(commands, list):
        for i, cmd in enumerate(commands):
            if isinstance(cmd, list):
                yield ("commands", i), cmd


def _flag_problems(words: list, native: bool) -> Iterator[tuple[int, str]]:
    for i, word in enumerate(words):
        if not isinstance(word, str) or not word.startswith("--"):
            continue
        flag, eq, inline = word.partition("=")
        if flag in OPERATOR_FLAGS:
            yield i, (f"{flag} sets {OPERATOR_FLAGS[flag]}, which is the operator's, not the recipe's "
                      "(a secret goes in the operator's environment file)")
        elif native and flag in PLACEHOLDER_FLAGS:
            want = PLACEHOLDER_FLAGS[flag]
            value = inline if eq else (words[i + 1] if i + 1 < len(words) else None)
            if value != want:
                knob = "--bind" if flag == "--host" else "--port"
                yield i, (f"{flag} {_show(value)}: the {'bind address' if flag == '--host' else 'port'} is the "
                          f"operator's (tool plan {knob}, the NixOS module's options); write {flag} {want}")


# Runtimes whose steps run as a program under systemd, with their runtime object: they name --host/--port as
# @host@/@port@ and see the store and weights by placeholder.
NATIVE_KINDS = {"native": "native", "llama-cpp": "llama_cpp"}


def operator_knobs_stay_the_operators(recipe: Recipe) -> Iterator[tuple[Where, str]]:
    """A recipe cannot widen where the server listens, turn off its auth or load code through its args or env.

    Container args are the words after the image, read by the server inside: its --host is the
    container's own interface, and the host side is docker's -p, bound to the operator's address."""
    # (a "native" recipe without its runtime.native object is refused by the schema already)
    kind = _get(recipe.data, "runtime", "kind")
    native = isinstance(kind, str) and kind in NATIVE_KINDS and isinstance(_get(recipe.data, "runtime", NATIVE_KINDS[kind]), dict)
    for name, step in _steps(recipe.data):
        for where, words in _argv_words(step):
            for i, message in _flag_problems(words, native):
                yield ("steps", name) + where + (i,), f"step {name}: {message}"
    baseline = _get(recipe.data, "checks", "decode_baseline", "args")
    if isinstance(baseline, list):
        for i, message in _flag_problems(baseline, native):
            yield ("checks", "decode_baseline", "args", i), f"decode_baseline: {message}"
    envs = ([(("env",), _get(recipe.data, "env"))] + [(("steps", n, "env"), s.get("env")) for n, s in _steps(recipe.data)]
            + [(("fleet", "worker", "env"), _get(recipe.data, "fleet", "worker", "env"))])
    for where, env in envs:
        if not isinstance(env, dict):
            continue
        for key in env:
            if not isinstance(key, str):
                continue
            why = (OPERATOR_ENV.get(key) or next((w for p, w in OPERATOR_ENV_PREFIXES.items() if key.startswith(p)), None)
                   or ("a secret" if SECRET_ENV.search(key) else None))
            if why:
                yield where + (key,), (f"{key} is {why}: the operator sets it (the environment file, or the NixOS "
                                       "module's extraEnv), never a recipe")


# ---------------------------------------------------------------- fleets

# Where a fleet's worker listens and which workers the head drives are the operator's (--fleet-address):
# the compiler adds rpc-server's --host/--port and llama-server's --rpc; a recipe naming them is refused.
FLEET_OPERATOR_FLAGS = {
    "worker": {"--host": "the worker's fleet address", "-H": "the worker's fleet address",
               "--port": "the worker's fleet port", "-p": "the worker's fleet port"},
    "head": {"--rpc": "the workers' fleet addresses"},
}
FLEET_RUNTIMES = ("llama-cpp", "container")


def fleet_is_one_head_and_its_workers(recipe: Recipe) -> Iterator[tuple[Where, str]]:
    """A fleet has exactly one head (it serves the API and drives the workers) and runs on a runtime that has a
    distributed engine to deploy (llama.cpp's RPC backend, vLLM on Ray in a container): Kiln's engine has none."""
    fleet = _get(recipe.data, "fleet")
    if not isinstance(fleet, dict):
        return
    hosts = fleet.get("hosts")
    if isinstance(hosts, dict) and all(isinstance(h, dict) for h in hosts.values()):
        heads = sorted(n for n, h in hosts.items() if h.get("role") == "head")
        if len(heads) != 1:
            named = f" ({', '.join(heads)})" if heads else ""
            yield ("fleet", "hosts"), (f"a fleet has exactly one host with role head, this one has {len(heads)}{named}")
    kind = _get(recipe.data, "runtime", "kind")
    if isinstance(kind, str) and kind not in FLEET_RUNTIMES:
        yield ("runtime", "kind"), (f"runtime {_show(kind)} cannot span hosts: a fleet deploys llama.cpp's RPC backend "
                                    "(llama-cpp) or vLLM on Ray (container)")
    roles = [("worker", ("fleet", "worker", "args"), _get(fleet, "worker", "args"))]
    if kind == "llama-cpp":
        roles.append(("head", ("steps", "serve", "args"), _get(recipe.data, "steps", "serve", "args")))
    for role, where, words in roles:
        if not isinstance(words, list):
            continue
        for i, word in enumerate(words):
            flag = word.partition("=")[0] if isinstance(word, str) else None
            if kind == "llama-cpp" and flag in FLEET_OPERATOR_FLAGS[role]:
                yield where + (i,), (f"{flag} sets {FLEET_OPERATOR_FLAGS[role][flag]}, which is the operator's "
                                     "(tool plan --fleet-address, the NixOS module's fleet options); Kiln adds it")


RULES = (
    fleet_is_one_head_and_its_workers,
    text_is_plain,
    numbers_fit,
    operator_knobs_stay_the_operators,
    image_pinned_by_digest,
    revision_is_a_commit,
    swap_not_below_memory,
    decode_baseline_needs_native,
    writes_only_on_writable_mounts,
    only_prepare_writes_the_store,
    mounted_files_exist,
    store_defined_when_used,
    file_name_matches_recipe,
)


def ids_unique(recipes: list[Recipe]) -> Iterator[Problem]:
    """Ids are names on the command line and in unit names: two recipes cannot share one."""
    by_id: dict[str, list[Recipe]] = defaultdict(list)
    for r in recipes:
        if isinstance(r.data.get("id"), str):
            by_id[r.data["id"]].append(r)
    for rid, group in by_id.items():
        for r in group if len(group) > 1 else ():
            others = ", ".join(display_path(o.path) for o in group if o is not r)
            yield Problem(display_path(r.path), ("id",), f"id {_show(rid)} is also used by {others}")


# ---------------------------------------------------------------- entry points

def check_recipe(recipe: Recipe) -> list[Problem]:
    """Schema and per-recipe rules for one parsed recipe."""
    file = display_path(recipe.path)
    ruled = [(where, msg) for rule in RULES for where, msg in rule(recipe)]
    claimed = {where for where, _ in ruled}
    schemed = [(w, m) for w, m in schema_problems(recipe.data) if w not in claimed]
    return sorted((Problem(file, w, m) for w, m in schemed + ruled), key=Problem.sort_key)


def expand(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Files as given, directories searched recursively for *.json; each file once."""
    out, seen = [], set()
    for p in map(Path, paths):
        for f in recipe_files([p]) if p.is_dir() else [p]:
            key = real_path(f)
            if key not in seen:
                seen.add(key)
                out.append(f)
    return out


def check_paths(paths: Iterable[str | os.PathLike] | None = None) -> tuple[list[Path], list[Problem]]:
    """Validate files together (None: every recipe under tool.recipe_file.recipes_dirs())."""
    files = expand(paths) if paths else recipe_files()
    problems: list[Problem] = []
    parsed: list[Recipe] = []
    for f in files:
        try:
            recipe = parse(f)
        except RecipeError as e:  # unreadable or malformed: one located error, no traceback
            problems.append(Problem(display_path(f), (), e.message.removeprefix(f"{f}: ")))
            continue
        parsed.append(recipe)
        problems += check_recipe(recipe)
    problems += ids_unique(parsed)
    return files, sorted(problems, key=Problem.sort_key)


def validate_recipe(recipe: Recipe) -> list[str]:
    """Every problem of one recipe, as `file::$.path: message` lines; [] when valid."""
    return [str(p) for p in check_recipe(recipe)]


def validate_paths(paths: Iterable[str | os.PathLike] | None = None) -> list[str]:
    """Every problem of the recipes at paths (files or directories), ids checked across them."""
    return [str(p) for p in check_paths(paths)[1]]
