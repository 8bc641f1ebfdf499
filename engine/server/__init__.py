"""The engine's OpenAI-compatible HTTP server.

    app.py         the FastAPI app: endpoints, errors in OpenAI's shape, loading state, API key
    generation.py  one generation: LLM.stream in its own thread → text, stop strings, cancellation
    parsers.py     reasoning split at </think>, GLM and Hermes tool calls, stop strings (streaming)
    chat.py        messages + tools → prompt through the model's chat template
    detok.py       token ids → text, incrementally
    schemas.py     request bodies, validated
    metrics.py     Prometheus metrics on a private registry
    cli.py         `engine serve`
"""
