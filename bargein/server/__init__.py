"""The OpenAI-compatible HTTP server: ``create_app(engine, settings)`` and ``serve``.

Modules, one concern each: settings, schemas (request bodies), validation (field checks
in one documented order), errors (the OpenAI error shape), registry (requests in flight
and their engine ids), generation (jobs: submit, merge outputs, cancel on disconnect),
prompts (rendering and tokenizing off the event loop, token-exact continuation) with
prompt_memory (recent answers' exact ids), serving (the one path from a validated
request to its answer), openai_stream (the one stream grammar and body shapes), metrics,
the routes (generate, responses, requests, ops), middleware (API key, body limit), app
(the factory and shutdown), serve (uvicorn with graceful signals).
"""

from bargein.server.app import begin_shutdown, create_app, request_shutdown
from bargein.server.settings import ServerSettings, SettingsError

__all__ = ["ServerSettings", "SettingsError", "begin_shutdown", "create_app", "request_shutdown"]
