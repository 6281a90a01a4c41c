"""Per-tenant limits on requests in flight and queued (issue 34): one tenant cannot fill the
engine, nor the server's queue, however many requests it sends.

A tenant's request is *in flight* once it is handed to the engine (running, or waiting in
the engine's own queue); at most ``max_in_flight`` of a tenant's are (``--max-in-flight-
per-tenant``). The next ones wait here, in the tenant's own first-come queue, until one of
its requests in flight ends; at most ``max_queued`` of them (``--max-queued-per-tenant``).
A request beyond both is refused at once: 429 with ``Retry-After``, and a code and message
that name the limit it hit. Every waiting request also counts in the server-wide
``--max-queue``, as every live request does.

Plain data, owned by the event loop: ``enter`` admits or queues a request, ``leave``
takes one out (ended, cancelled, or given up while queued) and returns the requests of
that tenant admitted in its place, for the job runner to hand to the engine.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from bargein.server.errors import APIError

RETRY_AFTER_S = 1  # a tenant's request in flight ends within a few steps of a short answer


@dataclass(frozen=True)
class TenantLimits:
    """``None`` is no limit. ``max_queued`` applies only with ``max_in_flight`` (nothing
    queues without it)."""

    max_in_flight: int | None = None
    max_queued: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_in_flight", "max_queued"):
            value = getattr(self, name)
            if value is not None and value < (1 if name == "max_in_flight" else 0):
                raise ValueError(f"{name} out of range: {value}")

    @property
    def enabled(self) -> bool:
        return self.max_in_flight is not None


NO_TENANT_LIMITS = TenantLimits()


@dataclass
class _TenantLine:
    in_flight: set[str] = field(default_factory=set)
    queued: deque[str] = field(default_factory=deque)


class TenantGate:
    """Which of each tenant's live requests are in flight and which wait (module doc)."""

    def __init__(self, limits: TenantLimits):
        self.limits = limits
        self._lines: dict[str, _TenantLine] = {}

    def in_flight(self, tenant: str) -> int:
        line = self._lines.get(tenant)
        return 0 if line is None else len(line.in_flight)

    def queued(self, tenant: str) -> int:
        line = self._lines.get(tenant)
        return 0 if line is None else len(line.queued)

    def is_queued(self, tenant: str, request_id: str) -> bool:
        line = self._lines.get(tenant)
        return line is not None and request_id in line.queued

    def enter(self, tenant: str, request_id: str) -> bool:
        """True: ``request_id`` is in flight now; False: it waits in the tenant's queue.
        Raises the 429 when both are full (nothing changes then)."""
        limits = self.limits
        if limits.max_in_flight is None:
            return True
        line = self._lines.setdefault(tenant, _TenantLine())
        if len(line.in_flight) < limits.max_in_flight:
            line.in_flight.add(request_id)
            return True
        if limits.max_queued is not None and len(line.queued) >= limits.max_queued:
            raise self.refusal(len(line.in_flight), len(line.queued))
        line.queued.append(request_id)
        return False

    def leave(self, tenant: str, request_id: str) -> list[str]:
        """``request_id`` ended (or gave up waiting); returns the tenant's queued requests
        that are in flight now, oldest first. Unknown ids are ignored."""
        line = self._lines.get(tenant)
        if line is None:
            return []
        admitted: list[str] = []
        if request_id in line.in_flight:
            line.in_flight.discard(request_id)
            assert self.limits.max_in_flight is not None
            while line.queued and len(line.in_flight) < self.limits.max_in_flight:
                next_id = line.queued.popleft()
                line.in_flight.add(next_id)
                admitted.append(next_id)
        elif request_id in line.queued:
            line.queued.remove(request_id)
        self._drop_if_empty(tenant)
        return admitted

    def refusal(self, in_flight: int, queued: int) -> APIError:
        """The 429 for a tenant with ``in_flight`` and ``queued`` requests: which limit it hit."""
        limits = self.limits
        headers = {"Retry-After": str(RETRY_AFTER_S)}
        if not limits.max_queued:
            return APIError(429, f"this API key already has {in_flight} requests in flight, its limit "
                                 f"(--max-in-flight-per-tenant {limits.max_in_flight}), and no queue "
                                 f"(--max-queued-per-tenant 0); retry later", code="tenant_in_flight_limit",
                            headers=headers)
        return APIError(429, f"this API key already has {in_flight} requests in flight "
                             f"(--max-in-flight-per-tenant {limits.max_in_flight}) and {queued} queued, its limit "
                             f"(--max-queued-per-tenant {limits.max_queued}); retry later",
                        code="tenant_queue_limit", headers=headers)

    def _drop_if_empty(self, tenant: str) -> None:
        line = self._lines.get(tenant)
        if line is not None and not line.in_flight and not line.queued:
            del self._lines[tenant]
