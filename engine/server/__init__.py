"""The engine's OpenAI-compatible HTTP server.

    app.py         create_app: the FastAPI app put together from the parts below
    endpoints.py   the endpoints over one ServerState (models, tokenize, chat, completions, health, metrics)
    streaming.py   server-sent events: chunks under an answer's head, error events, [DONE]
    errors.py      ApiError and the handlers that give every error OpenAI's shape
    middleware.py  request ids and the catch-all 500, the API key, the body limit
    load_state.py  the engine behind the server: loading, ready, failed or draining
    generation.py  one generation: LLM.stream in its own thread → text, stop strings, cancellation
    parsers.py     reasoning split at </think>, GLM and Hermes tool calls, stop strings (streaming)
    chat.py        messages + tools → prompt through the model's chat template
    detok.py       token ids → text, incrementally
    logprobs.py    the engine's token logprobs in chat's and completions' shapes (token text and bytes)
    schemas.py     request bodies, validated
    metrics.py     Prometheus metrics on a private registry
"""
