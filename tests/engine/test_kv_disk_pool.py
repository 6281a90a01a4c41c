"""The block pool's disk hooks: spill candidates for every full block whose contents are
dropped, the lookup of full blocks past a memory hit, and adopting blocks read back;
C5 exact throughout, and the K/V a sequence reuses always that of its own tokens.

The randomized machine simulates the K/V: each slot of a block holds the token prefix
it was computed for, so serving a block to the wrong tokens, copying K/V out of a block
after it was overwritten, or writing an adopted payload into the wrong id shows up as a
slot that does not match its sequence. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from bargein.engine.block_keys import ChainBlock, chain_hash
from bargein.engine.blocks import BlockPool, BlockTable, OutOfBlocks

Slot = tuple[int, ...] | None  # the prefix whose last token's K/V a slot holds


class SimulatedKV:
    """Block id -> slots, and a dict for a disk: what a runner and a DiskTier would hold."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.mem: list[list[Slot]] = [[None] * pool.block_size for _ in range(pool.num_blocks)]
        self.disk: dict[bytes, tuple[ChainBlock, tuple[Slot, ...]]] = {}
        self.spilled = 0

    def spill(self) -> None:
        """Copies out every spill candidate (before anything writes their ids)."""
        for candidate in self.pool.drain_spills():
            payload = tuple(self.mem[candidate.block_id])
            block = candidate.block
            assert all(s is not None and s[-1] == t for s, t in zip(payload, block.tokens, strict=True)), \
                "a spill candidate's id no longer holds its K/V"
            self.disk.setdefault(block.key, (block, payload))
            self.spilled += 1

    def apply(self, copies: list[tuple[int, int]]) -> None:
        self.spill()
        for src, dst in copies:
            self.mem[dst] = list(self.mem[src])

    def forward(self, table: BlockTable, tokens: list[int], start: int) -> None:
        bs = self.pool.block_size
        for p in range(start, len(tokens)):
            self.mem[table.block_ids[p // bs]][p % bs] = tuple(tokens[:p + 1])

    def load_from_disk(self, tokens: list[int], max_tokens: int) -> int:
        """The engine's disk path: look up, adopt, copy spills out, then write payloads."""
        wanted = self.pool.uncached_full_blocks(tokens, max_tokens)
        found = []
        for block in wanted:  # a leading run, as DiskTier.present and a load give
            if block.key not in self.disk or self.disk[block.key][0] != block:
                break
            found.append(block)
        adopted = self.pool.adopt_loaded(found)
        self.spill()
        for block, block_id in adopted:
            self.mem[block_id] = list(self.disk[block.key][1])
        return len(adopted)

    def check_reuse(self, table: BlockTable, tokens: list[int], upto: int) -> None:
        bs = self.pool.block_size
        for p in range(upto):
            assert self.mem[table.block_ids[p // bs]][p % bs] == tuple(tokens[:p + 1]), f"position {p}"


@dataclass
class Seq:
    tokens: list[int]
    table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0


class PoolWithDisk(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(num_blocks=6, block_size=2)
        self.pool.track_spills()
        self.kv = SimulatedKV(self.pool)
        self.seqs: list[Seq] = []
        self.history: list[list[int]] = []  # sequences run before: the likely disk hits
        self.disk_hits = 0

    def _extend(self, seq: Seq, upto: int) -> bool:
        try:
            copies = self.pool.ensure_writable(seq.table, seq.num_computed, upto)
        except OutOfBlocks:
            return False
        self.kv.apply(copies)
        self.kv.forward(seq.table, seq.tokens[:upto], seq.num_computed)
        seq.num_computed = upto
        self.pool.register_full_blocks(seq.table, seq.tokens, upto)
        return True

    @precondition(lambda self: len(self.seqs) < 3)
    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=12), use_disk=st.booleans())
    def run(self, tokens: list[int], use_disk: bool) -> None:
        self.history.append(list(tokens))
        if use_disk:
            self.disk_hits += self.kv.load_from_disk(tokens, len(tokens) - 1)
        seq = Seq(list(tokens))
        hit, copies = self.pool.match_prefix(seq.table, tokens, len(tokens) - 1)
        self.kv.apply(copies)
        self.kv.check_reuse(seq.table, tokens, hit)
        seq.num_computed = hit
        if self._extend(seq, len(tokens)):
            self.seqs.append(seq)
        else:
            self.pool.release(seq.table)

    @precondition(lambda self: self.history and len(self.seqs) < 3)
    @rule(i=st.integers(0, 50), more=st.lists(st.integers(0, 2), max_size=3))
    def revisit(self, i: int, more: list[int]) -> None:
        """A conversation comes back (after its blocks were evicted): the disk's turn."""
        self.run(self.history[i % len(self.history)] + more, use_disk=True)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 2), more=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def extend(self, i: int, more: list[int]) -> None:
        seq = self.seqs[i % len(self.seqs)]
        seq.tokens += more
        if not self._extend(seq, len(seq.tokens)):
            del seq.tokens[seq.num_computed:]
        self.history.append(list(seq.tokens))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 2))
    def release(self, i: int) -> None:
        seq = self.seqs.pop(i % len(self.seqs))
        self.pool.release(seq.table, seq.tokens, seq.num_computed)

    @precondition(lambda self: self.seqs and len(self.seqs) < 3)
    @rule(i=st.integers(0, 2))
    def fork(self, i: int) -> None:
        src = self.seqs[i % len(self.seqs)]
        self.seqs.append(Seq(list(src.tokens), self.pool.fork(src.table), src.num_computed))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 2), keep=st.integers(0, 9))
    def rewind(self, i: int, keep: int) -> None:
        seq = self.seqs[i % len(self.seqs)]
        n = min(keep, len(seq.tokens))
        self.pool.truncate(seq.table, n)
        del seq.tokens[n:]
        seq.num_computed = min(seq.num_computed, n)

    @precondition(lambda self: not self.seqs)
    @rule()
    def lose_kv(self) -> None:
        """A pipeline stage died: memory forgets everything (nothing to spill), disk stays."""
        self.pool.forget_contents()
        assert self.pool.drain_spills() == []
        self.kv.mem = [[None] * self.pool.block_size for _ in range(self.pool.num_blocks)]

    @invariant()
    def accounting_is_exact(self) -> None:
        self.pool.check_invariants([s.table for s in self.seqs])
        assert self.pool.num_free + self.pool.num_referenced + self.pool.num_cached == self.pool.num_blocks

    @invariant()
    def every_live_sequence_holds_its_own_kv(self) -> None:
        for seq in self.seqs:
            self.kv.check_reuse(seq.table, seq.tokens, seq.num_computed)

    @invariant()
    def disk_blocks_chain_to_their_keys(self) -> None:
        for key, (block, payload) in self.kv.disk.items():
            assert chain_hash(block.parent, block.tokens) == key
            assert [s[-1] for s in payload] == list(block.tokens)

    def teardown(self) -> None:
        for seq in self.seqs:
            self.pool.release(seq.table, seq.tokens, seq.num_computed)
        self.pool.check_invariants([])
        assert self.pool.num_referenced == 0


PoolWithDisk.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
test_pool_with_disk = PoolWithDisk.TestCase


def filled(pool: BlockPool, tokens: list[int]) -> BlockTable:
    table = BlockTable()
    pool.ensure_writable(table, 0, len(tokens))
    pool.register_full_blocks(table, tokens, len(tokens))
    return table


def test_eviction_reports_full_blocks_only_and_only_when_tracking() -> None:
    pool = BlockPool(3, 2)
    pool.release(filled(pool, [1, 2, 3, 4, 5]), [1, 2, 3, 4, 5], 5)  # 2 full + 1 cached partial
    assert pool.spills is None
    pool.track_spills()
    pool.release(filled(pool, [7, 7, 7, 7, 7, 7]))  # takes every block: evicts all three
    spills = pool.drain_spills()
    k1 = chain_hash(None, (1, 2))
    assert [(s.block.key, s.block.parent, s.block.tokens) for s in spills] == [
        (chain_hash(k1, (3, 4)), k1, (3, 4)), (k1, None, (1, 2))]  # tail first, as released; no partial
    assert pool.drain_spills() == []
    pool.check_invariants([])


def test_a_registered_block_overwritten_after_a_rewind_is_reported() -> None:
    pool = BlockPool(4, 2)
    pool.track_spills()
    table = filled(pool, [1, 2, 3, 4])
    pool.truncate(table, 3)  # rewound into the second block, which is ours alone
    pool.ensure_writable(table, 3, 4)  # about to overwrite it
    (spill,) = pool.drain_spills()
    assert spill.block.tokens == (3, 4) and spill.block_id == table.block_ids[1]
    pool.check_invariants([table])


def test_lookup_starts_after_the_memory_hit_and_adopted_blocks_are_hit() -> None:
    pool = BlockPool(6, 2)
    pool.track_spills()
    tokens = [1, 2, 3, 4, 5, 6, 7]
    pool.release(filled(pool, tokens[:2]))
    wanted = pool.uncached_full_blocks(tokens, len(tokens) - 1)
    k1 = chain_hash(None, (1, 2))
    k2 = chain_hash(k1, (3, 4))
    assert wanted == [ChainBlock(k2, k1, (3, 4)), ChainBlock(chain_hash(k2, (5, 6)), k2, (5, 6))]
    assert pool.uncached_full_blocks(tokens, 3) == []  # block 2 reaches past max_tokens
    adopted = pool.adopt_loaded(wanted)
    assert [b for b, _ in adopted] == wanted and pool.num_cached == 3
    pool.check_invariants([])
    table = BlockTable()
    hit, copies = pool.match_prefix(table, tokens, len(tokens) - 1)
    assert hit == 6 and copies == [] and table.block_ids[1:] == [i for _, i in adopted]
    assert pool.adopt_loaded(wanted) == []  # already registered: nothing to write
    pool.check_invariants([table])


def test_adopt_leaves_a_reserve_and_never_evicts_what_it_adopted() -> None:
    pool = BlockPool(3, 2)
    pool.track_spills()
    held = filled(pool, [9, 9])  # one block referenced: two available
    chain, parent = [], None
    for t in range(4):
        key = chain_hash(parent, (t, t))
        chain.append(ChainBlock(key, parent, (t, t)))
        parent = key
    adopted = pool.adopt_loaded(chain)  # room for 2, one kept in reserve
    assert [b for b, _ in adopted] == chain[:1] and pool.num_available == 2
    pool.check_invariants([held])


def test_adopting_never_evicts_a_block_given_in_the_same_call() -> None:
    """A chain whose held block comes after a missing one, in a pool of cached blocks: the
    takes evict only blocks not given (the state machine above once saw a block adopted
    in a call evicted by that call's next take, its spill copying stale K/V out)."""
    pool = BlockPool(3, 2)
    pool.track_spills()

    def chain(parent: bytes | None, tokens: tuple[int, ...]) -> ChainBlock:
        return ChainBlock(chain_hash(parent, tokens), parent, tokens)

    x, y, z = chain(None, (1, 1)), chain(None, (2, 2)), chain(None, (3, 3))
    for block in (x, y, z):  # cached, x the least recently used
        assert len(pool.adopt_loaded([block], reserve=0)) == 1
    assert pool.drain_spills() == [] and pool.num_free == 0
    n1, n2 = chain(None, (4, 4)), chain(x.key, (5, 5))
    adopted = pool.adopt_loaded([n1, x, n2, n2], reserve=0)
    assert [block for block, _ in adopted] == [n1, n2]  # x held, n2 given twice adopted once
    assert [candidate.block for candidate in pool.drain_spills()] == [y, z]
    assert pool.uncached_full_blocks([4, 4], 2) == [] and pool.uncached_full_blocks([1, 1, 5, 5], 4) == []
    pool.check_invariants([])
    assert pool.num_cached == 3 and pool.num_referenced == 0
