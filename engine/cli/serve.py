"""`engine serve`: listen at once, load the model in the background, serve the OpenAI API."""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import socket
import threading
from pathlib import Path

import click

from engine.cli import options
from engine.errors import EngineError, Exit
from engine.gguf_model import GgufModel, is_gguf
from engine.store import manifest, model_manifest, odirect


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so a port in use is one line, not a uvicorn traceback."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
        raise EngineError(f"{host}:{port} {why}", Exit.ADDRESS) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def fingerprint_of(model_dir: Path) -> str:
    """What identifies the weights served: the checkpoint's config (system_fingerprint derives from it)."""
    return hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()


def checkpoint_fingerprint(model_dir: Path) -> str:
    """A checkpoint directory's fingerprint, its config.json read and parsed first (exit 3 when it is none)."""
    if not model_dir.is_dir():
        raise EngineError(f"{model_dir}: no such model directory", Exit.BAD_MODEL)
    try:
        fp = fingerprint_of(model_dir)
        json.loads((model_dir / "config.json").read_text())
    except FileNotFoundError:
        raise EngineError(f"{model_dir}: no config.json (not a Hugging Face checkpoint)", Exit.BAD_MODEL) from None
    except (OSError, ValueError) as e:
        raise EngineError(f"{model_dir / 'config.json'}: unreadable ({e})", Exit.BAD_MODEL) from None
    return fp


def gguf_fingerprint(path: Path) -> str:
    """A GGUF's fingerprint (the config its metadata makes), the file opened and checked whole first: a bad file
    is one line and exit 3 before the server listens."""
    return GgufModel(path).config_hash()


def api_key_of(flag: str | None) -> str | None:
    """The key to require, or None. An empty key is refused (exit 2), never taken to mean "no auth":
    click reads an empty KILN_API_KEY as unset, so the environment is looked at here."""
    env = os.environ.get("KILN_API_KEY")
    if flag is not None and not flag.strip() and flag != env:
        raise EngineError("--api-key is empty; give a key, or leave the flag out to serve without one", Exit.USAGE)
    if env is not None and not env.strip() and flag in (None, env):
        raise EngineError("KILN_API_KEY is set but empty; give a key, or unset it to serve without one", Exit.USAGE)
    return flag


def drain_on_exit(server, engine, drain_seconds: float):
    """uvicorn's SIGTERM/SIGINT handler, extended: stop listening at once (uvicorn's part), let running
    streams go on for drain_seconds, then end them with an error event and [DONE] so no client sees a cut
    connection; uvicorn's graceful shutdown then finds them finished."""
    plain = server.handle_exit

    def handle_exit(sig, frame):
        if not engine.draining:
            engine.draining = True                          # new requests: 503
            timer = threading.Timer(drain_seconds, engine.drain)
            timer.daemon = True                             # never what keeps the process alive
            timer.start()
        plain(sig, frame)
    server.handle_exit = handle_exit


def log_engine(level: str) -> None:
    """The engine's own log lines (the expert placement, the tiers' sizes and plan, what a GGUF's matrices became)
    to stderr beside uvicorn's, at --log-level: uvicorn configures only its own loggers, and Python's last-resort
    handler would drop everything below a warning."""
    log = logging.getLogger("engine")
    if not any(getattr(h, "kiln_serve", False) for h in log.handlers):
        handler = logging.StreamHandler()
        handler.kiln_serve = True
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
        log.addHandler(handler)
    log.setLevel(level.upper())


@click.command(epilog="Exit codes: 2 usage (e.g. a bad --cpu-layout, an empty --api-key), 3 the model directory is missing or not a checkpoint, or the GGUF is not a model Kiln serves (named: truncated, a type or architecture Kiln lacks, a shape against its metadata, a split part missing, no tokenizer), 6 the store's "
                      "filesystem refuses O_DIRECT, 7 the address is in use or cannot be bound, 8 a converted model's "
                      "files (kiln-files.json) or the store's manifest fail their check. "
                      "/health answers 503 while the model loads, 500 with the reason if loading failed.")
@click.option("--model", "model_dir", required=True, type=click.Path(path_type=Path),
              help="Hugging Face checkpoint directory (config.json, safetensors, tokenizer, chat template), or a GGUF "
                   "file (or the first part of a split set) holding all of them.")
@click.option("--store", "store_dir", type=click.Path(path_type=Path), default=None,
              help="Packed expert store (engine pack-store); without it the experts are read from the checkpoint.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback unless told).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@options.device
@options.dtype
@click.option("--served-name", default=None,
              help="Model name in the API (default: the model directory's name, or the GGUF file's without .gguf).")
@options.context
@options.max_batch
@options.chunk_size
@options.max_queue
@click.option("--max-body-bytes", type=click.IntRange(min=1024), default=8 * 1024 * 1024, show_default=True,
              help="Largest request body; a bigger one gets 413 before it is read.")
@click.option("--drain-seconds", type=click.FloatRange(min=0), default=3.0, show_default=True,
              help="On SIGTERM: how long running streams may go on before they end with an error event.")
@options.tiers
@click.option("--temperature", type=click.FloatRange(0.0, 2.0), default=None,
              help="Default temperature for requests that name none (default: the model's generation_config.json, else 1.0).")
@click.option("--top-p", "top_p", type=click.FloatRange(0.0, 1.0, min_open=True), default=None,
              help="Default top_p for requests that name none (default: generation_config.json, else 1.0).")
@click.option("--api-key", envvar="KILN_API_KEY", default=None,
              help="Require `Authorization: Bearer KEY` (env KILN_API_KEY); /health and /metrics stay open.")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]),
              default="info", show_default=True)
def serve(model_dir, store_dir, host, port, served_name, max_body_bytes, drain_seconds,
          temperature, top_p, api_key, log_level, **knobs):
    """Serve a model over an OpenAI-compatible HTTP API.

    Listens at once and loads the model in the background. Endpoints: /v1/models,
    /v1/chat/completions, /v1/completions, /tokenize, /health, /metrics.
    """
    api_key = api_key_of(api_key)
    if is_gguf(model_dir):
        fp = gguf_fingerprint(model_dir)            # every check of the file, before listening (exit 3)
    else:
        fp = checkpoint_fingerprint(model_dir)
    config = options.engine_config(**knobs)     # a bad knob is a usage error now, not a failed load later
    if not is_gguf(model_dir):
        model_manifest.check_for_serving(model_dir)     # files there at their sizes, nothing extra (exit 8)
    if store_dir is not None:
        odirect.probe(store_dir)        # EngineError (exit 6) with the reason when refused
        manifest.load(store_dir)        # its sha256, structure and size, before listening (exit 8)

    sock = bind(host, port)

    import uvicorn

    from engine.server.app import create_app                          # the server stack: once the checks passed
    from engine.server.endpoints import sampling_defaults

    def load():
        from engine.llm import LLM         # the model stack (triton on CUDA): in the loading thread, once listening
        return LLM.load(model_dir, store_dir, config)

    app = create_app(loader=load, served_name=served_name or model_dir.resolve().name.removesuffix(".gguf"),
                     api_key=api_key,
                     defaults=sampling_defaults(model_dir, temperature, top_p),
                     fingerprint=fp, max_body_bytes=max_body_bytes)
    bound = sock.getsockname()
    click.echo(f"engine: listening on http://{host}:{bound[1]} (model {model_dir} loading; /health says when ready)",
               err=True)
    log_engine(log_level)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=drain_seconds + 5))
    drain_on_exit(server, app.state.engine, drain_seconds)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
