"""Per-tenant numbers (issue 34), written as the attack: a tenant reads its own requests,
tokens, cancels, refusals and queue time in ``/metrics``, and no route shows it another
tenant's; an operator's key reads them all; labels come only from the keys file, bounded.

In process around the tiny engine (``test_tenant_limits``' helpers).
"""

from __future__ import annotations

import asyncio

import pytest

from bargein.server.metrics_tenants import OTHER_LABEL, TenantSeries
from bargein.server.tenants import TenantKey
from tests.server.inprocess_app import inprocess_app
from tests.server.test_tenant_limits import ALICE, BOB, PROMPT, auth, completion, hold, metric
from tests.server.tiny_live_server import api_routes
from tests.tiny_engine import tiny_engine

OPS = "ops-key-0123456789"
KEYS = (TenantKey(ALICE, "alice"), TenantKey(BOB, "bob"), TenantKey(OPS, "ops"))
TOKENS = "bargein_tenant_completion_tokens_total"


@pytest.mark.anyio
async def test_each_tenant_reads_its_own_numbers_and_no_route_shows_another_tenants():
    async with inprocess_app(tiny_engine(num_blocks=256), api_keys=KEYS, operator_tenants=("ops",),
                             max_in_flight_per_tenant=1, max_queued_per_tenant=0, stream_buffer_tokens=4,
                             stream_stall_timeout=120.0, debug_endpoints=True) as (app, client):
        assert (await completion(client, ALICE, "alice-1", max_tokens=3)).status_code == 200
        assert (await completion(client, BOB, "bob-1", max_tokens=5)).status_code == 200
        held = await hold(app, client, BOB, "bob-held")  # in flight: bob's next is refused
        assert (await completion(client, BOB, "bob-over")).status_code == 429

        # Bob, holding a live request, walks every GET route without path parameters:
        # nothing of alice's shows, neither her name nor her request's id.
        alice_live = await hold(app, client, ALICE, "alice-secret-request")
        paths = sorted({path for method, path in api_routes(app) if method == "GET" and "{" not in path})
        assert "/metrics" in paths and "/v1/requests" in paths
        for path in paths:
            text = (await client.get(path, headers=auth(BOB))).text
            assert "alice" not in text, (path, text[:500])

        alice = (await client.get("/metrics", headers=auth(ALICE))).text
        assert metric(alice, TOKENS, tenant="alice") == 3
        assert metric(alice, "bargein_tenant_prompt_tokens_total", tenant="alice") == len(PROMPT)
        assert metric(alice, "bargein_tenant_requests_total", tenant="alice") == 1
        assert 'tenant="bob"' not in alice and 'tenant="ops"' not in alice

        await held.close(client, BOB)
        await _until_gone(client, BOB, "bob-held")
        bob = (await client.get("/metrics", headers=auth(BOB))).text
        assert metric(bob, "bargein_tenant_requests_total", tenant="bob") == 2
        assert metric(bob, "bargein_tenant_requests_cancelled_total", tenant="bob") == 1
        assert metric(bob, "bargein_tenant_requests_rejected_total", tenant="bob",
                      reason="tenant_in_flight_limit") == 1
        assert metric(bob, "bargein_tenant_queue_seconds_count", tenant="bob") == 2  # bob-1 and bob-held
        assert 'tenant="alice"' not in bob

        ops = (await client.get("/metrics", headers=auth(OPS))).text
        assert metric(ops, TOKENS, tenant="alice") == 3 and metric(ops, TOKENS, tenant="bob") is not None
        await alice_live.close(client, ALICE)


@pytest.mark.anyio
async def test_beyond_the_series_cap_tenants_share_other_and_read_no_per_tenant_series():
    async with inprocess_app(tiny_engine(), api_keys=KEYS[:2], max_tenant_series=1) as (_, client):
        for key in (ALICE, BOB):
            assert (await completion(client, key, f"{key[:5]}-1", max_tokens=2)).status_code == 200
        assert (await client.get("/metrics", headers=auth("not-a-key-at-all"))).status_code == 401
        alice = (await client.get("/metrics", headers=auth(ALICE))).text
        assert metric(alice, TOKENS, tenant="alice") == 2
        bob = (await client.get("/metrics", headers=auth(BOB))).text
        assert "bargein_tenant_" in bob and 'tenant="' not in bob  # the families, none of their samples
        assert 'tenant="bob"' not in alice and f'tenant="{OTHER_LABEL}"' not in alice


@pytest.mark.anyio
async def test_a_server_without_keys_has_one_anonymous_series():
    async with inprocess_app(tiny_engine()) as (_, client):
        r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200
        text = (await client.get("/metrics")).text
        assert metric(text, TOKENS, tenant="_anonymous") == r.json()["usage"]["completion_tokens"]


def test_labels_are_bounded_by_the_cap_whatever_names_come():
    series = TenantSeries([f"t{i:03d}" for i in range(100)], max_series=5)
    for i in range(100):
        series.finished(f"t{i:03d}", "stop", 1, 1)
    series.finished("never-in-the-keys-file", "stop", 1, 1)
    assert set(series.requests) == {"t000", "t001", "t002", "t003", "t004", OTHER_LABEL}
    assert series.requests[OTHER_LABEL] == 96


async def _until_gone(client, key: str, request_id: str) -> None:
    for _ in range(3000):
        data = (await client.get("/v1/requests", headers=auth(key))).json()["data"]
        if all(e["id"] != request_id for e in data):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{request_id} still live")
