"""schemathesis over the OpenAPI schema of a server with API keys, with and without a key:
never a 5xx; without a key every operation but ``/health`` is a 401 in the OpenAI shape.

Bounded and deterministic: the tiny engine (``tiny_live_server``), a few derandomized
examples per operation and mode (``BARGEIN_SECURITY_FUZZ_EXAMPLES``, 2 by default), a 1 s deadline
put on every generated body. ``test_api_fuzz.py`` fuzzes the real model without keys.
"""

from __future__ import annotations

import contextlib
import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from bargein.server.tenants import TenantKey
from tests.server.tiny_live_server import api_routes, auth, tiny_live_server

EXAMPLES = int(os.environ.get("BARGEIN_SECURITY_FUZZ_EXAMPLES", "2"))
DEADLINE_S = 1  # the deadline path is the same at 1 s; each generated long answer waits it out
KEY = "fuzz-key-0123456789"
PUBLIC = {("GET", "/health")}
# FastAPI's own pages, not in the schema they serve (the route walk checks their key).
FRAMEWORK_ROUTES = {("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/docs/oauth2-redirect")}
# Routes left out of the schema on purpose, each answering in its own clients' shape
# (Anthropic's Messages, Ollama's /api, the two tokenizer conventions): the route walk of
# test_security_auth.py checks their key, their own test modules their errors.
OWN_SHAPE_PREFIXES = ("/api/", "/v1/messages", "/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize")


@pytest.fixture(scope="module")
def server():
    with tiny_live_server(api_keys=(TenantKey(KEY, "fuzz"),), debug_endpoints=True,
                          allowed_hosts=("127.0.0.1",)) as live:
        yield live
        live.wait_idle()
        kv = httpx.get(f"{live.base_url}/debug/kv", headers=auth(KEY), timeout=30).json()
        assert kv["ok"], kv


@pytest.fixture(scope="module")
def operations(server):
    """Every operation of the app's route table: the schema's, plus the un-prefixed aliases
    the schema hides (``/responses/{id}`` as ``/v1/responses/{id}``)."""
    assert httpx.get(f"{server.base_url}/openapi.json", timeout=30).status_code == 401  # the schema too
    raw = httpx.get(f"{server.base_url}/openapi.json", headers=auth(KEY), timeout=30).json()
    routes = {(method, path.replace(":path", "")) for method, path in api_routes(server.app)}
    for path in [p for p in raw["paths"] if p.startswith("/v1/")]:
        alias = path.removeprefix("/v1")
        if any(p == alias for _, p in routes):
            raw["paths"][alias] = raw["paths"][path]
    described = {(m.upper(), p) for p, item in raw["paths"].items() for m in item}
    undescribed = {(m, p) for m, p in routes - described if not p.startswith(OWN_SHAPE_PREFIXES)}
    assert undescribed <= FRAMEWORK_ROUTES, undescribed - FRAMEWORK_ROUTES
    schema = schemathesis.openapi.from_dict(raw)
    found = [result.ok() for result in schema.get_all_operations()]
    assert len(found) >= 20
    return found


def _fuzz(strategy, base_url: str, headers: dict[str, str], check) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case) -> None:
        if isinstance(case.body, dict):
            case.body["timeout"] = DEADLINE_S  # a generated max_tokens must not make the run long
        response = case.call(base_url=base_url, headers=headers, timeout=60)
        where = f"{case.method} {case.formatted_path} {case.body!r:.300} -> {response.status_code}: {response.text[:300]}"
        assert response.status_code < 500, where
        if response.status_code >= 400:
            error = response.json().get("error")
            assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, where
        check(case, response, where)

    with contextlib.suppress(Unsatisfiable):  # no invalid input exists without parameters
        run()


def test_with_the_key_no_5xx(server, operations):
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz(operation.as_strategy(generation_mode=mode), server.base_url, auth(KEY), lambda *_: None)


def test_without_a_key_every_operation_but_health_is_401(server, operations):
    def only_401(case, response, where) -> None:
        if (case.method.upper(), case.path) in PUBLIC:
            assert response.status_code == 200, where
        else:
            assert response.status_code == 401, where

    for operation in operations:
        for headers in ({}, {"x-api-key": "not-" + KEY}):
            _fuzz(operation.as_strategy(generation_mode=GenerationMode.POSITIVE), server.base_url, headers,
                  only_401)
