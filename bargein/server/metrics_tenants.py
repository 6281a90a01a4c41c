"""Per-tenant series in ``/metrics`` (issue 34): each tenant's requests, tokens in and out,
cancels, refusals (429s) and time queued, with a ``tenant`` label.

Cardinality is bounded by construction: a label is a tenant name from the keys file (the
access rule's, never anything a client sends), the first ``max_series`` of them in sorted
order; the rest share the ``_other`` series, and the key-less server's one tenant is
``_anonymous`` (names in a keys file cannot start with ``_``, so neither collides).

Who reads what: a tenant's scrape holds its own series only, so one key cannot read
another's numbers (a tenant counted under ``_other`` reads no per-tenant series, since
that one mixes several). The key-less server's reader and the ``operators`` (tenants named
by ``--operator-tenants``: a Prometheus scraper's key) read every series. The server-wide
series stay visible to every key: they say how busy the server is, not who made it so.

Owned by the event loop, like ``ServerMetrics``.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

ANONYMOUS_LABEL = "_anonymous"
OTHER_LABEL = "_other"
DEFAULT_MAX_SERIES = 64
QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class _QueueTimes:
    """One histogram's cumulative state (``prometheus_client``'s buckets, kept here so a
    scrape can pick the series it shows)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(QUEUE_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(QUEUE_BUCKETS, seconds)] += 1
        self.total += seconds

    def buckets(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, n in zip((*map(str, QUEUE_BUCKETS), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


class TenantSeries:
    """The per-tenant counts, and the families a given reader may see (module doc)."""

    def __init__(self, tenants: Iterable[str] = (), *, max_series: int = DEFAULT_MAX_SERIES,
                 operators: Iterable[str] = ()):
        self._labelled = frozenset(sorted(set(tenants))[:max_series])
        self._operators = frozenset(operators)
        self.requests: Counter[str] = Counter()
        self.prompt_tokens: Counter[str] = Counter()
        self.completion_tokens: Counter[str] = Counter()
        self.cancelled: Counter[str] = Counter()
        self.rejected: Counter[tuple[str, str]] = Counter()  # (label, reason)
        self.queue_times: dict[str, _QueueTimes] = {}

    def label(self, tenant: str) -> str:
        """The series a tenant's numbers go to."""
        if tenant == "":
            return ANONYMOUS_LABEL
        return tenant if tenant in self._labelled else OTHER_LABEL

    def finished(self, tenant: str, outcome: str, prompt_tokens: int, completion_tokens: int) -> None:
        """A request of ``tenant`` ended with ``outcome`` (``generation.job_outcome``)."""
        label = self.label(tenant)
        self.requests[label] += 1
        self.prompt_tokens[label] += prompt_tokens
        self.completion_tokens[label] += completion_tokens
        if outcome.startswith("cancelled"):
            self.cancelled[label] += 1

    def refused(self, tenant: str, reason: str) -> None:
        """A request of ``tenant`` was refused before running (a 429), for ``reason``."""
        self.rejected[(self.label(tenant), reason)] += 1

    def queued_for(self, tenant: str, seconds: float) -> None:
        """A request of ``tenant`` reached the engine ``seconds`` after it arrived."""
        self.queue_times.setdefault(self.label(tenant), _QueueTimes()).observe(seconds)

    def visible_labels(self, reader: str | None) -> frozenset[str] | None:
        """The labels ``reader`` (a tenant name; "" key-less) may see; None: every one."""
        if reader is None or reader == "" or reader in self._operators:
            return None
        label = self.label(reader)
        return frozenset() if label == OTHER_LABEL else frozenset({label})

    def families(self, reader: str | None) -> Iterator[Metric]:
        """The per-tenant families as ``reader`` may see them."""
        visible = self.visible_labels(reader)

        def shown(label: str) -> bool:
            return visible is None or label in visible

        for name, help, counts in (
                ("bargein_tenant_requests", "HTTP generation requests ended, by tenant.", self.requests),
                ("bargein_tenant_prompt_tokens", "Prompt tokens of ended requests, by tenant.", self.prompt_tokens),
                ("bargein_tenant_completion_tokens", "Tokens generated for ended requests, by tenant.",
                 self.completion_tokens),
                ("bargein_tenant_requests_cancelled", "Requests that ended cancelled (any reason), by tenant.",
                 self.cancelled)):
            family = CounterMetricFamily(name, help, labels=["tenant"])
            for label, n in sorted(counts.items()):
                if shown(label):
                    family.add_metric([label], n)
            yield family
        rejected = CounterMetricFamily("bargein_tenant_requests_rejected",
                                       "Requests refused before running (429), by tenant and limit.",
                                       labels=["tenant", "reason"])
        for (label, reason), n in sorted(self.rejected.items()):
            if shown(label):
                rejected.add_metric([label, reason], n)
        yield rejected
        queue = HistogramMetricFamily("bargein_tenant_queue_seconds",
                                      "From a request's arrival to its reaching the engine (its tenant's queue "
                                      "included), by tenant.", labels=["tenant"])
        for label, times in sorted(self.queue_times.items()):
            if shown(label):
                queue.add_metric([label], times.buckets(), times.total)
        yield queue


class TenantView:
    """What ``generate_latest`` renders for one reader: the per-tenant families it may see."""

    def __init__(self, series: TenantSeries, reader: str | None):
        self._series = series
        self._reader = reader

    def collect(self) -> Iterator[Metric]:
        return self._series.families(self._reader)
