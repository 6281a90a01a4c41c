"""A paused request (backpressure: its client stopped reading) shows as ``paused``, with the
seconds since, in ``GET /v1/requests`` and in ``/metrics`` (issue 34).

The client is the backpressure tests' stopped reader (its ``send`` never returns again, as
a full socket's). Waits are polls; no bound on time but the generous poll deadline.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from tests.server.test_backpressure import GREEDY, StoppedReader, tiny_app, until

BUFFER = 8
STALL_S = 60.0  # the test ends the request itself; the stall timeout must not


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


@pytest.mark.anyio
async def test_a_request_whose_client_stopped_reading_is_listed_and_counted_as_paused():
    async with tiny_app(stream_buffer_tokens=BUFFER, stream_stall_timeout=STALL_S) as (app, client):
        reader = StoppedReader(app, "/v1/chat/completions",
                               {"messages": [{"role": "user", "content": "go"}], "stream": True, "logprobs": True,
                                "max_tokens": 400, **GREEDY}, reads=4)
        await asyncio.wait_for(reader.stopped.wait(), 30)
        request_id = reader.chunks[0]["id"]

        async def entry() -> dict:
            (found,) = [e for e in (await client.get("/v1/requests")).json()["data"] if e["id"] == request_id]
            return found

        async def is_paused() -> bool:
            return (await entry())["status"] == "paused"

        await until(is_paused)
        first = await entry()
        assert first["paused_s"] is not None and first["paused_s"] >= 0
        await until(lambda: _later(entry, first["paused_s"]))  # the pause's age grows while it lasts

        metrics = (await client.get("/metrics")).text
        assert _metric(metrics, "bargein_requests_paused") == 1
        assert _metric(metrics, "bargein_requests_running") == 0  # a paused request is not counted running
        assert _metric(metrics, "bargein_requests_paused_longest_seconds") >= first["paused_s"]

        r = await client.post(f"/v1/requests/{request_id}/cancel")
        assert r.json()["status"] == "cancelled"

        async def gone() -> bool:
            return (await client.get("/v1/requests")).json()["data"] == []

        await until(gone)
        metrics = (await client.get("/metrics")).text
        assert _metric(metrics, "bargein_requests_paused") == 0
        assert _metric(metrics, "bargein_requests_paused_longest_seconds") == 0
        reader.task.cancel()  # its final chunk waits in a send that never returns
        await asyncio.gather(reader.task, return_exceptions=True)


async def _later(entry, than: float) -> bool:
    return (await entry())["paused_s"] > than
