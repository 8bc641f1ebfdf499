"""The speed gate's decode baseline: a reference implementation timed in the same run, the same way.

Two kinds, both opened once per speed gate and timed in rounds interleaved with the server's:
- the recipe's (checks.decode_baseline; native recipes: the engine program's `reference-decode`,
  transformers' own generate): nix/lib compiles it into the plan as steps.check.baseline
  {argv, env, label, timeoutSeconds} with Kiln's paths substituted. Each round appends the prompt, token
  count and temperature the server was just timed on, runs the command while the server idles, and reads
  one JSON object holding decode_tps from the last line of its stdout;
- llama.cpp (`tool check --baseline llama.cpp`): its own llama-server on the recipe's GGUF, started on
  a free loopback port, streamed and timed by the very client code that times the server under test.

A baseline that cannot run on this machine (its program, its weights or a dependency is missing, or its
plan cannot be compiled here) raises BaselineUnavailable: the gate reports it "not run" and judges the
floor alone. One that runs and gives no figure raises BaselineError: the gate fails, saying why.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from tool.checks.stream_timing import time_stream
from tool.errors import last_line
from tool.checks.client import Client, ClientError
from tool.checks.llama_cpp import LlamaServerError, LlamaServerProcess, version
from tool.plan import compile_plan, plan_options
from tool.programs import child_env
from tool.state import Dirs

# engine's exit codes for "not here": 3 bad/missing model/checkpoint/store, 4 missing dependency
_NOT_HERE_EXITS = {3: "its model is not on this machine", 4: "a dependency is missing here"}


class BaselineError(Exception):
    """The baseline ran but gave no figure; the message is the gate's one-line reason."""


class BaselineUnavailable(BaselineError):
    """The baseline cannot run on this machine; the gate reports it as not run."""


def from_plan(plan: dict) -> dict | None:
    return ((plan.get("steps") or {}).get("check") or {}).get("baseline")


def resolve(recipe, dirs=None) -> dict | None:
    """The recipe's baseline, compiled by nix/lib for these directories (tool check: from KILN_* / the
    defaults, as the check unit's environment sets them). None when the recipe names none."""
    if not (recipe.get("checks") or {}).get("decode_baseline"):
        return None
    return from_plan(compile_plan(recipe, plan_options(dirs or Dirs.resolve())))


def label_of(baseline: dict) -> str:
    return baseline.get("label") or os.path.basename((baseline.get("argv") or ["the baseline"])[0])


def open_baseline(baseline: dict, served_name: str, context: int, client_timeout_s: float = 600.0):
    """→ an object with .label, .describe() and .measure(messages, tokens, sampling) → {decode_tps, ...},
    to be closed. Raises BaselineUnavailable / BaselineError when it cannot start."""
    if "unavailable" in baseline:
        raise BaselineUnavailable(baseline["unavailable"])
    if "error" in baseline:                  # it could not be resolved (tool check says why)
        raise BaselineError(baseline["error"])
    if baseline.get("kind") == "llama.cpp":
        return LlamaCppBaseline(baseline, served_name, context, client_timeout_s)
    return CommandBaseline(baseline)


class CommandBaseline:
    """The recipe's reference command, run once per round."""

    def __init__(self, baseline: dict):
        self.spec, self.label = baseline, label_of(baseline)

    def describe(self) -> dict:
        return {"kind": "command", "label": self.label, "argv": list(self.spec["argv"])}

    def measure(self, messages: list[dict], tokens: int, sampling: dict) -> dict:
        argv = [*self.spec["argv"], "--messages", json.dumps(messages), "--tokens", str(tokens),
                "--temperature", str(float(sampling.get("temperature", 0.0)))]
        env = child_env(self.spec.get("env"))
        timeout = float(self.spec.get("timeoutSeconds") or 600)
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                                 stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise BaselineUnavailable(f"{argv[0]}: not found on this machine") from None
        except subprocess.TimeoutExpired:
            raise BaselineError(f"gave no figure within {timeout:g} s") from None
        if out.returncode:
            why = last_line(out.stderr if out.stderr.strip() else out.stdout)
            if out.returncode in _NOT_HERE_EXITS:
                raise BaselineUnavailable(f"{_NOT_HERE_EXITS[out.returncode]} (exit {out.returncode}: {why})")
            raise BaselineError(f"exit {out.returncode}: {why}")
        try:
            result = json.loads(out.stdout.strip().splitlines()[-1])
            tps = float(result["decode_tps"])
        except (IndexError, ValueError, KeyError, TypeError):
            raise BaselineError(f"no JSON line with decode_tps on its stdout (last line: {last_line(out.stdout)!r})") from None
        if not tps > 0:
            raise BaselineError(f"decode_tps {tps} is not a rate")
        result.pop("token_ids", None)        # hundreds of ids per round; the rate and count are the evidence
        return {**result, "decode_tps": tps, "tokens": int(result.get("tokens", tokens))}

    def close(self) -> None:
        pass


def llama_cpp_spec(server_bin: str | os.PathLike | None, gguf: str | os.PathLike | None,
                   threads: int | None = None) -> dict:
    """The --baseline llama.cpp spec, or {"unavailable": why} when this machine lacks its parts."""
    exe = Path(server_bin) if server_bin else None
    if exe is None or not (exe.is_file() and os.access(exe, os.X_OK)):
        found = shutil.which("llama-server")
        if exe is None and found:
            exe = Path(found)
        else:
            return {"unavailable": f"llama.cpp: no llama-server at {exe or 'the default path'} "
                                   f"(scripts/build-llama-cpp.sh builds one)"}
    if gguf is None:
        return {"unavailable": "llama.cpp: the recipe's weights are not a GGUF file here (--baseline-gguf names one)"}
    if not Path(gguf).is_file():
        return {"unavailable": f"llama.cpp: {gguf}: no such GGUF file on this machine"}
    return {"kind": "llama.cpp", "server": str(exe), "gguf": str(gguf), "threads": threads,
            "label": f"llama.cpp llama-server on {Path(gguf).name}"}


class LlamaCppBaseline:
    """llama.cpp's llama-server on the same weights, started once, timed per round like the server."""

    def __init__(self, spec: dict, served_name: str, context: int, client_timeout_s: float):
        self.spec, self.label, self.name = spec, spec["label"], served_name
        self._ClientError = ClientError
        self.server = LlamaServerProcess(spec["server"], spec["gguf"], ctx=context, alias=served_name,
                                         threads=spec.get("threads"))
        self.argv = self.server.argv
        try:
            self.server.start()
        except LlamaServerError as e:
            self.server.remove_log()
            raise BaselineError(f"llama.cpp: {e}") from None
        self.client = Client(self.server.url, timeout_s=client_timeout_s)
        self.version = version(spec["server"])
        try:                                     # untimed, as the server under test got one
            self.client.chat({"model": served_name, "max_tokens": 8, "temperature": 0.0,
                              "messages": [{"role": "user", "content": "Hi"}]})
        except ClientError as e:
            self.close()
            raise BaselineError(f"llama.cpp: {e}") from None

    def describe(self) -> dict:
        return {"kind": "llama.cpp", "label": self.label, "argv": self.argv, "version": self.version}

    def measure(self, messages: list[dict], tokens: int, sampling: dict) -> dict:
        body = {"model": self.name, "messages": messages, "max_tokens": tokens, **sampling,
                "ignore_eos": True,               # exactly `tokens`, as the server was timed on
                "stream_options": {"include_usage": True}}
        try:
            a = self.client.stream_chat(body)
        except self._ClientError as e:
            raise BaselineError(f"llama.cpp: {e}") from None
        timed = time_stream(a)
        if timed is None:
            raise BaselineError(f"llama.cpp streamed too little to time ({a.chunks} chunks)")
        tps, n = timed
        return {"decode_tps": tps, "tokens": n, "tokens_source": "usage.completion_tokens",
                "prompt_tokens": (a.usage or {}).get("prompt_tokens"), "ttft_s": a.ttft_s}

    def close(self) -> None:
        self.client.close()
        self.server.stop()
        self.server.remove_log()
