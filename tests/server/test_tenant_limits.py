"""Per-tenant limits on requests in flight and queued (issue 34), written as the attack: one
API key sends more than its share; its requests beyond its limit in flight wait in its own
queue, beyond that are refused (429, ``Retry-After``, the limit named), and another
tenant is served meanwhile. A queued request runs when the tenant's slot frees, to the
same tokens as the reference; cancelled while queued, it ends without ever running.

In process (``inprocess_app``) around the tiny engine. A request stays in flight
deterministically: its client stops reading a stream (backpressure pauses it) until the
test cancels it. Waits are polls.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from bargein.server.tenant_gate import TenantGate, TenantLimits
from bargein.server.tenants import TenantKey
from tests.server.inprocess_app import inprocess_app
from tests.tiny_engine import reference_greedy, tiny_engine

ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789"
KEYS = (TenantKey(ALICE, "alice"), TenantKey(BOB, "bob"))
GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPT = [5, 17, 42, 99, 3, 250, 7]


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@asynccontextmanager
async def app_with_keys(**settings: Any) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    async with inprocess_app(tiny_engine(num_blocks=256), api_keys=KEYS, stream_buffer_tokens=4,
                             stream_stall_timeout=120.0, **settings) as (app, client):
        yield app, client


class HeldStream:
    """A streamed completion whose client reads one body message, then stops reading
    without disconnecting: the request stays live (paused) until it is cancelled."""

    def __init__(self, app: Any, key: str, request_id: str):
        self.request_id = request_id
        self.read = asyncio.Event()
        payload = json.dumps({"prompt": PROMPT, "max_tokens": 500, "stream": True, **GREEDY}).encode()
        headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                   (b"authorization", f"Bearer {key}".encode()), (b"x-request-id", request_id.encode()),
                   (b"content-length", str(len(payload)).encode())]
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "client": ("127.0.0.1", 50000),
                 "server": ("127.0.0.1", 80), "headers": headers}
        messages = [{"type": "http.request", "body": payload, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                self.read.set()
                await asyncio.Event().wait()  # a full socket

        self.task = asyncio.ensure_future(app(scope, receive, send))

    async def close(self, client: httpx.AsyncClient, key: str) -> None:
        await client.post(f"/v1/requests/{self.request_id}/cancel", headers=auth(key))
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def listed(client: httpx.AsyncClient, key: str) -> dict[str, str]:
    return {e["id"]: e["status"] for e in (await client.get("/v1/requests", headers=auth(key))).json()["data"]}


async def until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def completion(client: httpx.AsyncClient, key: str, request_id: str, max_tokens: int = 4) -> asyncio.Task:
    return asyncio.ensure_future(client.post("/v1/completions", headers={**auth(key), "X-Request-Id": request_id},
                                             json={"prompt": PROMPT, "max_tokens": max_tokens,
                                                   "return_token_ids": True, **GREEDY}))


def metric(text: str, name: str, **labels: str) -> float | None:
    """The sample of ``name`` with exactly ``labels`` (in any order), or None."""
    for match in re.finditer(rf"^{name}{{(.*)}} (\S+)$", text, re.MULTILINE):
        if dict(re.findall(r'(\w+)="([^"]*)"', match.group(1))) == labels:
            return float(match.group(2))
    return None


async def hold(app: Any, client: httpx.AsyncClient, key: str, request_id: str) -> HeldStream:
    held = HeldStream(app, key, request_id)
    await asyncio.wait_for(held.read.wait(), 60)
    return held


@pytest.mark.anyio
async def test_beyond_its_limit_in_flight_a_tenant_queues_then_is_refused_naming_the_limit():
    async with app_with_keys(max_in_flight_per_tenant=2, max_queued_per_tenant=1) as (app, client):
        held = [await hold(app, client, ALICE, f"alice-held-{i}") for i in range(2)]

        async def both_in_the_engine() -> bool:  # not in alice's own queue: scheduled, maybe paused already
            statuses = await listed(client, ALICE)
            return len(statuses) == 2 and set(statuses.values()) <= {"running", "paused"}

        await until(both_in_the_engine)

        queued = completion(client, ALICE, "alice-queued")
        await until(lambda: _status_is(client, ALICE, "alice-queued", "queued"))

        over = await client.post("/v1/completions", headers=auth(ALICE), json={"prompt": PROMPT, "max_tokens": 2})
        assert over.status_code == 429, over.text
        error = over.json()["error"]
        assert error["code"] == "tenant_queue_limit" and over.headers["retry-after"] == "1"
        assert "--max-in-flight-per-tenant 2" in error["message"] and "--max-queued-per-tenant 1" in error["message"]

        # bob has his own line: served at once, to the reference's tokens
        bob = await completion(client, BOB, "bob-1")
        assert bob.status_code == 200, bob.text
        assert bob.json()["choices"][0]["token_ids"] == reference_greedy(PROMPT, 4)
        assert not queued.done()  # alice's still waits for her own slot

        await held[0].close(client, ALICE)
        answer = await asyncio.wait_for(queued, 60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["token_ids"] == reference_greedy(PROMPT, 4)

        metrics = (await client.get("/metrics", headers=auth(ALICE))).text
        assert metric(metrics, "bargein_tenant_requests_rejected_total", tenant="alice",
                      reason="tenant_queue_limit") == 1
        assert metric(metrics, "bargein_tenant_queue_seconds_count", tenant="alice") == 3  # two held, one queued
        await held[1].close(client, ALICE)
        await app.state.ctx.engine.check_block_accounting()


@pytest.mark.anyio
async def test_with_no_queue_the_in_flight_limit_is_the_one_named():
    async with app_with_keys(max_in_flight_per_tenant=1, max_queued_per_tenant=0) as (app, client):
        held = await hold(app, client, ALICE, "alice-held")
        over = await client.post("/v1/completions", headers=auth(ALICE), json={"prompt": PROMPT, "max_tokens": 2})
        assert over.status_code == 429 and over.json()["error"]["code"] == "tenant_in_flight_limit", over.text
        assert over.headers["retry-after"] == "1"
        assert "--max-in-flight-per-tenant 1" in over.json()["error"]["message"]
        assert (await client.post("/v1/completions", headers=auth(BOB),
                                  json={"prompt": PROMPT, "max_tokens": 2})).status_code == 200
        await held.close(client, ALICE)


@pytest.mark.anyio
async def test_a_request_cancelled_while_queued_ends_without_running_and_frees_its_place():
    async with app_with_keys(max_in_flight_per_tenant=1, max_queued_per_tenant=1) as (app, client):
        engine = app.state.ctx.engine
        held = await hold(app, client, ALICE, "alice-held")
        queued = completion(client, ALICE, "alice-queued", max_tokens=50)
        await until(lambda: _status_is(client, ALICE, "alice-queued", "queued"))
        assert "alice-queued" not in await listed(client, BOB)  # another tenant does not see it
        assert (await client.post("/v1/requests/alice-queued/cancel", headers=auth(BOB))).status_code == 404

        r = await client.post("/v1/requests/alice-queued/cancel", headers=auth(ALICE))
        assert r.json()["status"] == "cancelled"
        body = (await asyncio.wait_for(queued, 60)).json()
        assert body["choices"][0]["finish_reason"] == "cancelled" and body["usage"]["completion_tokens"] == 0
        assert "alice-queued#0" not in engine.live_request_ids()
        # its place in the queue is free again: the next one queues instead of a 429
        again = completion(client, ALICE, "alice-again")
        await until(lambda: _status_is(client, ALICE, "alice-again", "queued"))
        await held.close(client, ALICE)
        assert (await asyncio.wait_for(again, 60)).status_code == 200


@pytest.mark.anyio
async def test_a_queued_requests_deadline_counts_its_wait_in_the_tenants_queue():
    async with app_with_keys(max_in_flight_per_tenant=1, max_queued_per_tenant=1) as (app, client):
        held = await hold(app, client, ALICE, "alice-held")
        queued = asyncio.ensure_future(client.post(
            "/v1/completions", headers={**auth(ALICE), "X-Request-Id": "alice-late"},
            json={"prompt": PROMPT, "max_tokens": 50, "timeout": 0.2, **GREEDY}))
        await until(lambda: _status_is(client, ALICE, "alice-late", "queued"))
        await asyncio.sleep(0.3)  # past its deadline while it waits (no bound is asserted on time)
        await held.close(client, ALICE)
        body = (await asyncio.wait_for(queued, 60)).json()
        choice = body["choices"][0]
        assert choice["finish_reason"] == "cancelled" and body["usage"]["completion_tokens"] == 0, body
        stats = await app.state.ctx.engine.stats()
        assert stats.cancelled.get("deadline") is None  # ended in the queue: the engine never had it


def test_the_gate_admits_each_tenants_queue_in_order_and_forgets_empty_lines():
    gate = TenantGate(TenantLimits(max_in_flight=2, max_queued=2))
    assert [gate.enter("a", r) for r in ("a1", "a2", "a3", "a4")] == [True, True, False, False]
    assert gate.enter("b", "b1") is True
    with pytest.raises(Exception) as refused:
        gate.enter("a", "a5")
    assert refused.value.status == 429 and refused.value.code == "tenant_queue_limit"
    assert gate.leave("a", "a4") == []  # gave up while queued
    assert gate.leave("a", "a1") == ["a3"]
    assert (gate.in_flight("a"), gate.queued("a")) == (2, 0)
    assert gate.leave("a", "a2") == [] and gate.leave("a", "a3") == []
    assert gate.leave("b", "b1") == []
    assert gate._lines == {}
    assert TenantGate(TenantLimits()).enter("a", "x") is True  # no limits: always in flight


async def _status_is(client: httpx.AsyncClient, key: str, request_id: str, status: str) -> bool:
    return (await listed(client, key)).get(request_id) == status


def test_the_serve_flags_set_the_limits_and_refuse_what_cannot_work(tmp_path):
    import argparse

    from bargein.cli.serve import _access_settings, _add_serve_arguments
    from bargein.server.settings import ServerSettings, SettingsError

    keys = tmp_path / "keys"
    keys.write_text(f"{ALICE} alice\n{BOB} bob\n")

    def settings(*flags: str) -> ServerSettings:
        parser = argparse.ArgumentParser()
        _add_serve_arguments(parser)
        return ServerSettings(**_access_settings(parser.parse_args(["--api-keys", str(keys), *flags])))

    s = settings("--max-in-flight-per-tenant", "2", "--max-queued-per-tenant", "0", "--operator-tenants", "bob",
                 "--max-tenant-series", "5")
    assert (s.max_in_flight_per_tenant, s.max_queued_per_tenant, s.operator_tenants, s.max_tenant_series) == \
        (2, 0, ("bob",), 5)
    with pytest.raises(SettingsError, match="needs max in flight"):
        settings("--max-queued-per-tenant", "3")
    with pytest.raises(SettingsError, match="carol"):
        settings("--operator-tenants", "carol")
    with pytest.raises(SettingsError, match="at least 1"):
        settings("--max-in-flight-per-tenant", "0")
