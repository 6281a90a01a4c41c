"""Requests in flight: list them, and cancel one, several or all.

All cancel surfaces end in the same abort (reason ``user``, ``JobRunner.abort``): the
engine's, or, for a request still waiting in its tenant's queue, the job runner's (it ends
without having run); the request's own response then ends with ``finish_reason:
"cancelled"`` at the next step boundary.
``POST /v1/requests/{id}/cancel`` is canonical; ``POST /v1/chat/cancel`` takes the id in
the body. Unknown ids are 404; finished ones 200 with ``"status": "already_finished"``.

Each caller sees and cancels its own tenant's requests only (``tenants.py``): another
tenant's request is as unknown as one that never existed (404, ``not_found``), and
``{"all": true}`` cancels the caller's requests.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from bargein.engine.request import AbortResult, CancelReason
from bargein.server.context import Caller, Ctx, ServerContext
from bargein.server.errors import APIError, not_found
from bargein.server.schemas import CancelManyRequest, CancelRequest
from bargein.server.tenants import Tenant

router = APIRouter()


def cancel_one(ctx: ServerContext, request_id: str, tenant: Tenant) -> dict[str, Any]:
    result = ctx.registry.cancel(request_id, ctx.jobs.abort, CancelReason.USER, tenant.name)
    if result == AbortResult.NOT_FOUND:
        raise not_found("request", request_id, param="request_id")
    return {"id": request_id, "object": "request.cancel", "status": result.value}


@router.post("/v1/requests/{request_id}/cancel")
async def cancel_request(request_id: str, ctx: Ctx, tenant: Caller) -> dict[str, Any]:
    return cancel_one(ctx, request_id, tenant)


@router.post("/v1/chat/cancel")
async def cancel_chat(body: CancelRequest, ctx: Ctx, tenant: Caller) -> dict[str, Any]:
    return cancel_one(ctx, body.request_id, tenant)


@router.post("/v1/requests/cancel")
async def cancel_many(body: CancelManyRequest, ctx: Ctx, tenant: Caller) -> dict[str, Any]:
    """``{"all": true}`` cancels everything the caller has in flight; ``{"ids": [...]}`` those requests."""
    if body.all:
        ids = ctx.registry.live_ids(tenant.name)
        results = {i: ctx.registry.cancel(i, ctx.jobs.abort, CancelReason.USER, tenant.name) for i in ids}
        if tenant.is_anonymous:
            # requests made through another surface of the same engine (a conversation): by engine id
            others = [i for i in ctx.engine.live_request_ids() if ctx.registry.owner(i) is None]
            results.update({i: ctx.engine.abort(i, CancelReason.USER) for i in others})
    elif body.ids is not None:
        results = {i: ctx.registry.cancel(i, ctx.jobs.abort, CancelReason.USER, tenant.name) for i in body.ids}
    else:
        raise APIError(400, 'give {"all": true} or {"ids": [...]}', param="all", code="invalid_value")
    return {"object": "request.cancel", "status": "cancelled",
            "cancelled": [i for i, r in results.items() if r == AbortResult.CANCELLED],
            "already_finished": [i for i, r in results.items() if r == AbortResult.ALREADY_FINISHED],
            "not_found": [i for i, r in results.items() if r == AbortResult.NOT_FOUND]}


@router.get("/v1/requests")
async def list_requests(ctx: Ctx, tenant: Caller) -> dict[str, Any]:
    """The caller's requests, oldest first: in the engine (queued, running or paused) and
    waiting in the tenant's own queue (``queued``, behind its limit in flight)."""
    infos = await ctx.engine.requests()
    summaries = ctx.registry.summarize(infos, tenant.name) + ctx.jobs.waiting(tenant.name)
    return {"object": "list", "data": [s.as_dict() for s in sorted(summaries, key=lambda s: -s.age_s)]}
