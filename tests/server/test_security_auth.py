"""The one access rule, written as the attacks of issue 34: every route of the app's route
table needs a key (aliases included) but an explicit public list; a client-chosen id
never replaces a stored response (409).

A real server on loopback around the tiny engine (``tiny_live_server``), two tenants.
"""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from fastapi import WebSocket
from fastapi.routing import APIRoute
from starlette.routing import WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from bargein.engine.async_engine import AsyncEngine
from bargein.server.app import STATIC_DIR, create_app
from bargein.server.error_shapes import ErrorFamily, error_family
from bargein.server.responses_store import ResponseStore
from bargein.server.settings import ServerSettings
from bargein.server.tenants import TenantKey
from tests.server.tiny_live_server import api_routes, auth, tiny_live_server
from tests.tiny_engine import tiny_engine

ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789"
KEYS = (TenantKey(ALICE, "alice"), TenantKey(BOB, "bob"))
PUBLIC_ROUTES = {("GET", "/health")}  # the explicit allow-list (besides the chat page's files)
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    with tiny_live_server(api_keys=KEYS, debug_endpoints=True, allowed_hosts=("127.0.0.1",)) as live:
        yield live


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x1", path)


def _call(client: httpx.Client, method: str, path: str, headers: dict[str, str]) -> httpx.Response:
    body = b"{}" if method in ("POST", "PUT", "PATCH") else None
    return client.request(method, _concrete(path), content=body,
                          headers={**headers, **({"Content-Type": "application/json"} if body else {})})


def test_every_route_in_the_table_needs_a_key_but_the_public_list(server):
    routes = api_routes(server.app)
    paths = {p for _, p in routes}
    # the aliases that once skipped the check are in the table, and so walked
    assert {"/responses/{response_id}", "/models", "/models/{model_id:path}", "/v1/requests"} <= paths
    open_routes = set()
    client = httpx.Client(base_url=server.base_url, timeout=30)
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong-key-000000"}, {"x-api-key": "wrong-key-000000"}):
            r = _call(client, method, path, headers)
            if r.status_code != 401:
                open_routes.add((method, path))
                continue
            assert _is_auth_error(path, r.json()), (path, r.text)
            assert r.headers["WWW-Authenticate"] == "Bearer"
    assert open_routes == PUBLIC_ROUTES


def _is_auth_error(path: str, body: dict) -> bool:
    """A 401's body, in the error shape of the route's API (error_shapes.py)."""
    family = error_family(path)
    if family == ErrorFamily.ANTHROPIC:
        return body["type"] == "error" and body["error"]["type"] == "authentication_error"
    if family == ErrorFamily.OLLAMA:
        return set(body) == {"error"} and "API key" in body["error"]
    return body["error"]["code"] == "invalid_api_key"


def test_the_alias_get_of_a_stored_response_without_a_key_is_401(server):
    made = httpx.post(f"{server.base_url}/v1/responses", headers=auth(ALICE), timeout=60,
                      json={"input": "my secret plan", "instructions": "be terse", "max_output_tokens": 3, **GREEDY})
    assert made.status_code == 200, made.text
    rid = made.json()["id"]
    for url in (f"/responses/{rid}", f"/v1/responses/{rid}", "/models", "/v1/models", "/models/tiny"):
        r = httpx.get(server.base_url + url, timeout=30)
        assert r.status_code == 401, (url, r.text)
        assert "secret" not in r.text
    got = httpx.get(f"{server.base_url}/responses/{rid}", headers=auth(ALICE), timeout=30)
    assert got.status_code == 200 and got.json()["instructions"] == "be terse"


def test_anthropic_style_x_api_key_is_accepted(server):
    for url in ("/v1/models", "/models", "/v1/requests"):
        assert httpx.get(server.base_url + url, headers={"x-api-key": BOB}, timeout=30).status_code == 200


def test_the_chat_page_files_and_health_are_public(server):
    files = [p.relative_to(STATIC_DIR).as_posix() for p in STATIC_DIR.rglob("*") if p.is_file()]
    assert "index.html" in files and "app.js" in files
    client = httpx.Client(base_url=server.base_url, timeout=30)
    for name in ["", *files]:
        r = client.get(f"/{name}")
        assert r.status_code == 200, (name, r.status_code)
    assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
    # a path that is no file of the page is guarded, so nothing can be probed without a key
    assert httpx.get(f"{server.base_url}/no-such-file.js", timeout=30).status_code == 401


def test_a_route_added_later_is_guarded_without_being_listed():
    """Default-deny: a route another part adds (an Ollama or Anthropic alias) needs the key."""
    app = create_app(AsyncEngine(tiny_engine()), ServerSettings(api_keys=KEYS))

    async def tags() -> dict:
        return {"models": []}

    app.router.routes.insert(0, APIRoute("/api/tags", tags, methods=["GET"]))

    async def probe() -> tuple[int, int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
            return ((await c.get("/api/tags")).status_code,
                    (await c.get("/api/tags", headers={"x-api-key": ALICE})).status_code)

    assert asyncio.run(probe()) == (401, 200)


def test_a_client_chosen_id_never_replaces_a_stored_response(server):
    first = httpx.post(f"{server.base_url}/v1/responses", headers=auth(ALICE), timeout=60,
                       json={"input": "hello", "instructions": "alice's instructions", "max_output_tokens": 2,
                             **GREEDY})
    rid = first.json()["id"]
    for key in (BOB, ALICE):  # the attacker, and the owner's own careless client
        again = httpx.post(f"{server.base_url}/v1/responses", headers=auth(key, X_Request_Id=rid), timeout=60,
                           json={"input": "ATTACKER-TURN", "instructions": "attacker's instructions",
                                 "max_output_tokens": 2})
        assert again.status_code == 409, again.text
        assert again.json()["error"]["code"] == "response_id_in_use"
    kept = httpx.get(f"{server.base_url}/v1/responses/{rid}", headers=auth(ALICE), timeout=30).json()
    assert kept["instructions"] == "alice's instructions"
    follow = httpx.post(f"{server.base_url}/v1/responses", headers=auth(ALICE), timeout=60,
                        json={"input": "and?", "previous_response_id": rid, "max_output_tokens": 2,
                              "return_token_ids": True, **GREEDY})
    assert follow.status_code == 200, follow.text
    prompt = bytes(t for t in follow.json()["prompt_token_ids"] if t < 256).decode()
    assert prompt.startswith("<user>hello\n<assistant>") and "ATTACKER" not in prompt
    # a fresh client-chosen id is still allowed (cancel by it), and is then taken
    chosen = httpx.post(f"{server.base_url}/v1/responses", headers=auth(ALICE, X_Request_Id="my-own-id-1"),
                        timeout=60, json={"input": "hi", "max_output_tokens": 2, **GREEDY})
    assert chosen.status_code == 200 and chosen.json()["id"] == "my-own-id-1"
    server.wait_idle()


def test_a_websocket_route_added_later_is_guarded_too():
    app = create_app(AsyncEngine(tiny_engine()), ServerSettings(api_keys=KEYS))

    async def echo(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.send_text("hello")
        await websocket.close()

    app.router.routes.insert(0, WebSocketRoute("/ws", echo))
    client = TestClient(app)
    with pytest.raises(WebSocketDisconnect) as refused, client.websocket_connect("/ws"):
        pass
    assert refused.value.code == 1008
    with client.websocket_connect("/ws", headers={"Authorization": f"Bearer {BOB}"}) as ws:
        assert ws.receive_text() == "hello"


def test_an_id_taken_between_the_check_and_the_store_is_409_with_nothing_left_running(server, monkeypatch):
    """The race behind the early check: the store itself refuses a second object under an
    id, and the request that lost leaves no job, registry entry or engine request behind."""
    body = {"input": "first", "max_output_tokens": 2, **GREEDY}
    first = httpx.post(f"{server.base_url}/v1/responses", headers=auth(ALICE, X_Request_Id="raced-id"),
                       json=body, timeout=60)
    assert first.status_code == 200, first.text
    monkeypatch.setattr(ResponseStore, "__contains__", lambda self, rid: False)  # the check sees nothing
    for extra in ({}, {"background": True}, {"stream": True}):
        lost = httpx.post(f"{server.base_url}/v1/responses", headers=auth(ALICE, X_Request_Id="raced-id"),
                          json={**body, "input": "second", **extra}, timeout=60)
        assert lost.status_code == 409 and lost.json()["error"]["code"] == "response_id_in_use", (extra, lost.text)
    server.wait_idle()
    assert server.ctx.responses.get("raced-id").conversation[0]["content"] == "first"
    store = ResponseStore(4)
    kept = server.ctx.responses.get("raced-id")
    store.put(kept)
    store.put(kept)  # the same object again: an update, not a replacement
    assert store.get("raced-id", "alice") is kept and store.get("raced-id", "bob") is None
