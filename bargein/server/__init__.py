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

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

# Imported on first use (PEP 562): the CLI reads bargein.server.settings for every command's
# --help, and that must not import the app (FastAPI, the engine, torch).
_EXPORTS = {"begin_shutdown": "bargein.server.app", "create_app": "bargein.server.app",
            "request_shutdown": "bargein.server.app",
            "ServerSettings": "bargein.server.settings", "SettingsError": "bargein.server.settings"}
__all__ = ["ServerSettings", "SettingsError", "begin_shutdown", "create_app", "request_shutdown"]

if TYPE_CHECKING:
    from bargein.server.app import begin_shutdown, create_app, request_shutdown
    from bargein.server.settings import ServerSettings, SettingsError


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'bargein.server' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
