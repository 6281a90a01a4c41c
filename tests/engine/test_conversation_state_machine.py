"""Randomized state machine over conversations (contracts C3 and C5, and the lifecycle).

Any interleaving of prompt, generate (stopped at a random point, by cancel or by the
consumer walking away), several answers at once (so some wait for a slot while the KV
pool is small), fork, rewind, save, load and close must keep the block accounting exact,
and every conversation's tokens equal to exactly what its caller gave and was handed.
When everything is closed, no block is referenced. Every status change the scheduler
makes is recorded: each must be in the transition table, and each request's changes
must form one path from WAITING (nothing changes a status behind the table's back).
"""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from bargein.engine.async_engine import AsyncEngine
from bargein.engine.conversation import Conversation
from bargein.engine.engine import EngineError
from bargein.engine.request import TRANSITIONS, FinishReason, RequestStatus
from bargein.engine.sampling import SamplingParams
from tests.tiny_engine import tiny_engine

TOKENS = st.lists(st.integers(0, 255), min_size=1, max_size=12)


class ConversationMachine(RuleBasedStateMachine):
    conversations = Bundle("conversations")
    precision = "exact"

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        # A small pool, so preemption and reclaiming idle conversations happen too, and
        # two slots, so answers started together wait for one.
        core = tiny_engine(num_blocks=24, block_size=4, max_num_batched_tokens=8, max_num_seqs=2,
                           precision=self.precision)
        self.transitions: list[tuple] = []
        core.scheduler.on_transition = self.transitions.append  # called in the engine thread
        self.engine = AsyncEngine(core).start()
        self.expected: dict[str, list[int]] = {}  # what each caller gave and was handed
        self.live: dict[str, Conversation] = {}

    def run(self, coro):
        return self.loop.run_until_complete(asyncio.wait_for(coro, 30))

    def teardown(self) -> None:
        async def close_all():
            for conv in list(self.live.values()):
                await conv.close()
            await self.engine.call(self.engine.engine.check_block_accounting)
            stats = await self.engine.stats()
            assert stats.kv_blocks_used == 0, "blocks still referenced after every conversation closed"
            assert stats.kv_blocks_free + stats.kv_blocks_cached == stats.kv_blocks_total
            await self.engine.shutdown()

        self.run(close_all())
        self.loop.close()
        self.check_transitions(finished=True)

    def check_transitions(self, finished: bool = False) -> None:
        status: dict[str, RequestStatus] = {}
        for rid, old, event, new in list(self.transitions):
            assert TRANSITIONS[old][event] == new, (rid, old, event, new)
            assert status.get(rid, RequestStatus.WAITING) == old, f"{rid}: status changed outside the table"
            status[rid] = new
        if finished:
            assert all(s.is_finished for s in status.values()), status

    # -- rules ----------------------------------------------------------------------
    @rule(target=conversations, tokens=TOKENS)
    def open(self, tokens):
        conv = Conversation.open(self.engine, tokens)
        self.expected[conv.id] = list(tokens)
        self.live[conv.id] = conv
        return conv

    @rule(conv=conversations, tokens=TOKENS)
    def prompt(self, conv, tokens):
        if conv.id not in self.live:
            return
        try:
            self.run(conv.prompt(tokens))
        except EngineError as exc:  # the context is full: nothing was added
            assert "context holds" in str(exc)
            return
        self.expected[conv.id] += tokens

    @rule(conv=conversations, stop_after=st.integers(0, 6), how=st.sampled_from(["cancel", "walk_away", "none"]),
          max_tokens=st.integers(1, 8))
    def generate(self, conv, stop_after, how, max_tokens):
        if conv.id not in self.live:
            return
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

        async def consume():
            handed: list[int] = []
            agen = conv.generate(params)
            try:
                if how == "cancel" and stop_after == 0:
                    first = asyncio.ensure_future(agen.__anext__())
                    await asyncio.sleep(0)  # the request is queued or mid-prompt
                    conv.cancel()
                    out = await first
                    handed += out.new_token_ids
                    if out.finished:
                        return handed, out
                async for out in agen:
                    handed += out.new_token_ids
                    if out.finished:
                        return handed, out
                    if len(handed) >= stop_after:
                        if how == "cancel":
                            conv.cancel()
                        elif how == "walk_away":
                            return handed, None
            finally:
                await agen.aclose()
            return handed, None

        was_empty = not self.expected[conv.id]
        handed, final = self.run(consume())
        self.expected[conv.id] += handed
        if final is not None:
            if was_empty:  # nothing to continue from: refused, and the conversation is unchanged
                assert final.finish_reason == FinishReason.ERROR and "empty" in final.error
            else:
                assert final.finish_reason in (FinishReason.LENGTH, FinishReason.CANCELLED), final
            assert list(final.token_ids) == handed

    @rule(target=conversations, conv=conversations)
    def fork(self, conv):
        if conv.id not in self.live:
            return conv
        child = self.run(conv.fork())
        self.expected[child.id] = list(self.expected[conv.id])
        self.live[child.id] = child
        return child

    @rule(conv=conversations, n=st.integers(0, 10))
    def rewind(self, conv, n):
        if conv.id not in self.live:
            return
        n = min(n, len(self.expected[conv.id]))
        self.run(conv.rewind(n))
        del self.expected[conv.id][len(self.expected[conv.id]) - n:]

    @rule(target=conversations, conv=conversations)
    def save_and_load(self, conv):
        if conv.id not in self.live:
            return conv
        state = self.run(conv.save())
        loaded = Conversation.load(self.engine, state)
        self.expected[loaded.id] = list(state.token_ids)
        self.live[loaded.id] = loaded
        return loaded

    @precondition(lambda self: self.live)
    @rule(conv=consumes(conversations))
    def close(self, conv):
        if conv.id not in self.live:
            return
        self.run(conv.close())
        del self.live[conv.id]

    # -- invariants -----------------------------------------------------------------
    @rule(convs=st.lists(conversations, min_size=2, max_size=3, unique_by=id), max_tokens=st.integers(1, 12))
    def generate_together(self, convs, max_tokens):
        """Answers started at once: with two slots one waits, holding no blocks the running
        ones need; all finish (none fails for a KV pool that is too small)."""
        convs = [c for c in convs if c.id in self.live and self.expected[c.id]]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

        async def consume(conv):
            handed: list[int] = []
            async for out in conv.generate(params):
                handed += out.new_token_ids
            return handed, out

        async def together():
            return await asyncio.gather(*(consume(c) for c in convs))

        for conv, (handed, final) in zip(convs, self.run(together()), strict=True):
            assert final.finish_reason == FinishReason.LENGTH, final
            assert list(final.token_ids) == handed
            self.expected[conv.id] += handed

    @invariant()
    def tokens_are_exactly_what_was_given_and_handed(self):
        for cid, conv in self.live.items():
            assert self.run(conv.tokens()) == self.expected[cid]

    @invariant()
    def block_accounting_is_exact(self):
        self.run(self.engine.call(self.engine.engine.check_block_accounting))

    @invariant()
    def every_transition_is_in_the_table(self):
        self.check_transitions()


ConversationMachine.TestCase.settings = settings(
    max_examples=15, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_conversations = ConversationMachine.TestCase


class FastConversationMachine(ConversationMachine):
    """The same machine in the fast precision (C3 and C5 do not depend on the arithmetic,
    but its K/V is float16 and its kernels other: fewer examples, the same rules)."""

    precision = "fast"


FastConversationMachine.TestCase.settings = settings(
    max_examples=6, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_conversations_fast = FastConversationMachine.TestCase
