"""OpenAI-compatible HTTP server on the engine (``vmkv serve``).

Modules: ``protocol`` (pydantic wire models), ``async_engine`` (one thread drives ``LLMEngine.step``),
``serving`` (request -> engine requests -> replies/SSE), ``errors`` (OpenAI error bodies), ``metrics``
(Prometheus), ``app`` (``build_app``), ``http_server`` (uvicorn with a header-read timeout and a
shutdown that answers what it cuts short), ``cli`` (``vmkv serve``).  Nothing here is imported by
``import vmkv``; the heavy imports happen in ``cli.run``.
"""
