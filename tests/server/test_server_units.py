"""Server parts without a model: settings, metrics text, the request registry, the response store."""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bargein.engine.kv_disk.stats import DiskTierStats
from bargein.engine.request import AbortResult, CancelReason, FinishReason, RequestOutput, Usage
from bargein.engine.stats import EngineCounters, EngineStats, RequestInfo, merge_stats
from bargein.server.metrics import ServerMetrics
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


def _samples(text: bytes) -> dict[tuple[str, tuple], float]:
    """Every sample of an exposition, parsed by prometheus_client's own parser."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}


def _stats(steps: int, finished: dict, cancelled: dict, used: int = 1) -> EngineStats:
    return EngineStats(kv_blocks_total=10, kv_blocks_free=9 - used, kv_blocks_cached=1, kv_blocks_used=used,
                       block_size=16, running=1, waiting=2, conversations=0, steps=steps, prefix_cache_hit_tokens=32,
                       prefix_cache_hit_blocks=2, prefix_cache_query_blocks=4, computed_tokens=100,
                       generated_tokens=40, preemptions=0, finished=finished, cancelled=cancelled)


def test_metrics_engine_snapshot_and_samples_are_counted_once():
    counters = EngineCounters()
    m = ServerMetrics()
    m.record_outcome("chat", "stop")
    m.rejected["queue_full"] += 1
    for duration in (0.002, 0.02):
        counters.step_durations.append(duration)
        counters.steps += 1
    counters.cancel_latencies.append(0.03)
    counters.cancel_latency_steps.append(1)
    counters.cancel_samples += 1
    m.observe_engine(_stats(2, {"stop": 2, "cancelled": 1}, {"disconnect": 1}), m.cursor.take(counters))
    first = _samples(m.render(live_requests=1))
    assert first[("bargein_requests_cancelled_total", (("cancel_reason", "disconnect"),))] == 1
    assert first[("bargein_requests_finished_total", (("finish_reason", "stop"),))] == 2
    assert first[("bargein_kv_blocks", (("state", "cached"),))] == 1
    assert first[("bargein_requests_waiting", ())] == 2 and first[("bargein_http_requests_live", ())] == 1
    assert first[("bargein_http_requests_total", (("endpoint", "chat"), ("outcome", "stop")))] == 1
    assert first[("bargein_requests_rejected_total", (("reason", "queue_full"),))] == 1
    assert first[("bargein_step_duration_seconds_count", ())] == 2
    assert first[("bargein_step_duration_seconds_bucket", (("le", "0.0025"),))] == 1
    assert first[("bargein_cancel_latency_steps_bucket", (("le", "1.0"),))] == 1
    assert first[("bargein_cancel_latency_seconds_sum", ())] == pytest.approx(0.03)
    # A second scrape with nothing new observes nothing twice; one new step is one more sample.
    m.observe_engine(_stats(2, {"stop": 2, "cancelled": 1}, {"disconnect": 1}), m.cursor.take(counters))
    assert _samples(m.render(live_requests=0))[("bargein_step_duration_seconds_count", ())] == 2
    counters.step_durations.append(0.5)
    counters.steps += 1
    m.observe_engine(None, m.cursor.take(counters))  # engine gone: the last snapshot stays
    third = _samples(m.render(live_requests=0))
    assert third[("bargein_step_duration_seconds_count", ())] == 3
    assert third[("bargein_requests_finished_total", (("finish_reason", "stop"),))] == 2
    with pytest.raises(ValueError):
        m.rejected["queue_full"] = 0  # counters never go back


def _disk(hits: int, read_mean: float, read_max: float) -> DiskTierStats:
    return DiskTierStats(blocks=7, bytes=7000, max_bytes=1 << 20, hits=hits, misses=1, writes=7, dropped_writes=2,
                         deleted=3, skipped_files=1, queued_writes=0, read_seconds_mean=read_mean,
                         read_seconds_max=read_max, write_seconds_mean=0.002, write_seconds_max=0.004,
                         rebuild_seconds=0.01)


def test_metrics_and_replica_merging_of_the_kv_disk_tier():
    m = ServerMetrics()
    m.observe_engine(_stats(1, {}, {}), None)
    assert not any(name.startswith("bargein_kv_disk") for name, _ in _samples(m.render(0)))  # no tier, no metrics
    m.observe_engine(replace(_stats(1, {}, {}), kv_disk=_disk(4, 0.001, 0.003)), None)
    s = _samples(m.render(0))
    assert (s[("bargein_kv_disk_blocks", ())], s[("bargein_kv_disk_bytes", ())]) == (7, 7000)
    assert (s[("bargein_kv_disk_hits_total", ())], s[("bargein_kv_disk_misses_total", ())]) == (4, 1)
    assert (s[("bargein_kv_disk_skipped_files_total", ())], s[("bargein_kv_disk_dropped_writes_total", ())]) == (1, 2)
    assert s[("bargein_kv_disk_read_seconds", (("stat", "max"),))] == 0.003
    assert s[("bargein_kv_disk_write_seconds", (("stat", "mean"),))] == 0.002
    # A replica set sums its replicas' tiers (one directory each); a replica without one adds nothing.
    merged = merge_stats([replace(_stats(1, {}, {}), kv_disk=_disk(4, 0.001, 0.003)),
                          replace(_stats(1, {}, {}), kv_disk=_disk(12, 0.003, 0.005)), _stats(1, {}, {})], 16)
    d = merged.kv_disk
    assert (d.blocks, d.bytes, d.hits, d.misses, d.skipped_files, d.dropped_writes) == (14, 14000, 16, 2, 2, 4)
    assert d.read_seconds_mean == pytest.approx(0.0025) and d.read_seconds_max == 0.005
    assert merge_stats([_stats(1, {}, {})], 16).kv_disk is None


def test_metrics_registries_are_per_app():
    a, b = ServerMetrics(), ServerMetrics()
    a.record_outcome("chat", "stop")
    assert ("bargein_http_requests_total", (("endpoint", "chat"), ("outcome", "stop"))) in _samples(a.render(0))
    assert ("bargein_http_requests_total", (("endpoint", "chat"), ("outcome", "stop"))) not in _samples(b.render(0))


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
