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


def test_the_server_dl_build_runs_beside_the_peers_libraries(tmp_path):
    """--server-dl's tarball unpacked over the CUDA peer's: llama-server resolves the peer's libllama/libggml (not
    copies of its own), loads a CPU backend variant from the peer's folder at run time, and serves the demo's GGUF."""
    import requests

    from tests.fixtures.llama_server import LlamaServer
    from tests.fixtures.shared_nixpkgs import shared_nixpkgs

    shared = (shared_nixpkgs() or REPO.parent / "shared" / "nixpkgs").parent
    peer = shared / "peers" / "llama.cpp-cuda-sm90" / "llama-bin.tar.xz"
    ours = REPO / ".kiln" / "cache" / "llama-server-dl" / "llama-server-dl.tar.xz"
    gguf = REPO / ".kiln" / "cache" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    for need, how in ((peer, "../shared/peers"), (ours, "scripts/build-llama-cpp.sh --server-dl"), (gguf, "make test")):
        if not need.is_file():
            pytest.skip(f"{need} is missing ({how})")
    for tarball in (peer, ours):
        subprocess.run(["tar", "-xJf", str(tarball), "-C", str(tmp_path)], check=True)
    exe = tmp_path / "llama-server"
    ldd = subprocess.run(["ldd", str(exe)], capture_output=True, text=True, check=True, env={}).stdout
    resolved = {line.split()[0]: line.split()[2] for line in ldd.splitlines() if "=>" in line and len(line.split()) > 2}
    for lib in ("libllama.so.0", "libllama-common.so.0", "libggml.so.0", "libggml-base.so.0", "libmtmd.so.0",
                "libllama-server-impl.so"):
        assert resolved.get(lib) == str(tmp_path / lib), (lib, ldd)
    with LlamaServer(gguf, exe=exe, ctx=512) as server:
        r = requests.post(f"{server.url}/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0},
                          timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        # the backend it loaded at run time, from the peer's folder (its log does not name it at default verbosity)
        mapped = {line.split()[-1] for line in Path(f"/proc/{server.proc.pid}/maps").read_text().splitlines()
                  if "libggml-cpu-" in line}
        assert mapped and all(m.startswith(f"{tmp_path}/libggml-cpu-") for m in mapped), mapped
