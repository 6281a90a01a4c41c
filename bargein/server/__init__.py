"""The OpenAI-compatible HTTP server: ``create_app(engine, settings)`` and ``serve``.

Modules, one concern each: settings, schemas (request bodies), errors (the OpenAI
error shape), registry (requests in flight), generation (jobs: submit, stream, cancel on
disconnect), metrics, the routes (generate, responses, requests, ops), middleware (API
key, body limit), app (the factory and shutdown), serve (uvicorn with graceful signals).
"""

from bargein.server.app import begin_shutdown, create_app, request_shutdown
from bargein.server.settings import ServerSettings, SettingsError

__all__ = ["ServerSettings", "SettingsError", "begin_shutdown", "create_app", "request_shutdown"]
