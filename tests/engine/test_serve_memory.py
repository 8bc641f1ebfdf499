"""What the CPU serve path keeps out of its memory (issue 14's bullet: bench/demo_memory.py measures the RSS).

Each check runs in a fresh interpreter, since what a module imports is only visible from a clean sys.modules.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def fresh(code: str, **env) -> dict:
    """Run `code` in a new interpreter on this tree; it prints one JSON line, returned."""
    e = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    e.update(PYTHONPATH=str(REPO), **env)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=e, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


SERVE_IMPORTS = ("import json, sys; import engine.cli.serve, engine.server.app, engine.llm, engine.loader, "
                 "engine.tiers.tiered, engine.tiers.zero_copy, engine.tiers.resident, engine.kernels.quant_triton; "
                 "print(json.dumps({'triton': 'triton' in sys.modules}))")


@pytest.mark.skipif(bool(torch.version.cuda or getattr(torch.version, "hip", None)),
                    reason="a CUDA/ROCm build of torch imports triton for its kernels")
def test_cpu_torch_does_not_import_triton():
    """On a CPU-only torch no Triton kernel can run (they need a CUDA device or the interpreter), so the engine's
    modules leave triton unimported: it was 54 MB of the demo server's RSS."""
    assert fresh(SERVE_IMPORTS) == {"triton": False}


def test_interpreter_still_gets_triton():
    """TRITON_INTERPRET=1 (the tests' GPU stand-in) still defines the kernels, as before."""
    pytest.importorskip("triton")
    assert fresh(SERVE_IMPORTS, TRITON_INTERPRET="1") == {"triton": True}


TRIM = """
import ctypes, json, threading
from engine.tiers.ram import trim_heap
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) * 1024
def churn():        # a load's transients: 64 MB in 64 KB blocks (under malloc's mmap threshold), touched, freed
    blocks = [libc.malloc(65536) for _ in range(1024)]
    for b in blocks:
        ctypes.memset(b, 1, 65536)
    for b in blocks[:-1]:
        libc.free(b)        # the last stays: the arena's top is in use, so free() alone cannot shrink it
t = threading.Thread(target=churn); t.start(); t.join()
before = rss()
ran = trim_heap()
print(json.dumps({"ran": ran, "freed": before - rss()}))
"""


def test_trim_heap_returns_freed_transients():
    """What a load freed in a thread's malloc arena stays resident until trimmed: trim_heap hands it back."""
    if not (Path("/proc/self/status").exists() and hasattr(__import__("ctypes").CDLL(None), "malloc_trim")):
        pytest.skip("needs Linux with glibc's malloc_trim")
    out = fresh(TRIM)
    assert out["ran"] is True
    assert out["freed"] > 48 << 20, out
