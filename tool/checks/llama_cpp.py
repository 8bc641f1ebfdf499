"""llama.cpp's llama-server as a child process on a free loopback port: the speed gate's `--baseline llama.cpp`,
and the real peer server the tests and bench/check_llama_server.py run `tool check` against.

scripts/build-llama-cpp.sh builds the binary into .kiln/cache/llama.cpp/bin/.
"""
from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import requests

DEFAULT_BIN = ".kiln/cache/llama.cpp/bin/llama-server"


class LlamaServerError(Exception):
    """It would not start or become healthy; the message says why, with its last log lines."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_args(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """Arguments this host needs. Where the CPU advertises AMX, llama.cpp's native build computes the weights
    it repacks for AMX with tile instructions, and on the Xeon VMs here that faults (seen 2026-12-01: SIGSEGV
    in ggml_backend_amx_mul_mat at the first decode, though arch_prctl granted the tile state). --no-repack
    keeps the weights as loaded, computed by the AVX-512/AVX2 kernels; hosts without AMX keep repacking."""
    try:
        with open(cpuinfo) as f:
            flags = next((l.split(":", 1)[1].split() for l in f if l.startswith("flags")), [])
    except OSError:
        return []
    return ["--no-repack"] if "amx_tile" in flags else []


def version(exe: str | os.PathLike) -> str | None:
    """`llama-server --version`'s "version: N (commit)" line."""
    try:
        out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return next((l.strip() for l in (out.stdout + out.stderr).splitlines() if l.startswith("version")), None)


class LlamaServerProcess:
    """llama-server -m GGUF on 127.0.0.1:<free port>. Without alias its /v1/models lists the -m path as given,
    as a user's plain `llama-server -m FILE` does. One slot (--parallel 1): the gates time one stream."""

    def __init__(self, exe: str | os.PathLike, gguf: str | os.PathLike, *, ctx: int = 8192,
                 alias: str | None = None, threads: int | None = None, cwd: str | os.PathLike | None = None,
                 extra: tuple[str, ...] = ()):
        self.exe, self.port, self.cwd = str(exe), free_port(), cwd
        self.argv = [self.exe, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port), "-c", str(ctx),
                     "--parallel", "1", "--no-webui", *host_args()]
        if alias:
            self.argv += ["--alias", alias]
        if threads:
            self.argv += ["--threads", str(threads)]
        self.argv += list(extra)             # a bench's own llama-server options (e.g. the KV cache's type)
        fd, name = tempfile.mkstemp(prefix="kiln-llama-server-", suffix=".log")
        os.close(fd)
        self.log = Path(name)
        self.proc: subprocess.Popen | None = None
        self._out = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def log_tail(self, lines: int = 3) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def start(self, ready_timeout_s: float = 120.0) -> "LlamaServerProcess":
        """Start it and wait for /health 200 (the model loaded)."""
        self._out = open(self.log, "w")
        try:
            self.proc = subprocess.Popen(self.argv, stdout=self._out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=self.cwd)
        except OSError as e:
            self.stop()
            raise LlamaServerError(f"cannot start {self.exe}: {e.strerror or e}") from None
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if self.proc.poll() is not None:
                code, tail = self.proc.returncode, self.log_tail()
                self.stop()
                raise LlamaServerError(f"llama-server exited {code}: {tail}")
            try:
                if requests.get(f"http://127.0.0.1:{self.port}/health", timeout=5).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise LlamaServerError(f"llama-server was not healthy within {ready_timeout_s:g} s: {tail}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._out is not None:
            self._out.close()
            self._out = None

    def remove_log(self) -> None:
        self.log.unlink(missing_ok=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        self.remove_log()
