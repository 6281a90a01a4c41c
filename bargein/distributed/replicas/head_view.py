"""What the server reads as ``engine.engine`` of a replica set (to be replaced by the
EngineClient protocol's ``describe()``)."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from bargein.distributed.replicas.actor import ModelFacts
from bargein.engine.grammar import Grammars
from bargein.engine.request import CancelReason, FinishReason
from bargein.engine.runner import RunnerHealth
from bargein.engine.stats import EngineCounters, EngineStats, RequestInfo

if TYPE_CHECKING:
    from bargein.distributed.replicas.facade import ReplicaSet


class HeadView:
    """What the server reads as ``engine.engine``: the model's facts and the merged views."""

    supports_partial_block_reuse = True

    def __init__(self, replicas: ReplicaSet, facts: ModelFacts):
        self._set = replicas
        self.tokenizer = facts.tokenizer
        self.model_name = facts.model_name
        self.model_config = facts.model_config
        self.config = facts.config
        self.max_model_len = facts.max_model_len
        self.eos_token_ids = facts.eos_token_ids
        self.supports_partial_block_reuse = facts.supports_partial_block_reuse
        self.counters = EngineCounters()  # filled from the replicas' batches (for /metrics)
        self.runner = self  # ``runner.cluster_info`` is what /v1/cluster reads
        # The server compiles and checks constraints here (a 400 before any replica sees
        # them); each replica compiles its own for the matcher that runs with the request.
        self.grammars = Grammars(facts.tokenizer, facts.model_config.vocab_size, facts.eos_token_ids)

    def finish(self, request_id: str, reason: FinishReason, *, delivered: int) -> CancelReason | None:
        return self._set.finish(request_id, reason, delivered=delivered)

    def live_request_ids(self) -> list[str]:
        return list(self._set.records.live)

    def list_requests(self) -> list[RequestInfo]:
        return self._set.list_requests()

    def check_block_accounting(self) -> None:
        self._set.check_block_accounting()

    def stats(self) -> EngineStats:
        return self._set.merged_stats()

    def cluster_info(self) -> dict[str, Any]:
        return self._set.cluster_info()

    def runner_health(self) -> RunnerHealth:
        """``/health``: ok while every replica is up; "recovering" (requests still run on
        the others) while some are being restarted. None up: the set is not alive, which
        ``/health`` reports as unavailable before asking this."""
        down = [i for i in range(len(self._set.actors)) if not self._set.router.is_up(i)]
        if not down:
            return RunnerHealth()
        return RunnerHealth("recovering", f"replica {', '.join(map(str, down))} lost, being restarted")

    def new_request_id(self) -> str:
        return f"req-{uuid.uuid4().hex[:16]}"
