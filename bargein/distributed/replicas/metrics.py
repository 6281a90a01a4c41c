"""Per-replica Prometheus series (label ``replica``), from the snapshot the last scrape took.

The server's ``/metrics`` scrape asks the engine for its stats; with replicas that reads
every replica's snapshot (``ReplicaSet.merged_stats``), which this collector then renders
per replica, next to the router's counts (load, routed requests, predicted prefix hits,
conversations moved, losses and restarts).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class ReplicaCollector(Collector):
    def __init__(self, replicas: Any):
        self._set = replicas

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        routing = self._set.router.snapshot()
        stats = dict(self._set.replica_stats)
        gauges = {
            "up": GaugeMetricFamily("bargein_replica_up", "1 while the replica is routed to.", labels=["replica"]),
            "load": GaugeMetricFamily("bargein_replica_live_requests", "Requests in flight on the replica.",
                                      labels=["replica"]),
            "running": GaugeMetricFamily("bargein_replica_requests_running", "Requests in the replica's batch.",
                                         labels=["replica"]),
            "free": GaugeMetricFamily("bargein_replica_kv_blocks_free", "Free KV blocks of the replica.",
                                      labels=["replica"]),
        }
        counters = {
            "routed": CounterMetricFamily("bargein_replica_routed", "Requests routed to the replica.",
                                          labels=["replica"]),
            "hit": CounterMetricFamily("bargein_replica_prefix_cache_hit_tokens",
                                       "Prompt tokens the replica reused from its prefix cache.", labels=["replica"]),
            "computed": CounterMetricFamily("bargein_replica_computed_tokens",
                                            "Tokens whose K/V the replica computed.", labels=["replica"]),
            "generated": CounterMetricFamily("bargein_replica_generation_tokens", "Tokens the replica generated.",
                                             labels=["replica"]),
            "lost": CounterMetricFamily("bargein_replica_lost", "Times the replica was lost.", labels=["replica"]),
            "moved": CounterMetricFamily("bargein_replica_conversations_moved_out",
                                         "Requests routed away from this replica's cache by load.",
                                         labels=["replica"]),
        }
        for i, r in enumerate(routing):
            label = [str(i)]
            gauges["up"].add_metric(label, 1.0 if r["up"] else 0.0)
            gauges["load"].add_metric(label, r["load"])
            counters["routed"].add_metric(label, r["routed"])
            counters["lost"].add_metric(label, self._set.lost[i])
            counters["moved"].add_metric(label, r["moved_out"])
            s = stats.get(i)
            if s is not None:
                gauges["running"].add_metric(label, s.running)
                gauges["free"].add_metric(label, s.kv_blocks_free)
                counters["hit"].add_metric(label, s.prefix_cache_hit_tokens)
                counters["computed"].add_metric(label, s.computed_tokens)
                counters["generated"].add_metric(label, s.generated_tokens)
        yield from gauges.values()
        yield from counters.values()
