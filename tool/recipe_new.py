"""`tool recipe new FILE.gguf --card CARD`: a native recipe for a GGUF the user has, from the file's shape and
the card's budget.

The file is described by the engine itself (`engine verify-model --json`: every check a served GGUF gets, its
sha256, its expert layout and the store pack-store makes from it), so the tool never reads tensors (it runs
where torch is not installed). The weights are pinned as a local file by sha256: `tool fetch` copies the file
in and serves only a copy that hashes to the pin. The recipe is validated before it is written (temp name,
rename); `tool preflight` then says whether this host runs it.
"""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from tool.atomic import write_json
from tool.errors import Exit, KilnError, RecipeError, child_exit
from tool.programs import program
from tool.recipe_file import parse

GIB = 1 << 30
# A card is "any" (the CPU) or a slug ending in its VRAM: rtx-3090-24gb, h200-141gb.
_VRAM = re.compile(r"^[a-z0-9][a-z0-9-]*-(\d+)gb$")
DEFAULT_CONTEXT = 8192
O_DIRECT_FS = ["ext4", "xfs", "tmpfs"]       # where the store's O_DIRECT reads work (as the demo recipe says)
GPU_RESERVE = 2 * GIB            # CUDA context, activations, the KV cache's growth: left free on the card


def describe(gguf: Path) -> dict:
    """The engine's description of the file (its one-line reason and exit code when it is no model)."""
    r = subprocess.run([program("engine"), "verify-model", "--model", str(gguf), "--json"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        line = (r.stderr.strip().splitlines() or ["engine verify-model failed"])[-1].removeprefix("engine: ")
        raise KilnError(f"{gguf}: {line}" if str(gguf) not in line else line, child_exit(r.returncode))
    return json.loads(r.stdout)


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:60] or "model"


def build(gguf: Path, card: str, info: dict, context: int | None = None) -> dict:
    """The recipe dict for `gguf` (described by `info`) on `card`."""
    gguf = gguf.resolve()
    part = info["parts"][0]
    if len(info["parts"]) > 1:
        raise KilnError(f"{gguf}: a split set; a local recipe pins one file (merge it with llama-gguf-split)",
                        Exit.BAD_RECIPE)
    gpu = card != "any"
    if gpu and not (m := _VRAM.match(card)):
        raise KilnError(f"--card {card}: not 'any' (the CPU) or a card slug ending in its VRAM, e.g. rtx-3090-24gb",
                        Exit.USAGE)
    ctx = min(context or DEFAULT_CONTEXT, info["context"])
    rid = _slug(gguf.name.removesuffix(".gguf"))
    store, records = info["store"], info["store"]["records"]
    store_bytes = records * store["record_bytes"]
    resident = info["non_expert_elements"] * (2 if gpu else 4)        # bf16 on a GPU, float32 on the CPU
    experts = f"{info['experts']} experts, top-{info['experts_per_token']}"
    upcycled = " (a dense model, sparse-upcycled)" if info["upcycled"] else ""
    serve = ["serve", "--model", f"@weights@/{gguf.name}", "--store", "@store@/experts",
             "--host", "@host@", "--port", "@port@", "--served-name", rid, "--ctx", str(ctx)]
    if gpu:
        vram = int(m.group(1)) * 10**9
        slots = max(1, (vram - GPU_RESERVE - resident) // store["record_bytes"])
        memory = resident + store_bytes + 2 * GIB                    # the RAM tier holds every record
        serve += ["--device", "cuda", "--gpu-slots", str(min(slots, records)), "--ram-slots", str(records)]
        hardware = {"vendor": "nvidia", "card": card, "card_name": card, "gpu_count": 1, "min_vram_bytes": vram,
                    "min_host_ram_bytes": memory + 2 * GIB, "disk": {"nvme": True, "filesystems": O_DIRECT_FS}}
        order = "rows"
    else:
        memory = resident + store_bytes + 2 * GIB
        serve += ["--device", "cpu", "--ram-slots", str(records)]
        hardware = {"vendor": "cpu", "card": "any", "card_name": "CPU", "gpu_count": 0,
                    "min_host_ram_bytes": memory + GIB,
                    "cpu": {"arch": "x86_64", "features": [], "min_logical_cpus": 1},
                    "disk": {"nvme": False, "filesystems": O_DIRECT_FS}}
        order = "cols"
    return {
        "schema_version": 1,
        "id": rid,
        "title": f"{gguf.name} · kiln engine · {ctx // 1024}K context · {'CPU' if not gpu else card}",
        "summary": f"A local GGUF ({info['architecture']}, {experts}{upcycled}) served by Kiln's engine from the "
                   f"file alone, written by `tool recipe new`.",
        "model": {"name": gguf.name, "vendor": "local", "engine": "kiln", "modalities": ["text"],
                  "quantization": f"GGUF, experts in {', '.join(info['expert_types'])}"},
        "hardware": hardware,
        "weights": {"source": "local", "path": str(gguf), "sha256": part["sha256"], "size_bytes": part["bytes"],
                    "dirname": f"{rid}-{part['sha256'][:12]}"},
        "store": {"dirname": f"{rid}.kiln.{ctx // 1024}k-prepared", "size_bytes": store_bytes + (1 << 20),
                  "record_bytes": store["record_bytes"], "records": records, "layers": info["moe_layers"],
                  "experts_per_layer": info["experts"], "record_alignment": 4096, "o_direct": True,
                  "read_only_while_serving": True},
        "runtime": {"kind": "native", "native": {"program": "engine", "memory_max_bytes": memory,
                                                 "memlock": "infinity", "device": "cuda" if gpu else "cpu"}},
        "env": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
        "steps": {
            "prepare": {"description": f"pack the file's routed experts into the O_DIRECT store ({store['quant']} "
                                       f"records, {order} order), straight from the GGUF",
                        "writes": ["@store@"],
                        "commands": [["pack-store", "--model", f"@weights@/{gguf.name}", "--store", "@store@/experts",
                                      "--order", order]]},
            "verify": {"description": "re-read every store record with O_DIRECT against its sha256 and the "
                                      "manifest against the file, then check the GGUF whole as a model",
                       "commands": [["verify-store", "--store", "@store@/experts", "--model", f"@weights@/{gguf.name}"],
                                    ["verify-model", "--model", f"@weights@/{gguf.name}"]]},
            "serve": {"args": serve, "ready_timeout_s": 1800,
                      "description": "the GGUF alone (config, tokenizer, chat template and tensors from the file), "
                                     "every expert record in the RAM tier"},
        },
        "serve": {"served_name": rid, "context": ctx, "max_batch_size": 4, "port": 8000},
        "checks": {"gates": ["load", "chat", "speed"], "report_only": ["reasoning", "tools", "context"],
                   "load_timeout_s": 1800, "context_fill": 0.85},
        "proof": [],
    }


def write(recipe: dict, out: Path) -> Path:
    """Validate, then publish `out` by rename; RecipeError with the first problem when it is not valid."""
    from tool.validate import validate_recipe  # jsonschema: only where a recipe is written
    tmp = out.with_name(f".{out.name}.new")
    write_json(tmp, recipe)
    try:
        errors = validate_recipe(parse(tmp))
        if errors:
            raise RecipeError(f"the recipe written for this file is not valid: {errors[0].replace(tmp.name, out.name)}")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
