"""Hostile and careless clients against a real server (issue 14): each test failed before.

One server for the module with small caps and short read timeouts, so every limit can
be crossed in milliseconds; the last test shuts it down to check the drain's 503. Raw
sockets where the HTTP client would fix the request up (lone surrogates, both length
headers, slow bytes).
"""

from __future__ import annotations

import asyncio
import bisect
import json
import signal
import socket
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import listed_requests, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("check_kv")]
TIMEOUT_S = 1.0
ARGS = ("--header-timeout", str(TIMEOUT_S), "--body-timeout", str(TIMEOUT_S), "--max-messages", "4",
        "--max-stop", "3", "--max-stop-chars", "8", "--max-logit-bias", "2", "--max-n", "2",
        "--shutdown-timeout", "20")
HELLO = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory.get(ARGS)


def post_raw_json(server, path: str, text: str) -> httpx.Response:
    return httpx.post(server.base_url + path, content=text.encode(), timeout=30,
                      headers={"content-type": "application/json"})


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":"x\\ud800y"}],"max_tokens":1}',
     "messages.0.content"),
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":[{"type":"text","text":"\\udfff"}]}]}',
     "messages.0.content"),
    ("/v1/completions", '{"prompt":"x\\ud800y","max_tokens":1}', "prompt"),
    ("/v1/completions", '{"prompt":["ok","x\\udc00"],"max_tokens":1}', "prompt"),
    ("/v1/responses", '{"input":"x\\ud800y","max_output_tokens":1}', "input"),
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":"x"}],"stop":["\\ud800"]}', "stop"),
])
def test_lone_surrogate_is_a_400_naming_the_field(server, path, body, param):
    error = assert_openai_error(post_raw_json(server, path, body), 400, param)
    assert "surrogate" in error["message"]


def test_surrogate_pairs_still_work(server):
    r = post_raw_json(server, "/v1/completions", '{"prompt":"smile \\ud83d\\ude00","max_tokens":1}')
    assert r.status_code == 200, r.text


def test_huge_logit_bias_key_is_a_400(server):
    body = {"messages": HELLO, "max_tokens": 1, "logit_bias": {"9" * 5000: 1}}
    error = assert_openai_error(httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30),
                                400, "logit_bias")
    assert len(error["message"]) < 200


@pytest.mark.parametrize(("extra", "param"), [
    ({"messages": HELLO * 5}, "messages"),
    ({"stop": ["a", "b", "c", "d"]}, "stop"),
    ({"stop": "x" * 9}, "stop"),
    ({"logit_bias": {"1": 1, "2": 1, "3": 1}}, "logit_bias"),
    ({"n": 3}, "n"),
])
def test_caps_are_400s_naming_the_field(server, extra, param):
    body = {"messages": HELLO, "max_tokens": 1, **extra}
    error = assert_openai_error(httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30),
                                400, param)
    assert "allow" in error["message"]


def test_at_the_caps_requests_run(server):
    body = {"messages": HELLO * 4, "max_tokens": 1, "stop": ["a", "b", "xxxxxxxx"], "n": 2,
            "logit_bias": {"1": 1, "2": -1}}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text and len(r.json()["choices"]) == 2
    r = httpx.post(f"{server.base_url}/v1/responses", json={"input": [{"role": "user", "content": "x"}] * 5}, timeout=60)
    assert_openai_error(r, 400, "input")


def test_method_not_allowed_and_head(server):
    base = server.base_url
    for path in ("/v1/chat/completions", "/v1/requests/x/cancel"):
        r = httpx.get(base + path)
        assert_openai_error(r, 405)
        assert r.headers["allow"] == "POST"
    assert_openai_error(httpx.get(f"{base}/v1/no-such-thing"), 404)
    head, get = httpx.head(f"{base}/v1/models"), httpx.get(f"{base}/v1/models")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-length"] == get.headers["content-length"]
    assert httpx.head(f"{base}/health").status_code == 200
    assert httpx.get(f"{base}/").status_code == 200  # the UI is still served at /


def _raw(server, data: bytes, *, read_timeout: float = 10.0) -> tuple[bytes, float]:
    """Sends ``data`` on a new connection; returns everything read until the server closes it."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=read_timeout) as s:
        s.sendall(data)
        received = b""
        while chunk := s.recv(65536):
            received += chunk
    return received, time.monotonic() - started


def test_content_length_with_transfer_encoding_is_refused(server):
    body = b'{"messages":[{"role":"user","content":"Hi"}],"max_tokens":1}'
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
               + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
    reply, _ = _raw(server, request)
    assert reply.startswith(b"HTTP/1.1 400 ") and b"conflicting_length_headers" in reply


def test_slow_body_gets_408_and_the_connection_closes(server):
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: 60\r\n\r\n{\"messages\"")
    reply, took = _raw(server, request)  # returns only once the server closed the connection
    assert reply.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in reply
    assert TIMEOUT_S - 0.1 <= took < TIMEOUT_S + 5


def test_slow_headers_get_408_and_the_connection_closes(server):
    reply, took = _raw(server, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    assert reply.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in reply
    assert TIMEOUT_S - 0.1 <= took < TIMEOUT_S + 5
    reply, _ = _raw(server, b"")  # a connection that never sends a byte is closed too
    assert reply.startswith(b"HTTP/1.1 408 ")


@pytest.mark.anyio
async def test_many_slow_clients_do_not_delay_a_normal_request(server):
    async def slow(i: int) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" if i % 2 else
                     b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 99\r\n\r\n{")
        reply = await reader.read()
        writer.close()
        return reply

    slow_clients = [asyncio.ensure_future(slow(i)) for i in range(50)]
    await asyncio.sleep(0.2)
    async with httpx.AsyncClient(timeout=30) as http:
        started = time.monotonic()
        r = await http.post(f"{server.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        took = time.monotonic() - started
    assert r.status_code == 200, r.text
    assert took < TIMEOUT_S  # served while all fifty still hold their connections
    replies = await asyncio.wait_for(asyncio.gather(*slow_clients), 30)
    assert all(reply.startswith(b"HTTP/1.1 408 ") for reply in replies)


HUGE_BODY = json.dumps({"messages": [{"role": "user", "content": "lorem ipsum " * 330_000}],
                        "max_tokens": 1}).encode()  # 3.96 MB, under the 4 MiB body limit


def _steps_ended(server) -> list[float]:
    """When each recent engine step ended (the server's time.monotonic(), our clock too)."""
    body = httpx.get(f"{server.base_url}/debug/steps", timeout=10).json()
    assert body["fields"][:2] == ["index", "ended"]
    indexes = [row[0] for row in body["steps"]]
    assert indexes == list(range(indexes[0], indexes[0] + len(indexes))), "each step once, in order"
    return [row[1] for row in body["steps"]]


MOST_STEPS_WITHOUT_A_CHUNK = 6


def test_a_stream_misses_no_step_while_4mb_inputs_are_refused(server):
    """Counted in engine steps, not ms (robust on a loaded machine): while three 4 MB
    chat bodies are refused at once, a stream's chunks keep coming with at most
    ``MOST_STEPS_WITHOUT_A_CHUNK`` steps ending between two of them, and no chunk holds more
    tokens than that. With logprobs every token makes a chunk, so a gap is a stall, never a
    token without text; a chunk of k tokens is k steps the stream's task did not run.

    The bound separates the one piece of work per body that must hold the event loop and
    the GIL (receiving and parsing 4 MB of JSON: about 10 ms here) from work that grows with
    the input: tokenizing one such body takes 2.6 s here, about 75 steps of the loaded CI
    machine's (~35 ms). The parses alone, back to back on that machine while the other
    worker runs Ray clusters, have reached 3 steps between two chunks and a chunk of 4
    tokens; the bound is 6, still a twelfth of one body's tokenizing."""
    arrivals: list[tuple[float, int]] = []  # (when, tokens in the chunk)

    def read() -> None:
        body = {"messages": HELLO, "max_tokens": 120, "ignore_eos": True, "stream": True, "logprobs": True}
        with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    arrivals.append((time.monotonic(), len((choice.get("logprobs") or {}).get("content") or [])))

    def refuse() -> None:
        r = httpx.post(f"{server.base_url}/v1/chat/completions", content=HUGE_BODY, timeout=60,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text

    reader = threading.Thread(target=read)
    reader.start()
    wait_until(lambda: len(arrivals) >= 10)
    window_start = time.monotonic()
    senders = [threading.Thread(target=refuse) for _ in range(3)]
    for t in senders:
        t.start()
    for t in senders:
        t.join()
    window_end = time.monotonic()
    wait_until(lambda: len(arrivals) >= 10 + 5 and arrivals[-1][0] > window_end + 0.2)
    reader.join()
    ended = _steps_ended(server)
    tokens = [(when, n) for when, n in arrivals if n]  # from the first token on
    assert sum(n for _, n in tokens) == 120
    # The server held no token back: a stream's tokens that wait for the event loop are
    # merged into one chunk, so a chunk of k tokens is k steps without one.
    merged = [n for when, n in tokens if window_start < when < window_end + 0.5]
    assert merged and max(merged) <= MOST_STEPS_WITHOUT_A_CHUNK, tokens
    during = []
    for i, ((a, _), (b, _)) in enumerate(zip(tokens, tokens[1:], strict=False)):
        if a < window_end and b > window_start:
            steps = bisect.bisect_right(ended, b) - bisect.bisect_right(ended, a)
            # A stall of this test process (not the server) reads k steps' chunks at once:
            # one gap, then a burst of separate one-token chunks.
            burst = sum(1 for when, _ in tokens[i + 1:] if when - b < 0.005)
            during.append((round(b - a, 3), steps if burst < steps - 1 else 1))
    assert during and max(steps for _, steps in during) <= MOST_STEPS_WITHOUT_A_CHUNK, during


def _metric_samples(server) -> dict[tuple[str, tuple], tuple[str, float]]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): (family.type, s.value)
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_parse_and_never_decrease(server):
    first = _metric_samples(server)
    body = {"messages": HELLO, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{server.base_url}/v1/chat/completions", json=body,
                                                        headers={"X-Request-Id": "metrics-cancel"}) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                break
        http.post(f"{server.base_url}/v1/requests/metrics-cancel/cancel")
        assert any("cancelled" in line for line in lines)
    httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    wait_until(lambda: "metrics-cancel" not in listed_requests(server))
    second = _metric_samples(server)
    grown = 0
    for key, (kind, value) in first.items():
        if kind in ("counter", "histogram") and not key[0].endswith("_created"):
            assert second[key][1] >= value, key
            grown += second[key][1] > value
    assert grown > 10
    for name in ("bargein_time_to_first_token_seconds_count", "bargein_inter_token_latency_seconds_count",
                 "bargein_step_duration_seconds_count", "bargein_cancel_latency_seconds_count",
                 "bargein_cancel_latency_steps_count"):
        assert second[(name, ())][1] > first.get((name, ()), ("", 0))[1], name
    assert second[("bargein_requests_cancelled_total", (("cancel_reason", "user"),))][1] >= 1
    for state in ("free", "used", "cached"):
        assert second[("bargein_kv_blocks", (("state", state),))][0] == "gauge"
    assert ("bargein_requests_waiting", ()) in second


def test_short_soak_loses_nothing(server):
    """bench/soak.py for 12 s with 8 clients: every behaviour, no unexpected answer, no leak."""
    from bench.soak import parse_args, run

    # 12 s, not 20: the test's longest fixed wait. Measured at load 14 on 2 cores, 10 s gave
    # 47-77 requests of 10-13 behaviours and 5 RSS samples (asserted: 40, 8, 4).
    args = parse_args(["--clients", "8", "--duration", "12", "--rss-every", "3", "--seed", "1"])
    result = asyncio.run(run(server.base_url, args, server.proc.pid))
    assert result["unexpected_errors"] == 0, result["unexpected_samples"]
    assert result["leaked_blocks"] == 0 and result["kv_ok"] and result["in_flight_after"] == 0, result
    assert result["requests"] >= 40 and len(result["outcomes"]) >= 8, result["outcomes"]
    assert len(result["rss_mb_samples"]) >= 4


def test_shutdown_drain_answers_503_with_retry_after(server):
    """Last: while a request that came before the signal is unanswered, a new one gets 503, not a refused connection."""
    holder = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    holder.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   b"Content-Length: 60\r\n\r\n{")  # its body never completes: it holds the drain open
    time.sleep(0.1)
    server.proc.send_signal(signal.SIGTERM)
    r = wait_until(lambda: _try_get(server), timeout=TIMEOUT_S)
    assert_openai_error(r, 503)
    assert r.headers["retry-after"].isdigit() and r.json()["error"]["code"] == "shutting_down"
    assert holder.makefile("rb").read().startswith(b"HTTP/1.1 408 ")  # answered before the exit
    holder.close()
    assert server.proc.wait(30) == 0


def _try_get(server) -> httpx.Response | None:
    try:
        r = httpx.get(f"{server.base_url}/v1/models", timeout=5)
    except httpx.HTTPError:
        return None
    return r if r.status_code == 503 else None
