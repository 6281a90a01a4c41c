"""SSE keep-alives: a comment on a stream that has been quiet for a set interval.

A stream's first token can take long: a long prompt read in chunks under a small step
budget, a request held while its K/V is read back from the disk tier, a full queue.
Proxies (nginx's ``proxy_read_timeout`` is 60 s) and clients (the ``openai`` client's
read timeout) drop a connection that sends nothing for a while, and a client that gives
up and retries starts the prefill again (the llama.cpp#22160 loop). So whenever a stream
has sent nothing for ``interval_s``, it sends an SSE comment, which every SSE client
ignores by the specification::

    : keep-alive prompt 512/2048

with each of the job's requests' prompt progress (tokens with K/V computed, prefix hits
and disk reads included, over prompt tokens: what ``GET /v1/requests`` lists) while the
engine still reads a prompt, or a bare ``: keep-alive`` otherwise. The progress is asked
of the engine (``EngineClient.requests``) at most once per keep-alive and is waited for at
most ``interval_s / 2``: a keep-alive is never held up by a busy engine.

``with_keepalives`` wraps a stream's events without touching them: the events come out
exactly as they went in, in order, with comments only between them. Waiting for the next
event with a timeout must not cancel it (that would lose an output), so the read in
progress is one task, kept across keep-alives and cancelled only when the stream closes
(a disconnect), which then ends the inner stream exactly as if it had been read directly.
Streams of other media types (Ollama's NDJSON) have no comments and are not wrapped.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence

from bargein.engine.client import EngineClient
from bargein.engine.stats import RequestInfo

KEEPALIVE = ": keep-alive"

ProgressFn = Callable[[], Awaitable[str | None]]


def keepalive_comment(progress: str | None = None) -> str:
    """One SSE comment event: ``: keep-alive`` and, if given, the progress text after it."""
    return f"{KEEPALIVE} {progress}\n\n" if progress else f"{KEEPALIVE}\n\n"


def prompt_progress_text(infos: Sequence[RequestInfo], engine_ids: Sequence[str]) -> str | None:
    """``prompt <computed>/<tokens>`` per request of ``engine_ids`` (in that order) that is
    still reading its prompt; None when none is (answering, finished or not in the engine)."""
    by_id = {info.request_id: info for info in infos}
    parts = [f"{info.prompt_computed}/{info.prompt_tokens}" for rid in engine_ids
             if (info := by_id.get(rid)) is not None and info.prompt_computed < info.prompt_tokens]
    return "prompt " + " ".join(parts) if parts else None


def job_prompt_progress(engine: EngineClient, engine_ids: Sequence[str]) -> ProgressFn:
    """A ``ProgressFn`` over the engine's request list for these requests."""
    async def progress() -> str | None:
        return prompt_progress_text(await engine.requests(), engine_ids)

    return progress


async def with_keepalives(events: AsyncGenerator[str, None], interval_s: float,
                          progress: ProgressFn | None = None) -> AsyncIterator[str]:
    """``events`` unchanged, with a keep-alive comment after every ``interval_s`` seconds
    in which none came (see the module docstring). ``interval_s`` must be positive."""
    if not interval_s > 0:
        raise ValueError(f"the keep-alive interval must be positive, got {interval_s}")
    reading: asyncio.Future[str] | None = None
    try:
        while True:
            if reading is None:
                reading = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({reading}, timeout=interval_s)
            if not done:
                yield keepalive_comment(await _progress_or_none(progress, interval_s / 2))
                continue
            try:
                event = reading.result()
            except StopAsyncIteration:
                return
            finally:
                reading = None
            yield event
    finally:
        if reading is not None:  # the stream closed mid-read (a disconnect): end the read first
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
        await events.aclose()


async def _progress_or_none(progress: ProgressFn | None, timeout_s: float) -> str | None:
    """The progress text, or None if there is none, it takes over ``timeout_s`` or fails
    (a keep-alive goes out regardless)."""
    if progress is None:
        return None
    try:
        return await asyncio.wait_for(progress(), timeout_s)
    except Exception:  # a keep-alive must never end the stream it keeps alive
        return None
