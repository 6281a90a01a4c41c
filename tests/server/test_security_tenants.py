"""Tenants, written as the attacks of issue 34: one API key's client cannot list, cancel,
read, delete or continue another's requests and stored responses, cannot probe another's
prompt through ``cached_tokens``, and cannot take all the server's queue.

A real server on loopback around the tiny engine (``tiny_live_server``), three keys for
two tenants (alice has two clients), at most 3 requests per tenant in flight and none queued.
"""

from __future__ import annotations

import time

import httpx
import pytest

from bargein.server.tenants import TenantKey
from tests.server.tiny_live_server import auth, tiny_live_server

ALICE, ALICE_PHONE, BOB = "alice-key-0123456789", "alice-phone-0123456789", "bob-key-0123456789"
KEYS = (TenantKey(ALICE, "alice"), TenantKey(ALICE_PHONE, "alice"), TenantKey(BOB, "bob"))
PER_TENANT = 3
GREEDY = {"temperature": 0, "ignore_eos": True}
SLOW_STEP_S = 0.02  # while requests must stay live: 400 tokens take 8 s or more
LONG = 400  # output tokens of a request that must stay live while the test looks at it


@pytest.fixture(scope="module")
def server():
    with tiny_live_server(api_keys=KEYS, max_in_flight_per_tenant=PER_TENANT, max_queued_per_tenant=0,
                          debug_endpoints=True) as live:
        yield live
        live.wait_idle()
        kv = httpx.get(f"{live.base_url}/debug/kv", headers=auth(ALICE), timeout=30).json()
        assert kv["ok"], kv  # C5 after every tenant's cancels and probes


@pytest.fixture
def slow(server):
    server.step_delay_s = SLOW_STEP_S
    yield server
    server.step_delay_s = 0.0
    for key in (ALICE, BOB):
        httpx.post(f"{server.base_url}/v1/requests/cancel", json={"all": True}, headers=auth(key), timeout=30)
    server.wait_idle()


def _background(server, key: str, **body) -> dict:
    r = httpx.post(f"{server.base_url}/v1/responses", headers=auth(key), timeout=60,
                   json={"input": "go on", "background": True, "max_output_tokens": LONG, **GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _wait_listed(server, key: str, rid: str) -> None:
    deadline = time.monotonic() + 30
    while rid not in _listed(server, key):
        assert time.monotonic() < deadline, f"{rid} never listed"
        time.sleep(0.02)


def _listed(server, key: str) -> set[str]:
    r = httpx.get(f"{server.base_url}/v1/requests", headers=auth(key), timeout=30)
    return {item["id"] for item in r.json()["data"]}


def test_a_tenant_lists_and_cancels_only_its_own_requests(slow):
    server = slow
    mine, theirs = _background(server, ALICE)["id"], _background(server, BOB)["id"]
    _wait_listed(server, ALICE, mine)
    _wait_listed(server, BOB, theirs)
    assert mine not in _listed(server, BOB) and theirs not in _listed(server, ALICE)
    assert mine in _listed(server, ALICE_PHONE)  # one tenant, two clients: the same view
    url = server.base_url
    for path, body in ((f"/v1/requests/{mine}/cancel", None), ("/v1/chat/cancel", {"request_id": mine}),
                       (f"/v1/responses/{mine}/cancel", None)):
        r = httpx.post(url + path, json=body, headers=auth(BOB), timeout=30)
        assert r.status_code == 404, (path, r.text)
    many = httpx.post(f"{url}/v1/requests/cancel", json={"ids": [mine]}, headers=auth(BOB), timeout=30).json()
    assert many["not_found"] == [mine] and many["cancelled"] == []
    everything = httpx.post(f"{url}/v1/requests/cancel", json={"all": True}, headers=auth(BOB), timeout=30).json()
    assert everything["cancelled"] == [theirs]
    assert httpx.delete(f"{url}/v1/responses/{mine}", headers=auth(BOB), timeout=30).status_code == 404
    # alice's answer went on through all of it
    assert mine in _listed(server, ALICE)
    got = httpx.get(f"{url}/v1/responses/{mine}", headers=auth(ALICE), timeout=30).json()
    assert got["status"] in ("queued", "in_progress")
    done = httpx.post(f"{url}/v1/responses/{mine}/cancel", headers=auth(ALICE_PHONE), timeout=30).json()
    assert done["status"] == "cancelled"


def test_a_tenant_cannot_read_or_continue_another_tenants_response(server):
    url = server.base_url
    made = httpx.post(f"{url}/v1/responses", headers=auth(ALICE), timeout=60,
                      json={"input": "the launch code is 1234", "max_output_tokens": 2, **GREEDY}).json()
    rid = made["id"]
    assert httpx.get(f"{url}/v1/responses/{rid}", headers=auth(BOB), timeout=30).status_code == 404
    follow = httpx.post(f"{url}/v1/responses", headers=auth(BOB), timeout=60,
                        json={"input": "repeat it", "previous_response_id": rid, "max_output_tokens": 2})
    assert follow.status_code == 404 and follow.json()["error"]["param"] == "previous_response_id"
    assert "1234" not in follow.text
    own = httpx.post(f"{url}/v1/responses", headers=auth(ALICE_PHONE), timeout=60,
                     json={"input": "and?", "previous_response_id": rid, "max_output_tokens": 2, **GREEDY})
    assert own.status_code == 200, own.text
    server.wait_idle()


def _cached(server, key: str, prompt: list[int], **extra) -> int:
    r = httpx.post(f"{server.base_url}/v1/completions", headers=auth(key), timeout=60,
                   json={"prompt": prompt, "max_tokens": 1, **GREEDY, **extra})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _pin_probe(server, owner: str, prober: str, salt_owner: dict, salt_prober: dict, secret: int) -> list[int]:
    """The attack: ``owner`` sends a prompt with a secret digit; ``prober`` sends the same
    prefix with each guess (and a filler token after it), after one warm-up guess of its
    own. Returns cached_tokens per digit guess."""
    prefix = [ord(c) for c in f"user {secret % 7} pin="]  # distinct per call: no earlier run's cache
    _cached(server, owner, [*prefix, ord("0") + secret, *b" ok then"], **salt_owner)
    _cached(server, prober, [*prefix, ord("x"), ord(" ")], **salt_prober)  # warm-up: its own prefix cached
    return [_cached(server, prober, [*prefix, ord("0") + d, ord(" ")], **salt_prober) for d in range(10)]


def test_the_pin_probe_from_another_tenant_gets_the_same_cached_tokens_for_every_guess(server):
    # The probe works where the cache is shared (one tenant's two clients): the right digit
    # scores one more cached token. That is what the namespaces take away.
    within = _pin_probe(server, ALICE, ALICE_PHONE, {}, {}, secret=4)
    assert within[4] == max(within) and sorted(within)[-2] == within[4] - 1, within
    across = _pin_probe(server, ALICE, BOB, {}, {}, secret=6)
    assert len(set(across)) == 1, across
    # bob's cache_salt cannot name alice's namespace: salts are per tenant
    salted = _pin_probe(server, ALICE, BOB, {"cache_salt": "s"}, {"cache_salt": "s"}, secret=2)
    assert len(set(salted)) == 1, salted
    server.wait_idle()


def test_with_a_shared_prefix_cache_the_probe_finds_the_digit():
    """--shared-prefix-cache (one user, many keys) opts out of the namespaces: the control."""
    with tiny_live_server(api_keys=KEYS, shared_prefix_cache=True) as shared:
        across = _pin_probe(shared, ALICE, BOB, {}, {}, secret=3)
    assert across[3] == max(across) and sorted(across)[-2] == across[3] - 1, across


def test_cache_salt_separates_one_tenants_requests(server):
    prompt = [*b"a shared system prompt, then a question"]
    assert _cached(server, ALICE, prompt, cache_salt="one") == 0
    assert _cached(server, ALICE, prompt, cache_salt="two") == 0  # another salt: nothing to reuse
    assert _cached(server, ALICE, prompt, cache_salt="one") == len(prompt) - 1  # all but the sampled token
    assert _cached(server, ALICE_PHONE, prompt, cache_salt="one") == len(prompt) - 1  # same tenant and salt
    server.wait_idle()


def test_a_tenant_over_its_limit_gets_429_and_the_other_is_served(slow):
    server = slow
    ids = [_background(server, ALICE)["id"] for _ in range(PER_TENANT)]
    over = httpx.post(f"{server.base_url}/v1/completions", headers=auth(ALICE_PHONE), timeout=60,
                      json={"prompt": "hi", "max_tokens": 2})
    assert over.status_code == 429 and over.json()["error"]["code"] == "tenant_in_flight_limit", over.text
    assert "per-tenant" in over.json()["error"]["message"]
    served = httpx.post(f"{server.base_url}/v1/completions", headers=auth(BOB), timeout=60,
                        json={"prompt": "hi", "max_tokens": 2, **GREEDY})
    assert served.status_code == 200, served.text
    assert set(ids) <= _listed(server, ALICE)
