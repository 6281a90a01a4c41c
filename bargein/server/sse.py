"""Server-sent events, and a streaming response that always releases its job.

``EventStream`` is Starlette's StreamingResponse (which stops iterating when the client
disconnects) plus an ``on_close`` callback that runs however the response ends, even if
the client hung up before the body iterator ever started. The Ollama routes use it for
their NDJSON streams too (``media_type``). That callback aborts any of
the job's engine requests still running, so no disconnect leaves work behind.

A client that stops reading makes the response's ``send`` wait (the server's flow
control). The job notices (its bounded buffer stays full, generation pauses) and after a
timeout sets ``stalled``: the response is then ended here without waiting for that send,
and ``on_close`` cancels the work with reason ``disconnect`` (``generation.py``).
"""

from __future__ import annotations

import asyncio
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
                 headers: dict[str, str] | None = None, media_type: str = "text/event-stream",
                 stalled: asyncio.Event | None = None):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        super().__init__(content, media_type=media_type, headers=headers)
        self._on_close = on_close
        self._stalled = stalled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if self._stalled is None:
                await super().__call__(scope, receive, send)
            else:
                await self._unless_stalled(super().__call__(scope, receive, send), self._stalled)
        finally:
            self._on_close()

    @staticmethod
    async def _unless_stalled(response: Any, stalled: asyncio.Event) -> None:
        """Runs the response; ends it early (cancelled mid-``send``) once ``stalled`` is set."""
        task = asyncio.ensure_future(response)
        watch = asyncio.ensure_future(stalled.wait())
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
