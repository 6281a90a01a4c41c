"""Server-sent events, and a streaming response that always releases its job.

``EventStream`` is Starlette's StreamingResponse (which stops iterating when the client
disconnects) plus an ``on_close`` callback that runs however the response ends, even if
the client hung up before the body iterator ever started. The Ollama routes use it for
their NDJSON streams too (``media_type``). That callback aborts any of
the job's engine requests still running, so no disconnect leaves work behind.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def data_event(payload: Any) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def named_event(event: str, payload: Any) -> str:
    return f"event: {event}\n{data_event(payload)}"


class EventStream(StreamingResponse):
    def __init__(self, content: AsyncIterator[str], *, on_close: Callable[[], None],
                 headers: dict[str, str] | None = None, media_type: str = "text/event-stream"):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        super().__init__(content, media_type=media_type, headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
