"""The failover decision of the replica set, without Ray: what becomes of a lost replica's
request (:func:`bargein.distributed.replicas.failover.decide`), and how a resumed
replica's deltas read as the original request's."""

from __future__ import annotations

from bargein.distributed.replicas.failover import End, Resubmit, as_sent, decide, translate
from bargein.distributed.replicas.records import ConversationRecord, LiveRequest, RecordStore
from bargein.distributed.router import Route
from bargein.engine.constraint import Constraint
from bargein.engine.outputs import RequestDelta
from bargein.engine.request import AbortResult, CancelReason, FinishReason, Usage
from bargein.engine.sampling import SamplingParams
from bargein.engine.stats import RequestInfo

NOW = 1000.0


def live(prompt=(1, 2, 3), output=(7, 8), **kwargs) -> LiveRequest:
    kwargs.setdefault("params", SamplingParams(max_tokens=10, min_tokens=3))
    kwargs.setdefault("deadline", None)
    return LiveRequest("r1", None, list(prompt), route=Route(0, 0), output=list(output), **kwargs)


def test_a_request_resumes_from_its_prompt_and_output_with_the_rest_of_its_budget():
    choice = decide(live(deadline=NOW + 5), None, tombstoned=False, why="lost", now=NOW)
    assert isinstance(choice, Resubmit)
    assert choice.tokens == [1, 2, 3, 7, 8] and choice.output_offset == 2
    assert (choice.params.max_tokens, choice.params.min_tokens) == (8, 1)
    assert choice.timeout == 5 and choice.reserve_tokens == 8 and choice.constraint_from is None


def test_a_cancel_that_raced_the_loss_ends_it_as_dropped_late():
    claimed = decide(live(), None, cancel=CancelReason.DISCONNECT, tombstoned=False, why="lost", now=NOW)
    assert claimed == End(FinishReason.CANCELLED, CancelReason.DISCONNECT, dropped_late=True)
    tombstoned = decide(live(), None, tombstoned=True, why="lost", now=NOW)
    assert tombstoned == End(FinishReason.CANCELLED, CancelReason.USER, dropped_late=True)


def test_done_full_and_expired_requests_end():
    assert decide(live(), None, stopped=True, tombstoned=False, why="x", now=NOW) == End(FinishReason.STOP)
    full = live(params=SamplingParams(max_tokens=2))
    assert decide(full, None, tombstoned=False, why="x", now=NOW) == End(FinishReason.LENGTH)
    expired = live(deadline=NOW)
    assert decide(expired, None, tombstoned=False, why="x", now=NOW) == End(FinishReason.CANCELLED,
                                                                              CancelReason.DEADLINE)


def test_a_conversation_answer_resumes_from_the_conversation_and_ends_if_it_was_closed():
    rec = live(prompt=(5,), conversation="conv-1", conversation_base=4)
    choice = decide(rec, [9, 9, 9, 5, 7, 8], tombstoned=False, why="lost", now=NOW)
    assert isinstance(choice, Resubmit) and choice.tokens == [9, 9, 9, 5, 7, 8]
    closed = decide(rec, None, tombstoned=False, why="replica 0 was lost", now=NOW)
    assert closed == End(FinishReason.ERROR, error="replica 0 was lost; its conversation was closed")


def test_a_constrained_answer_replays_from_where_it_began():
    params = SamplingParams(max_tokens=10, constraint=Constraint.json_schema('{"type": "object"}'))
    assert decide(live(params=params), None, tombstoned=False, why="x", now=NOW).constraint_from == 3
    again = live(params=params, constraint_from=2)
    assert decide(again, None, tombstoned=False, why="x", now=NOW).constraint_from == 2


def test_a_resumed_delta_reads_as_the_original_request_s():
    rec = live(prompt=(1, 2, 3), output=(7, 8), offset=2, resumes=1, cached_tokens=3, prompt_sent=True)
    delta = RequestDelta("r1", new_token_ids=[9], prompt_token_ids=[1, 2, 3, 7, 8],
                         usage=Usage(5, 1, 0))
    translate(rec, delta)
    assert rec.output == [7, 8, 9] and delta.prompt_token_ids is None
    assert delta.usage == Usage(3, 3, 3)
    info = RequestInfo(request_id="r1", status="running", prompt_tokens=5, prompt_computed=5,
                       completion_tokens=1, age_s=0.5, deadline_s=None, session_id=None)
    shown = as_sent(rec, info, rec.arrival + 2.0)
    assert (shown.prompt_tokens, shown.prompt_computed, shown.completion_tokens, shown.age_s) == (3, 3, 3, 2.0)


def test_the_store_remembers_an_answer_in_its_conversation():
    store = RecordStore()
    store.conversations["conv-1"] = ConversationRecord(0, [1, 2, 3, 4], unopened=False)
    rec = live(prompt=(4,), output=(7, 8), conversation="conv-1", conversation_base=4)
    store.remember(rec, 0)
    assert store.conversations["conv-1"].tokens == [1, 2, 3, 4, 7, 8]
    assert store.recent["r1"].conversation == "conv-1"


def test_a_claimed_request_keeps_only_what_was_delivered():
    rec = live(output=(7, 8))
    translate(rec, RequestDelta("r1", new_token_ids=[9]), claimed=True)
    assert rec.output == [7, 8]


def test_the_store_s_outcome_claims_are_the_engine_s_request_ids():
    """One claim-once memory (``RequestIds``): a cancel or the consumer's end claims a live
    request once; ``remember`` releases the id, which may then be used again."""
    store = RecordStore()
    store.ids.claim("a")
    store.ids.claim("b")
    assert not store.claimed("a") and not store.claimed("b")
    assert store.ids.request_cancel("a", CancelReason.DEADLINE) == AbortResult.CANCELLED
    assert store.ids.claim_end("a") == CancelReason.DEADLINE  # the cancel got there first
    assert store.ids.claim_end("b") is None and store.ids.end_claimed("b")
    assert store.ids.request_cancel("b", CancelReason.USER) == AbortResult.ALREADY_FINISHED
    assert store.claimed("a") and store.claimed("b")
    assert (store.ids.cancel_claim("a"), store.ids.end_claimed("a")) == (CancelReason.DEADLINE, False)
    for rid in ("a", "b"):
        store.remember(LiveRequest(rid, None, [1], SamplingParams(), None, Route(1, 0)), 1)
    assert store.ids.request_cancel("a", CancelReason.USER) == AbortResult.ALREADY_FINISHED
    store.ids.claim("a")  # a finished id may be reused, and starts unclaimed
    assert not store.claimed("a")
