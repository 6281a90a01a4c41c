"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (schemathesis).

Every operation the server describes gets generated requests, valid and invalid
(``GenerationMode.all``), against a real ``bargein serve``. Whatever comes in: never a
5xx, and every error (4xx) in the OpenAI shape. Bodies without a ``timeout`` (or with a
longer one) get one of 1 s, so a generated ``max_tokens`` cannot make the run long; this bounded run is in
``make test`` (``BARGEIN_API_FUZZ_EXAMPLES``, 6 per operation by default);
``bench/fuzz_long.sh`` runs it with many more.
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

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("check_kv")]
EXAMPLES = int(os.environ.get("BARGEIN_API_FUZZ_EXAMPLES", "6"))
DEADLINE_S = 1  # the deadline path is the same at 1 s; each generated long answer waits it out


@pytest.fixture(scope="module")
def fuzz_server(live_server):
    return live_server


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(f"{fuzz_server.base_url}/openapi.json")


def test_no_5xx_and_errors_in_the_openai_shape(api_schema, fuzz_server):
    """Each operation in turn, valid and invalid inputs (schemathesis' pytest plugin does not
    run on this pytest, so the strategies are driven by hypothesis directly)."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 10
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz(operation.as_strategy(generation_mode=mode), fuzz_server.base_url)


def _fuzz(strategy, base_url: str) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case) -> None:
        if isinstance(case.body, dict) and _is_long(case.body.get("timeout")):
            case.body["timeout"] = DEADLINE_S  # a generated max_tokens must not make the run long
        response = case.call(base_url=base_url, timeout=60)
        where = f"{case.method} {case.formatted_path} {case.body!r:.300} -> {response.status_code}: {response.text[:300]}"
        assert response.status_code < 500, where
        if response.status_code >= 400:
            error = response.json().get("error")
            assert isinstance(error, dict), where
            assert set(error) == {"message", "type", "param", "code"}, where
            assert isinstance(error["message"], str) and error["message"], where

    with contextlib.suppress(Unsatisfiable):  # no invalid input exists without parameters (GET /health)
        run()


def _is_long(timeout: object) -> bool:
    """No deadline, or one longer than the run can wait (an invalid one stays: it is a 400)."""
    return timeout is None or (isinstance(timeout, int | float) and not isinstance(timeout, bool)
                               and timeout > DEADLINE_S)


def test_the_schema_describes_the_api(fuzz_server):
    paths = httpx.get(f"{fuzz_server.base_url}/openapi.json", timeout=10).json()["paths"]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/requests/{request_id}/cancel"):
        assert path in paths, sorted(paths)


def test_debug_steps_takes_any_integer_after(fuzz_server):
    """A case the fuzz found (a 500 once the engine held steps): ``after`` far past the last
    step, or far below the first, is an answer, not an islice error."""
    httpx.post(f"{fuzz_server.base_url}/v1/completions", timeout=60,
               json={"prompt": "Hi", "max_tokens": 2}).raise_for_status()  # the engine holds steps
    for after, some in ((2**70, False), (2**63, False), (-(2**70), True), (0, True)):
        r = httpx.get(f"{fuzz_server.base_url}/debug/steps", params={"after": after}, timeout=10)
        assert r.status_code == 200, (after, r.text)
        assert bool(r.json()["steps"]) is some, (after, r.json())
