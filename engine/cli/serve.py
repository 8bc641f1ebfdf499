"""`engine serve`: listen at once, load the model in the background, serve the OpenAI API."""
from __future__ import annotations

import errno
import hashlib
import json
import socket
from pathlib import Path

import click

from engine.cli import options
from engine.errors import EngineError, Exit


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


@click.command(epilog="Exit codes: 2 usage (e.g. a bad --cpu-layout), 3 the model directory is missing or not a checkpoint, 6 the store's "
                      "filesystem refuses O_DIRECT, 7 the address is in use or cannot be bound. "
                      "/health answers 503 while the model loads, 500 with the reason if loading failed.")
@click.option("--model", "model_dir", required=True, type=click.Path(path_type=Path),
              help="Hugging Face checkpoint directory (config.json, safetensors, tokenizer, chat template).")
@click.option("--store", "store_dir", type=click.Path(path_type=Path), default=None,
              help="Packed expert store (engine pack-store); without it the experts are read from the checkpoint.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback unless told).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@options.device
@options.dtype
@click.option("--served-name", default=None, help="Model name in the API (default: the model directory's name).")
@options.context
@options.max_batch
@options.tiers
@click.option("--temperature", type=click.FloatRange(0.0, 2.0), default=None,
              help="Default temperature for requests that name none (default: the model's generation_config.json, else 1.0).")
@click.option("--top-p", "top_p", type=click.FloatRange(0.0, 1.0, min_open=True), default=None,
              help="Default top_p for requests that name none (default: generation_config.json, else 1.0).")
@click.option("--api-key", envvar="KILN_API_KEY", default=None,
              help="Require `Authorization: Bearer KEY` (env KILN_API_KEY); /health and /metrics stay open.")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]),
              default="info", show_default=True)
def serve(model_dir, store_dir, host, port, served_name, temperature, top_p, api_key, log_level, **knobs):
    """Serve a model over an OpenAI-compatible HTTP API.

    Listens at once and loads the model in the background. Endpoints: /v1/models,
    /v1/chat/completions, /v1/completions, /tokenize, /health, /metrics.
    """
    if not model_dir.is_dir():
        raise EngineError(f"{model_dir}: no such model directory", Exit.BAD_MODEL)
    try:
        fp = fingerprint_of(model_dir)
        json.loads((model_dir / "config.json").read_text())
    except FileNotFoundError:
        raise EngineError(f"{model_dir}: no config.json (not a Hugging Face checkpoint)", Exit.BAD_MODEL) from None
    except (OSError, ValueError) as e:
        raise EngineError(f"{model_dir / 'config.json'}: unreadable ({e})", Exit.BAD_MODEL) from None
    config = options.engine_config(**knobs)     # a bad knob is a usage error now, not a failed load later
    if store_dir is not None:
        from engine.store import odirect
        odirect.probe(store_dir)        # EngineError (exit 6) with the reason when refused

    sock = bind(host, port)

    import uvicorn

    from engine.server.app import create_app

    def load():
        from engine.llm import LLM
        return LLM.load(model_dir, store_dir, config)

    from engine.server.app import sampling_defaults
    app = create_app(loader=load, served_name=served_name or model_dir.resolve().name, api_key=api_key,
                     defaults=sampling_defaults(model_dir, temperature, top_p),
                     fingerprint=fp)
    bound = sock.getsockname()
    click.echo(f"engine: listening on http://{host}:{bound[1]} (model {model_dir} loading; /health says when ready)",
               err=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
