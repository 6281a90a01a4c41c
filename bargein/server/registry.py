"""RequestRegistry: which HTTP requests are live, and the engine requests behind each.

One HTTP request (a chat completion with ``n`` choices, a batch of completion prompts)
may run several engine requests. The registry maps the id the client sees to those
engine ids, so that cancel-by-id, ``GET /v1/requests`` and the queue limit all speak of
HTTP requests.

Engine ids are ``"{http id}#{index}"``. A client may choose its HTTP id (``X-Request-Id``)
but never one with ``#`` in it, so no id a client chooses is ever another request's
engine id, and engine ids of live requests are distinct because live HTTP ids are. The
registry keeps no memory of finished requests: a cancel for an id that is not live asks
the engine about its first engine id, and the engine, which remembers recently finished
ids, answers "already finished" or "not found".

Each live request belongs to a tenant (``tenants.py``); cancel and the listing take the
caller's tenant and treat another tenant's request as unknown. The registry remembers the
tenant of recently finished ids (a bounded memory), so a cancel of another tenant's
finished request is "not found" too, not "already finished".

Owned by the event loop thread; no locks needed.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from bargein.engine.request import AbortResult, CancelReason
from bargein.engine.stats import RequestInfo

FINISHED_OWNERS_KEPT = 10_000  # finished ids whose tenant is remembered
ENGINE_ID_SEPARATOR = "#"  # outside what a client may choose (errors.REQUEST_ID)
Abort = Callable[[str, CancelReason], AbortResult]


def engine_id_for(request_id: str, index: int) -> str:
    """The engine id of choice ``index`` of HTTP request ``request_id``."""
    return f"{request_id}{ENGINE_ID_SEPARATOR}{index}"


@dataclass
class LiveRequest:
    request_id: str
    engine_ids: list[str]
    endpoint: str
    tenant: str = ""  # the Tenant's name ("" anonymous)
    started: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class RequestSummary:
    """One HTTP request as ``GET /v1/requests`` lists it."""

    id: str
    status: str  # "queued" | "running" | "paused" (its client stopped reading: backpressure)
    prompt_tokens: int
    prompt_computed: int  # prompt tokens with K/V so far: equal to prompt_tokens once the prompt is read
    completion_tokens: int
    age_s: float
    deadline_s: float | None
    paused_s: float | None = None  # seconds since its client stopped reading, while paused

    def as_dict(self) -> dict:
        return {"id": self.id, "status": self.status, "prompt_tokens": self.prompt_tokens,
                "prompt_computed": self.prompt_computed,
                "completion_tokens": self.completion_tokens, "age_s": round(self.age_s, 3),
                "deadline_s": None if self.deadline_s is None else round(self.deadline_s, 3),
                "paused_s": None if self.paused_s is None else round(self.paused_s, 3)}


class RequestRegistry:
    def __init__(self) -> None:
        self._live: dict[str, LiveRequest] = {}
        self._by_engine_id: dict[str, str] = {}
        self._finished_tenant: OrderedDict[str, str] = OrderedDict()  # request id -> tenant, newest last

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def add(self, request_id: str, engine_ids: list[str], endpoint: str, tenant: str = "") -> LiveRequest:
        live = LiveRequest(request_id, list(engine_ids), endpoint, tenant)
        self._live[request_id] = live
        for engine_id in engine_ids:
            self._by_engine_id[engine_id] = request_id
        return live

    def finish(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return
        self._finished_tenant[request_id] = live.tenant
        if len(self._finished_tenant) > FINISHED_OWNERS_KEPT:
            self._finished_tenant.popitem(last=False)
        for engine_id in live.engine_ids:
            self._by_engine_id.pop(engine_id, None)

    def owner(self, engine_id: str) -> str | None:
        """The HTTP request id an engine request belongs to, if the server started it."""
        return self._by_engine_id.get(engine_id)

    def live_ids(self, tenant: str | None = None) -> list[str]:
        """Live request ids, of one tenant's when ``tenant`` is given."""
        return [i for i, live in self._live.items() if tenant is None or live.tenant == tenant]

    def count(self, tenant: str) -> int:
        """How many live requests ``tenant`` has."""
        return sum(live.tenant == tenant for live in self._live.values())

    def cancel(self, request_id: str, abort: Abort, reason: CancelReason = CancelReason.USER,
               tenant: str | None = None) -> AbortResult:
        """Aborts every engine request behind ``request_id`` via ``abort(engine_id, reason)``.

        For an id that is not live, the engine's answer about its first engine id says
        whether it finished recently (ALREADY_FINISHED) or is unknown (NOT_FOUND). With
        ``tenant``, another tenant's request, live or finished, is NOT_FOUND.
        """
        live = self._live.get(request_id)
        if tenant is not None:
            owner = live.tenant if live is not None else self._finished_tenant.get(request_id, "")
            if owner != tenant:
                return AbortResult.NOT_FOUND
        if live is None:
            result = abort(engine_id_for(request_id, 0), reason)
            # CANCELLED here would mean the engine still runs it after the job closed: a
            # job closes only once every engine request has finished or been aborted.
            return AbortResult.ALREADY_FINISHED if result == AbortResult.CANCELLED else result
        results = [abort(engine_id, reason) for engine_id in live.engine_ids]
        if AbortResult.CANCELLED in results:
            return AbortResult.CANCELLED
        return AbortResult.ALREADY_FINISHED

    def tenant_of(self, request_id: str) -> str:
        """The tenant of a live HTTP request, or "" (anonymous: started through another surface)."""
        live = self._live.get(request_id)
        return "" if live is None else live.tenant

    def summarize(self, infos: list[RequestInfo], tenant: str | None = None) -> list[RequestSummary]:
        """Engine request infos grouped by the HTTP request they belong to, oldest first;
        with ``tenant``, only that tenant's. A request is ``paused`` when any of its engine
        requests is (they share one client, which stopped reading), else ``running`` when
        any runs, else ``queued``."""
        groups: dict[str, list[RequestInfo]] = {}
        for info in infos:
            request_id = self._by_engine_id.get(info.request_id, info.request_id)
            if tenant is None or self.tenant_of(request_id) == tenant:
                groups.setdefault(request_id, []).append(info)
        summaries = []
        for request_id, group in groups.items():
            deadlines = [i.deadline_s for i in group if i.deadline_s is not None]
            paused = [i.paused_s for i in group if i.paused_s is not None]
            statuses = {i.status for i in group}
            summaries.append(RequestSummary(
                id=request_id,
                status="paused" if paused else "running" if "running" in statuses else "queued",
                prompt_tokens=group[0].prompt_tokens,
                prompt_computed=min(i.prompt_computed for i in group),
                completion_tokens=sum(i.completion_tokens for i in group),
                age_s=max(i.age_s for i in group),
                deadline_s=min(deadlines) if deadlines else None,
                paused_s=max(paused) if paused else None,
            ))
        return sorted(summaries, key=lambda s: -s.age_s)
