"""scripts/build-llama-cpp.sh's arguments, and that a built tree is found again at once (a key that moved would
rebuild llama.cpp for ten minutes in every clone: `make test` runs the script before the suite)."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "build-llama-cpp.sh"


def run(*args, env=None, timeout=30) -> subprocess.CompletedProcess:
    """The script in its own process group, all of it ended if it overruns (a build it started must not outlive us)."""
    proc = subprocess.Popen(["bash", str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate()
        pytest.fail(f"build-llama-cpp.sh {' '.join(args)} still running after {timeout} s: {err[-500:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("args, env, code, message", [
    (["--bogus"], {}, 2, "unknown argument '--bogus' (the only one is --server-dl)"),
    (["--server-dl", "extra"], {}, 2, "unexpected arguments: extra"),
    (["--server-dl"], {"PEER": "/nonexistent/llama-bin.tar.xz"}, 3,
     "--server-dl needs the peer build's tarball: /nonexistent/llama-bin.tar.xz is not a file"),
    (["--server-dl"], {"GGML_NATIVE": "ON"}, 2, "--server-dl builds with GGML_NATIVE=OFF only"),
])
def test_bad_arguments_get_one_line(args, env, code, message):
    r = run(*args, env=env)
    assert (r.returncode, r.stdout) == (code, "") and message in r.stderr


def test_a_built_tree_is_found_again_without_building():
    dest = REPO / ".kiln" / "cache" / "llama.cpp"
    if not (dest / ".kiln-stamp").is_file():
        pytest.skip("no CPU build yet: `make test` builds it before the suite (scripts/build-llama-cpp.sh)")
    r = run(timeout=20)                         # a rebuild would take minutes, far past the timeout
    assert (r.returncode, r.stdout.strip(), r.stderr) == (0, ".kiln/cache/llama.cpp", "")
