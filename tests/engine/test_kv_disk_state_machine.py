"""The conversation state machine (tests/engine/test_conversation_state_machine.py) with the disk
tier on: its small pool evicts, so blocks are spilled, and conversations whose blocks
were reclaimed are read back from disk while other answers go on. C3, C5 and the
transition table must hold exactly as without the tier."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings

from bargein.config import CacheConfig, EngineConfig, SchedulerConfig
from bargein.engine.async_engine import AsyncEngine
from bargein.engine.device import build_model
from bargein.engine.engine import Engine
from tests.engine.test_conversation_state_machine import ConversationMachine
from tests.tiny_engine import TINY, ByteTokenizer, tiny_weights


class DiskConversationMachine(ConversationMachine):
    def __init__(self) -> None:
        super().__init__()
        self.engine.engine.scheduler.on_transition = None
        self.run(self.engine.shutdown())  # the base machine's engine: replaced by one with a tier
        self.directory = Path(tempfile.mkdtemp(prefix="bargein-kv-disk-"))
        config = EngineConfig(
            cache=CacheConfig(block_size=4, num_blocks=24, kv_disk_dir=str(self.directory), kv_disk_bytes=1 << 30),
            scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8),
            device="cpu", dtype="float32", cuda_graphs=False, precision=self.precision)
        model = build_model(TINY, dict(tiny_weights(0)), config, max_positions=TINY.max_position_embeddings)
        core = Engine(model, ByteTokenizer(), config, model_name="tiny", model_identity="tiny-seed-0")
        assert core.disk is not None
        self.transitions = []
        core.scheduler.on_transition = self.transitions.append
        self.engine = AsyncEngine(core).start()

    def teardown(self) -> None:
        core = self.engine.engine
        try:
            super().teardown()
            core.close()  # the loop has stopped: every full block is written
            assert core.disk is None
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)


DiskConversationMachine.TestCase.settings = settings(
    max_examples=10, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_conversations_with_disk_tier = DiskConversationMachine.TestCase
