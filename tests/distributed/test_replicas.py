"""N engine replicas on a Ray cluster behind one facade (issue 17).

One :class:`ReplicaSet` of 2 tiny-engine replicas (one CPU, one torch thread each,
``replica_engines.py``) on the shared simulated cluster serves every test of this module,
tenants' prefix-cache namespaces included (issue 34): starting a set is seconds of CPU
(a process per replica and one for its builders, each importing torch). The kill and hang
tests come late and leave the set whole again (Ray restarts the replica); the last one
kills both replicas for good. Each test compares against a single in-process engine on
the same weights: greedy tokens exactly, seeded sampled tokens exactly.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import jsonschema
import pytest

pytest.importorskip("ray")

import ray  # noqa: E402

from bargein.cli.cluster import format_cluster  # noqa: E402
from bargein.distributed.replicas import BuildWith, ReplicaOptions, ReplicaSet, start_replicas  # noqa: E402
from bargein.engine.admission import Admitted  # noqa: E402
from bargein.engine.async_engine import AsyncEngine  # noqa: E402
from bargein.engine.constraint import Constraint  # noqa: E402
from bargein.engine.conversation import Conversation  # noqa: E402
from bargein.engine.engine import Engine, EngineError  # noqa: E402
from bargein.engine.request import AbortResult, CancelReason, FinishReason  # noqa: E402
from bargein.engine.sampling import SamplingParams  # noqa: E402
from bargein.server.app import create_app  # noqa: E402
from bargein.server.settings import ServerSettings  # noqa: E402
from bargein.server.tenants import Tenant, prefix_namespace  # noqa: E402
from bargein.server.tools import tool_plan  # noqa: E402
from tests.distributed.replica_engines import build_replica_engine  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
ENDLESS = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(6 + 3 * i)] for i in range(5)]


@pytest.fixture(scope="module")
def replicas(ray_cluster) -> ReplicaSet:
    # queue_cost_tokens=0: a shared prefix of a block or two draws requests to where it is
    # cached whatever the queue, so the failover tests can gather their requests on one
    # replica (the load-aware rule is tested in test_router.py and on the namespace hosts).
    group = start_replicas(BuildWith(build_replica_engine), 2,
                           ReplicaOptions(num_cpus=1, call_timeout_s=5.0, hang_timeout_s=4.0, queue_cost_tokens=0))
    yield group
    group.close()


@pytest.fixture(scope="module")
def single() -> Engine:
    return build_replica_engine()


def run(coro):
    return asyncio.run(coro)


async def collect(group: ReplicaSet, prompt, params, **kwargs):
    rid, stream = group.submit(prompt, params, **kwargs)
    tokens, out = [], None
    while True:
        out = await group.next_output(stream)
        tokens += out.new_token_ids
        if out.finished:
            return rid, tokens, out


def owner_counters(group: ReplicaSet) -> dict[int, dict]:
    return {i: info.counters for i, info in group.replica_infos().items()}


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_greedy_outputs_equal_the_single_engine_and_spread_over_replicas(replicas, single):
    expected = [out.token_ids for out in single.generate(PROMPTS, GREEDY)]

    async def main():
        return await asyncio.gather(*(collect(replicas, p, GREEDY) for p in PROMPTS))

    results = run(main())
    assert [list(tokens) for _, tokens, _ in results] == [list(e) for e in expected]
    assert all(out.finish_reason == FinishReason.LENGTH and out.usage.completion_tokens == 12
               for _, _, out in results)
    routed = [r["routed"] for r in replicas.router.snapshot()]
    assert all(n > 0 for n in routed), routed  # new prompts with no match go to the least loaded
    run(replicas.check_block_accounting())


def test_continuation_after_a_cancel_lands_on_the_same_replica_token_exact(replicas, single):
    """Cancel mid-answer (the consumer was handed k tokens), then continue the conversation
    with prompt + those k tokens + a new turn: it goes to the replica that holds the K/V,
    reuses it (cached_tokens), and answers exactly as the single engine does."""
    prompt = [11, 22, 33, 44, 55, 66, 77, 88, 99, 10]

    async def main():
        rid, stream = replicas.submit(prompt, ENDLESS)
        got = []
        # The replica has sampled a 10th token, so the 9th's K/V is written: the consumer was
        # handed 9 while the engine ran ahead, the case C7 caches whole. (Cancelled before the
        # 9th was fed back, its K/V would not exist and 18 tokens would be cached, rightly.)
        while len(got) < 10:
            out = await replicas.next_output(stream)
            got += out.new_token_ids
        owner = replicas.records.live[rid].replica
        assert replicas.abort(rid, CancelReason.USER, delivered=9) == AbortResult.CANCELLED
        while not out.finished:
            out = await replicas.next_output(stream)
        assert out.finish_reason == FinishReason.CANCELLED
        follow = prompt + got[:9] + [5, 6, 7, 8, 9]
        before = replicas.router.snapshot()[owner]["routed"]
        _, tokens, final = await collect(replicas, follow, GREEDY)
        assert replicas.router.snapshot()[owner]["routed"] == before + 1, "the continuation changed replica"
        return got[:9], follow, tokens, final

    delivered, follow, tokens, final = run(main())
    assert delivered == list(single.generate([prompt], GREEDY)[0].token_ids[:9])
    assert tokens == list(single.generate([follow], GREEDY)[0].token_ids)
    # Everything before the new turn was cached, the partly filled last block included (C7).
    assert final.usage.cached_tokens == len(prompt) + 9
    run(replicas.check_block_accounting())


def test_every_cancel_route_reaches_only_the_owning_replica(replicas):
    """By id (user), by the consumer leaving (disconnect), by deadline and by shutdown of
    a job (the server's abort_all): each stops the request on its replica, counted there,
    and the other replica receives no abort at all."""
    async def cancel_by(route: str) -> tuple[int, str]:
        if route == "deadline":
            rid, stream = replicas.submit([3, 1, 4, 1, 5], ENDLESS, timeout=0.4)
        else:
            rid, stream = replicas.submit([2, 7, 1, 8, 2, 8, route.__len__()], ENDLESS)
        owner = replicas.records.live[rid].replica
        out = await replicas.next_output(stream)
        if route == "user":
            replicas.abort(rid, CancelReason.USER)
        elif route == "disconnect":
            gen = replicas.stream(rid, stream)
            await gen.__anext__()
            await gen.aclose()  # the consumer left: aborted with reason disconnect
        elif route == "shutdown":
            assert rid in replicas.abort_all(CancelReason.SHUTDOWN)
        while not out.finished:
            out = await replicas.next_output(stream)
        assert out.finish_reason == FinishReason.CANCELLED and out.cancel_reason.value == route
        return owner, rid

    for route in ("user", "disconnect", "deadline", "shutdown"):
        before = {i: (dict(c.aborts), info.stats.cancelled.get(route, 0))
                  for i, info in replicas.replica_infos().items() for c in [info.counters]}
        owner, rid = run(cancel_by(route))
        after = {i: (dict(info.counters.aborts), info.stats.cancelled.get(route, 0))
                 for i, info in replicas.replica_infos().items()}
        other = 1 - owner
        assert after[owner][1] == before[owner][1] + 1, route  # the owner's engine cancelled it
        assert after[other] == before[other], route  # no broadcast: the other saw nothing
        if route != "deadline":  # a deadline is the replica's own timer: no abort call travels
            assert after[owner][0].get(route, 0) == before[owner][0].get(route, 0) + 1
    run(replicas.check_block_accounting())


def test_a_cancel_that_beats_its_dispatch_drops_the_late_dispatch(replicas):
    """The replica's tombstone: an abort for an id it has not seen, then the dispatch."""
    actor = replicas.actors[0]
    dropped = ray.get(actor.info.remote()).counters.dropped_late
    assert ray.get(actor.abort.remote("late-1", CancelReason.USER, None)) == AbortResult.NOT_FOUND
    ray.get(actor.submit.remote("late-1", Admitted((1, 2, 3), ENDLESS, None)))
    info = ray.get(actor.info.remote())
    assert info.counters.dropped_late == dropped + 1
    assert "late-1" not in ray.get(actor.live_request_ids.remote())


def test_a_failover_that_races_a_cancel_drops_its_dispatch(replicas):
    """The head's side of the race: a request whose replica is lost after its cancel was
    claimed (the abort went to the dead replica) is not dispatched again; it ends cancelled."""
    async def main():
        rid, stream = replicas.submit([8, 6, 7, 5, 3, 0, 9], ENDLESS)
        await replicas.next_output(stream)
        rec = replicas.records.live[rid]
        submitted = {i: c.submitted for i, c in owner_counters(replicas).items()}
        dropped = replicas.dropped_late
        with replicas.records.lock:  # as _lose does, after the cancel claimed the request
            assert replicas.records.ids.request_cancel(rid, CancelReason.USER) == AbortResult.CANCELLED
            replicas.tombstones.add(rid)
            replicas._resubmit(rec, "a test")
        out = await replicas.next_output(stream)
        while not out.finished:
            out = await replicas.next_output(stream)
        replicas.actors[rec.replica].abort.remote(rid, CancelReason.USER, None)  # what abort() sent
        return rid, out, submitted, dropped

    rid, out, submitted, dropped = run(main())
    assert out.finish_reason == FinishReason.CANCELLED and out.cancel_reason == CancelReason.USER
    assert replicas.dropped_late == dropped + 1 and rid not in replicas.records.live
    assert {i: c.submitted for i, c in owner_counters(replicas).items()} == submitted  # nothing dispatched
    wait_for(lambda: not any(replicas._gather("live_request_ids").values()))
    run(replicas.check_block_accounting())


def test_v1_requests_merges_replicas_and_v1_cluster_and_metrics_show_them(replicas):
    async def main():
        app = create_app(replicas, ServerSettings())
        ctx = app.state.ctx
        ctx.loop = asyncio.get_running_loop()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            tasks = [asyncio.ensure_future(client.post("/v1/completions", json={
                "model": "tiny", "prompt": f"{i} a long one", "max_tokens": 400, "temperature": 0, "ignore_eos": True},
                                                       headers={"X-Request-Id": f"merge-{i}"})) for i in range(3)]
            for _ in range(400):
                listed = (await client.get("/v1/requests")).json()["data"]
                if len(listed) == 3 and all(item.get("completion_tokens", 0) > 0 for item in listed):
                    break
                await asyncio.sleep(0.05)
            owners = {replicas.records.live[f"merge-{i}#0"].replica for i in range(3)}
            cluster = (await client.get("/v1/cluster")).json()
            health = await client.get("/health")
            assert health.status_code == 200 and health.json()["status"] == "ok"
            for i in range(3):
                assert (await client.post(f"/v1/requests/merge-{i}/cancel")).json()["status"] == "cancelled"
            answers = [(await t).json() for t in tasks]
            metrics = (await client.get("/metrics")).text
        return listed, owners, cluster, answers, metrics

    listed, owners, cluster, answers, metrics = run(main())
    assert sorted(item["id"] for item in listed) == ["merge-0", "merge-1", "merge-2"]
    assert owners == {0, 1}  # they ran on both replicas, and the list has all three
    assert all(a["choices"][0]["finish_reason"] == "cancelled" for a in answers)
    assert cluster["num_replicas"] == 2 and len(cluster["replicas"]) == 2
    assert all(r["up"] and r["routed"] > 0 and "cache_hit_rate" in r for r in cluster["replicas"])
    assert all(r["threads"] == 1 and r["wait_policy"] for r in cluster["replicas"])  # ReplicaOptions' default
    text = format_cluster(cluster)
    assert "2 replicas" in text and "REPLICA" in text and "THREADS" in text
    assert 'bargein_replica_routed_total{replica="0"}' in metrics and 'bargein_replica_up{replica="1"} 1.0' in metrics
    run(replicas.check_block_accounting())


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                          "age": {"type": "integer", "minimum": 1, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


def test_constrained_output_through_the_server_equals_one_engine(replicas, single):
    """response_format json_schema and a tool call through the replica set answer exactly
    as one in-process engine on the same weights does (greedy and seeded sampling), and
    an unsupported schema is a 400 before any replica sees it."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    bodies = [{"model": "tiny", "prompt": "a person:", "max_tokens": 40, "response_format": fmt, **sampling}
              for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 11})]
    bodies.append({"model": "tiny", "prompt": "x", "max_tokens": 40, "temperature": 0,
                   "response_format": {"type": "json_object"}})
    bad = {"model": "tiny", "prompt": "x", "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "b", "schema": {
            "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}}

    async def answers(engine):
        app = create_app(engine, ServerSettings())
        app.state.ctx.loop = asyncio.get_running_loop()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            out = [(await client.post("/v1/completions", json=b)).json() for b in bodies]
            refused = await client.post("/v1/completions", json=bad)
        return out, refused

    async def main():
        local = AsyncEngine(build_replica_engine()).start()
        try:
            return await answers(replicas), await answers(local)
        finally:
            await local.shutdown()

    (got, refused), (expected, _) = run(main())
    assert [a["choices"][0]["text"] for a in got] == [a["choices"][0]["text"] for a in expected]
    assert [a["choices"][0]["finish_reason"] for a in got] == [a["choices"][0]["finish_reason"] for a in expected]
    for answer in got[:2]:
        if answer["choices"][0]["finish_reason"] == "stop":
            jsonschema.validate(json.loads(answer["choices"][0]["text"]), SCHEMA)
    assert refused.status_code == 400 and '"not"' in refused.json()["error"]["message"]
    # A required tool call (the lark grammar the chat route builds for tools) through the set.
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}]
    call = SamplingParams(max_tokens=48, temperature=0, constraint=tool_plan(tools, "required").constraint())
    prompt = [60, 61, 62, 63, 64]
    _, tokens, out = run(collect(replicas, prompt, call))
    assert tokens == list(single.generate([prompt], call)[0].token_ids) and out.token_ids == tuple(tokens)
    run(replicas.check_block_accounting())


def test_conversation_handles_stay_on_their_replica_and_continue_token_exact(replicas, single):
    """A Conversation over the replica set: every turn runs on the replica that holds its
    K/V (one replica receives all of them), continuation after a finished answer and
    after a cancel is token-exact with the single engine, the K/V is reused (cached
    tokens), and fork and rewind work there too."""
    prompt, more, last = [12, 34, 56, 78, 90, 21, 43], [5, 4, 3, 2, 1], [7, 7, 8]
    five = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)

    async def main():
        before = {i: c.submitted for i, c in owner_counters(replicas).items()}
        conv = Conversation.open(replicas, prompt)
        home = replicas.records.conversations[conv.id].replica
        first = [o async for o in conv.generate(five)][-1]
        await conv.prompt(more)
        second = [o async for o in conv.generate(GREEDY)][-1]
        got = []
        # The consumer leaves after 4 or more tokens (one output carries several when the
        # replica's steps outrun the polls): the conversation keeps every token handed (C3).
        async for out in conv.generate(ENDLESS):
            got += out.new_token_ids
            if len(got) >= 4:
                break
        held = await conv.tokens()
        await conv.prompt(last)
        third = [o async for o in conv.generate(GREEDY)][-1]
        fork = await conv.fork()
        await fork.rewind(len(last) + 2)
        forked = [o async for o in fork.generate(five)][-1]
        with pytest.raises(EngineError, match="the conversation is"):  # refused whole: nothing appended
            replicas.submit([1] * (replicas.facts.max_model_len - 1), GREEDY, conversation_id=conv.id)
        mirror = list(replicas.records.conversations[conv.id].tokens)
        tokens = await conv.tokens()
        await fork.close()
        await conv.close()
        after = {i: c.submitted for i, c in owner_counters(replicas).items()}
        return home, before, after, first, second, got, held, third, forked, mirror, tokens

    home, before, after, first, second, got, held, third, forked, mirror, tokens = run(main())
    assert {i: after[i] - before[i] for i in after} == {home: 5, 1 - home: 0}  # every turn on its replica
    expect = list(single.generate([prompt], five)[0].token_ids)
    assert list(first.token_ids) == expect
    history = prompt + expect + more
    assert list(second.token_ids) == list(single.generate([history], GREEDY)[0].token_ids)
    # The first answer's last token had no K/V yet: everything before it was reused.
    assert second.usage.cached_tokens == len(prompt) + len(expect) - 1
    history += list(second.token_ids)
    assert held == history + got
    history += got + last
    assert list(third.token_ids) == list(single.generate([history], GREEDY)[0].token_ids)
    assert len(held) - 1 <= third.usage.cached_tokens <= len(held)
    history += list(third.token_ids)
    rewound = history[:len(history) - len(last) - 2]
    assert list(forked.token_ids) == list(single.generate([rewound], five)[0].token_ids)
    assert tokens == mirror == history  # the head's mirror (for failover) is the replica's truth
    assert not replicas.records.conversations
    run(replicas.check_block_accounting())


# Tenants' prefix-cache namespaces through the replica set (issue 34; this was
# test_replicas_tenants.py, which started a replica set of its own). test_route_tenants.py
# checks the router alone against a block pool; here Alice and Bob, each with the
# namespace the server gives a tenant (``prefix_namespace``) as the request's
# ``cache_salt``, send the same prompt, get the same greedy answer and continue with the
# same next turn, so their token sequences are identical and only the namespace tells
# their cached blocks apart. The set's router follows any cached prefix whatever the queue
# (``queue_cost_tokens=0``), and each step is made to discriminate with a phantom request
# counted on one replica (``Router.choose`` without a request behind it, released with
# ``finished``): where a tenant's keys matched the other's blocks, the request would go to
# the wrong replica, or report another's blocks as its own hit.
BLOCK = 4  # the replicas' block size (replica_engines.build_replica_engine)
# 8 full blocks, from a token no other prompt of this module starts with: the replicas
# reuse even a partly filled block of the common namespace, a token at a time (C7).
TENANT_PROMPT = [250 - (5 * i + 2) % 250 for i in range(8 * BLOCK)]
NEXT_TURN = [17, 29, 31, 41, 43]
ALICE = prefix_namespace(Tenant("alice"), None, shared=False)
BOB = prefix_namespace(Tenant("bob"), None, shared=False)


def salted(salt: str | None, max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, cache_salt=salt)


def tenant_answer(group: ReplicaSet, prompt: list[int], salt: str | None) -> tuple[int, int, list[int], int]:
    """(replica, router's matched tokens, answer tokens, cached_tokens) of one request."""
    async def main():
        rid, stream = group.submit(prompt, salted(salt))
        route = group.records.live[rid].route
        tokens, out = [], None
        while out is None or not out.finished:
            out = await group.next_output(stream)
            tokens += out.new_token_ids
        return route.replica, route.matched_tokens, tokens, out.usage.cached_tokens

    return run(main())


@contextmanager
def busier(group: ReplicaSet, replica: int) -> Iterator[None]:
    """One phantom live request counted on ``replica``: the other is the least loaded."""
    route = group.router.choose([1, 2, 3], exclude=frozenset({1 - replica}))
    assert route is not None and route.replica == replica
    try:
        yield
    finally:
        group.router.finished(route)


def full_blocks(num_tokens: int) -> int:
    return num_tokens // BLOCK * BLOCK


def test_tenants_with_the_same_prompt_are_routed_by_their_own_keys_and_turns_go_home(replicas, single):
    first = list(single.generate([TENANT_PROMPT], salted(None))[0].token_ids)
    history = TENANT_PROMPT + first + NEXT_TURN
    second = list(single.generate([history], salted(None))[0].token_ids)

    alice_home, matched, tokens, cached = tenant_answer(replicas, TENANT_PROMPT, ALICE)
    assert (matched, tokens, cached) == (0, first, 0)
    bob_expected_home = 1 - alice_home

    # Bob's identical prompt: Alice's replica holds those tokens, but in her namespace. Made
    # the busier one, it must not draw him; nothing of hers is reused.
    with busier(replicas, alice_home):
        bob_home, matched, tokens, cached = tenant_answer(replicas, TENANT_PROMPT, BOB)
    assert (bob_home, matched, tokens, cached) == (bob_expected_home, 0, first, 0)

    # Alice's second turn goes home even when home is the busier replica; Bob's replica holds
    # the very same tokens (his), which must not count for her. Her whole first turn but
    # its last token (sampled, never computed) is reused.
    computed = len(TENANT_PROMPT) + len(first) - 1
    with busier(replicas, alice_home):
        replica, matched, tokens, cached = tenant_answer(replicas, history, ALICE)
    assert (replica, matched, tokens) == (alice_home, full_blocks(computed), second)
    assert len(TENANT_PROMPT) <= cached <= computed

    # The same for Bob, towards his replica.
    with busier(replicas, bob_home):
        replica, matched, tokens, cached = tenant_answer(replicas, history, BOB)
    assert (replica, matched, tokens) == (bob_home, full_blocks(computed), second)
    assert len(TENANT_PROMPT) <= cached <= computed

    # A request of no tenant's namespace (the common one) matches neither.
    with busier(replicas, alice_home):
        replica, matched, tokens, cached = tenant_answer(replicas, history, None)
    assert (replica, matched, tokens, cached) == (bob_home, 0, second, 0)

    # And a third tenant probing with Alice's exact history gets no hit anywhere.
    carol = prefix_namespace(Tenant("carol"), None, shared=False)
    _, matched, tokens, cached = tenant_answer(replicas, history, carol)
    assert (matched, tokens, cached) == (0, second, 0)
    run(replicas.check_block_accounting())


def test_a_killed_replica_s_streams_finish_with_the_same_tokens_on_the_other(replicas, single):
    """Kill the replica that runs a greedy, a seeded sampled and a constrained request
    mid-stream: all finish with the single engine's tokens (resubmitted from their tokens;
    the grammar replays the answer so far), ``/v1/requests`` shows a resumed request as
    its client sent it, and Ray's restart of the replica puts it back in the set.

    Two conversation handles there, one generating a greedy and one a seeded sampled
    answer, move to the other replica with their answers: each conversation is opened
    there from the head's copy of its tokens plus the answer so far, and the answer goes
    on as a session request with ``output_offset``, so the stream pauses and continues
    with the single engine's tokens; afterwards the conversation holds exactly prompt +
    whole answer and its next turn is token-exact, reusing its K/V."""
    sampled = SamplingParams(max_tokens=40, temperature=1.1, top_p=0.9, seed=77, ignore_eos=True)
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=40, temperature=0, constraint=Constraint.json_schema(SCHEMA))
    # A shared prefix of two blocks: the router puts the others where the first runs.
    prompts = ([9, 8, 7, 6, 5, 4, 3, 2, 1], [9, 8, 7, 6, 5, 4, 3, 2, 50, 51], [9, 8, 7, 6, 5, 4, 3, 2, 60],
               [9, 8, 7, 6, 5, 4, 3, 2, 70, 71, 72])
    params = (greedy, sampled, constrained, ENDLESS)
    expected = [list(o.token_ids) for o in single.generate(list(prompts[:3]), list(params[:3]))]
    conversations = ([9, 8, 7, 6, 5, 4, 3, 2, 80], [9, 8, 7, 6, 5, 4, 3, 2, 81, 82], [9, 8, 7, 6, 5, 4, 3, 2, 83])
    conv_params = (greedy, sampled, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    expected += [list(o.token_ids) for o in single.generate(list(conversations[:2]), list(conv_params[:2]))]

    async def main():
        streams = [replicas.submit(p, q) for p, q in zip(prompts, params, strict=True)]
        sessions = [replicas.open_conversation(c) for c in conversations]
        streams += [replicas.submit((), q, conversation_id=s) for s, q in zip(sessions, conv_params, strict=True)]
        victim = replicas.records.live[streams[0][0]].replica
        assert all(replicas.records.live[rid].replica == victim for rid, _ in streams)
        tokens = [[] for _ in streams]
        outs = [None for _ in streams]
        while min(len(t) for t in tokens) < 6:
            for k, (_, stream) in enumerate(streams):
                if len(tokens[k]) < 6:
                    outs[k] = await replicas.next_output(stream)
                    tokens[k] += outs[k].new_token_ids
        ray.kill(replicas.actors[victim], no_restart=False)
        endless_id, endless = streams[3]
        while replicas.records.live[endless_id].resumes == 0 or len(tokens[3]) <= replicas.records.live[endless_id].offset:
            outs[3] = await replicas.next_output(endless)
            tokens[3] += outs[3].new_token_ids
        resumed = replicas.records.live[endless_id]
        listed = {info.request_id: info for info in replicas.list_requests()}[endless_id]
        sent = (len(resumed.prompt), resumed.offset)
        replicas.abort(endless_id)
        # The third conversation's consumer, once its answer has resumed, says it was handed
        # only 3 tokens (fewer than the new replica got in its prompt): both copies keep 3.
        cut_id, cut = streams[6]
        assert replicas.records.live[cut_id].offset > 3  # resubmitted at the loss, with the answer so far
        replicas.abort(cut_id, delivered=3)
        for k, (_, stream) in enumerate(streams):
            while not outs[k].finished:
                outs[k] = await replicas.next_output(stream)
                tokens[k] += outs[k].new_token_ids
        after = []
        for session in sessions:
            conv = Conversation(replicas, session)
            held, mirror = await conv.tokens(), list(replicas.records.conversations[session].tokens)
            moved_to = replicas.records.conversations[session].replica
            await conv.prompt([1, 2, 3])
            went_on = [o async for o in conv.generate(GREEDY)][-1]
            await conv.close()
            after.append((held, mirror, moved_to, went_on))
        return victim, tokens, outs, listed, sent, after

    victim, tokens, outs, listed, (prompt_len, offset), after = run(main())
    assert tokens[:3] == expected[:3]
    assert [o.finish_reason for o in outs[:2]] == [FinishReason.LENGTH, FinishReason.LENGTH]
    assert outs[2].finish_reason == expected_finish(single, prompts[2], constrained)
    assert all(o.usage.completion_tokens == 40 for o in outs[:2])
    # As sent: the original prompt (not prompt + partial answer), the whole answer so far.
    assert offset >= 6 and listed.prompt_tokens == prompt_len == len(prompts[3])
    assert listed.completion_tokens >= offset and listed.prompt_computed <= prompt_len
    assert outs[3].finish_reason == FinishReason.CANCELLED
    for k, (conversation, (held, mirror, moved_to, went_on)) in enumerate(zip(conversations[:2], after[:2], strict=True)):
        # The stream paused at the loss and went on with the uninterrupted answer's tokens.
        assert tokens[4 + k] == expected[3 + k] and outs[4 + k].finish_reason == FinishReason.LENGTH
        assert outs[4 + k].usage.prompt_tokens == len(conversation)
        assert outs[4 + k].usage.completion_tokens == 40
        assert held == mirror == conversation + expected[3 + k] and moved_to == 1 - victim
        assert list(went_on.token_ids) == list(single.generate([held + [1, 2, 3]], GREEDY)[0].token_ids)
        assert len(held) - 1 <= went_on.usage.cached_tokens <= len(held)  # its K/V went on with it
    held, mirror, moved_to, went_on = after[2]
    assert held == mirror == conversations[2] + tokens[6][:3] and moved_to == 1 - victim
    assert list(went_on.token_ids) == list(single.generate([held + [1, 2, 3]], GREEDY)[0].token_ids)
    assert replicas.lost[victim] == 1 and replicas.resubmitted >= 7
    wait_for(lambda: replicas.router.is_up(victim), timeout=60)
    again = run(collect(replicas, PROMPTS[0], GREEDY))[1]
    assert again == list(single.generate([PROMPTS[0]], GREEDY)[0].token_ids)
    run(replicas.check_block_accounting())


def expected_finish(engine: Engine, prompt, params) -> FinishReason:
    return engine.generate([prompt], params)[0].finish_reason


def test_a_hung_replica_is_replaced_and_its_stream_finishes_with_the_same_tokens(replicas, single):
    """A forward that never returns (the actor still answers polls): no step finishes for
    hang_timeout_s while the replica holds a request, so it is replaced like a lost one."""
    prompt = [31, 41, 59, 26, 53, 58, 97]
    expected = list(single.generate([prompt], GREEDY)[0].token_ids)

    async def main():
        rid, stream = replicas.submit(prompt, GREEDY, request_id="hang-1")
        victim = replicas.records.live[rid].replica
        tokens, out = [], None
        while out is None or not out.finished:
            out = await replicas.next_output(stream)
            tokens += out.new_token_ids
        return victim, tokens, out

    lost_before = list(replicas.lost)
    started = time.monotonic()
    victim, tokens, out = run(main())
    assert tokens == expected and out.finish_reason == FinishReason.LENGTH
    assert replicas.lost[victim] == lost_before[victim] + 1
    assert time.monotonic() - started < 30
    wait_for(lambda: replicas.router.is_up(victim), timeout=60)
    run(replicas.check_block_accounting())


def test_when_no_replica_is_left_the_stream_ends_with_a_clear_error(replicas):
    """Last in the module: every replica of the set killed for good (Ray may not restart
    them) while one streams an answer and another a conversation's: both end with
    finish_reason "error" naming the loss, after the tokens already delivered; the
    conversation then says it was lost."""
    group = replicas
    lost_before = list(group.lost)

    async def main():
        rid, stream = group.submit([4, 4, 4, 4, 4], ENDLESS)
        conv = Conversation.open(group, [6, 6, 6, 6])
        _, answer = group.submit((), ENDLESS, conversation_id=conv.id)
        tokens, out = [], await group.next_output(stream)
        tokens += out.new_token_ids
        answered = await group.next_output(answer)
        for actor in group.actors:
            ray.kill(actor, no_restart=True)
        while not out.finished:
            out = await group.next_output(stream)
            tokens += out.new_token_ids
        while not answered.finished:
            answered = await group.next_output(answer)
        with pytest.raises(EngineError, match="was lost with its replica and no replica is left"):
            await conv.tokens()
        return tokens, out, answered

    tokens, out, answered = run(main())
    assert answered.finish_reason == FinishReason.ERROR and "no replica is left" in answered.error
    assert out.finish_reason == FinishReason.ERROR
    # Lost with its replica, it may have been resubmitted to the other before that one's loss was seen.
    assert "no replica is left" in out.error and re.search(r"replica [01] was lost", out.error), out.error
    assert out.token_ids == tuple(tokens) and len(tokens) < ENDLESS.max_tokens
    assert [n - b for n, b in zip(group.lost, lost_before, strict=True)] == [1, 1]
    assert not group.router.is_up(0) and not group.router.is_up(1)
    assert not group.is_alive and group.health().state == "recovering"
