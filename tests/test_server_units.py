"""Server parts without a model: settings, metrics text, the request registry, the response store."""

from __future__ import annotations

import math

import pytest

from bargein.engine.request import AbortResult, CancelReason, FinishReason, RequestOutput, Usage
from bargein.engine.stats import EngineStats, RequestInfo
from bargein.server.metrics import Histogram, ServerMetrics, quantile
from bargein.server.registry import RequestRegistry, engine_id_for
from bargein.server.responses_store import ResponseStore, StoredResponse
from bargein.server.settings import ServerSettings, SettingsError, parse_size


def test_parse_size():
    assert parse_size("512MiB") == 512 * 1024**2
    assert parse_size("4 MB") == 4_000_000
    assert parse_size("1024") == 1024
    with pytest.raises(ValueError):
        parse_size("lots")


def test_settings_from_env_and_validation():
    s = ServerSettings.from_env({"BARGEIN_PORT": "9000", "BARGEIN_API_KEY": "k", "BARGEIN_MAX_QUEUE": "3",
                                 "BARGEIN_REQUEST_TIMEOUT": "2.5", "BARGEIN_DEBUG_ENDPOINTS": "yes",
                                 "BARGEIN_MAX_BODY": "1MiB"})
    assert (s.port, s.api_key, s.max_queue, s.request_timeout, s.debug_endpoints, s.max_body_bytes) == (
        9000, "k", 3, 2.5, True, 1024**2)
    assert ServerSettings.from_env({}) == ServerSettings()
    with pytest.raises(SettingsError, match="BARGEIN_PORT"):
        ServerSettings.from_env({"BARGEIN_PORT": "eighty"})
    with pytest.raises(SettingsError):
        ServerSettings(max_queue=0)
    with pytest.raises(SettingsError):
        ServerSettings(request_timeout=0)


def test_histogram_and_quantile():
    h = Histogram("x_seconds", "help", buckets=(0.1, 1.0))
    for v in (0.05, 0.5, 5.0):
        h.observe(v)
    text = "\n".join(h.render())
    assert 'x_seconds_bucket{le="0.1"} 1' in text and 'x_seconds_bucket{le="1"} 2' in text
    assert 'x_seconds_bucket{le="+Inf"} 3' in text and "x_seconds_count 3" in text
    assert quantile([1, 2, 3, 4], 0.5) == 2 and math.isnan(quantile([], 0.5))


def test_metrics_render_engine_stats():
    stats = EngineStats(kv_blocks_total=10, kv_blocks_free=6, kv_blocks_cached=3, kv_blocks_used=1, block_size=16,
                        running=1, waiting=2, conversations=0, steps=5, prefix_cache_hit_tokens=32,
                        prefix_cache_hit_blocks=2, prefix_cache_query_blocks=4, computed_tokens=100,
                        generated_tokens=40, preemptions=0, finished={"stop": 2, "cancelled": 1},
                        cancelled={"disconnect": 1})
    m = ServerMetrics()
    m.record_outcome("chat", "stop")
    text = m.render(stats, [0.01, 0.02], [1, 1], live_requests=1)
    for line in ['bargein_requests_cancelled_total{cancel_reason="disconnect"} 1',
                 'bargein_requests_finished_total{finish_reason="stop"} 2', 'bargein_kv_blocks{state="cached"} 3',
                 "bargein_requests_waiting 2", "bargein_prefix_cache_hit_tokens_total 32",
                 'bargein_http_requests_total{endpoint="chat",outcome="stop"} 1', "bargein_cancel_latency_steps_count 2"]:
        assert line in text, line


def test_registry_groups_cancels_and_asks_the_engine_about_finished_ids():
    registry = RequestRegistry()
    engine_ids = [engine_id_for("r1", 0), engine_id_for("r1", 1)]
    assert engine_ids == ["r1#0", "r1#1"]  # "#" is outside what a client may choose as its id
    registry.add("r1", engine_ids, "chat")
    aborted = []

    def abort(engine_id, reason):
        aborted.append((engine_id, reason))
        return AbortResult.CANCELLED

    assert registry.cancel("r1", abort) == AbortResult.CANCELLED
    assert aborted == [("r1#0", CancelReason.USER), ("r1#1", CancelReason.USER)]
    infos = [RequestInfo("r1#0", "running", 5, 5, 3, 1.0, None, None), RequestInfo("r1#1", "queued", 5, 2, 0, 0.5, 4.0, None)]
    [summary] = registry.summarize(infos)
    assert (summary.id, summary.status, summary.completion_tokens, summary.deadline_s) == ("r1", "running", 3, 4.0)
    assert (summary.prompt_tokens, summary.prompt_computed) == (5, 2)  # the prompt is read when all have read it
    registry.finish("r1")
    asked = []
    engine_answer = lambda i, r: asked.append(i) or AbortResult.ALREADY_FINISHED  # noqa: E731
    assert registry.cancel("r1", engine_answer) == AbortResult.ALREADY_FINISHED
    assert asked == ["r1#0"]  # the registry keeps no memory of finished ids: the engine does
    assert registry.cancel("other", lambda i, r: AbortResult.NOT_FOUND) == AbortResult.NOT_FOUND
    assert registry.cancel("r1-0", lambda i, r: AbortResult.NOT_FOUND) == AbortResult.NOT_FOUND


def _output(finish: FinishReason | None, reason: CancelReason | None = None) -> RequestOutput:
    return RequestOutput("resp_1", (5,), (5,), "hi", "hi", finish is not None, finish, Usage(3, 1, 0),
                         cancel_reason=reason, prompt_token_ids=(1, 2, 3))


def test_stored_response_status_and_lru():
    r = StoredResponse(id="resp_1", model="m", prompt_messages=[], conversation=[], prompt_token_ids=[1, 2, 3])
    r.apply(_output(None))
    assert r.status == "in_progress" and not r.done.is_set()
    r.apply(_output(FinishReason.CANCELLED, CancelReason.USER))
    body = r.to_dict()
    assert body["status"] == "cancelled" and body["cancel_reason"] == "user" and r.done.is_set()
    assert body["usage"]["input_tokens"] == 3 and body["output"][0]["content"][0]["text"] == "hi"

    store = ResponseStore(2)
    items = [StoredResponse(id=f"resp_{i}", model="m", prompt_messages=[], conversation=[], prompt_token_ids=[],
                            status="completed") for i in range(3)]
    live = StoredResponse(id="resp_live", model="m", prompt_messages=[], conversation=[], prompt_token_ids=[])
    store.put(live)
    for item in items:
        store.put(item)
    assert store.get("resp_live") is live  # never evicted while live
    assert store.get("resp_0") is None and store.get("resp_2") is not None
