"""EngineClient: the one interface the server, ``Conversation`` and the CLI use.

:class:`~bargein.engine.async_engine.AsyncEngine` (one engine stepped by a thread of this
process) and the replica set (:class:`bargein.distributed.replicas.ReplicaSet`, N engines on
a Ray cluster) implement it. Everything a caller learns about the engine comes from
``describe()`` (:class:`EngineInfo`), ``cluster()`` (a :class:`RunnerInfo` or a
:class:`ReplicaSetInfo`), ``stats()``, ``requests()`` and ``health()``: plain data. A caller
never reaches through an engine client to what is behind it.

Contract (what a caller may rely on):

- ``submit`` checks a request (``bargein.engine.admission.admit``: one place, one message per
  rule) and returns its id and stream at once, or raises ``EngineError`` /
  ``UnsupportedGrammar`` / ``EngineDeadError``; call it from a running event loop.
- ``abort`` is thread-safe, idempotent and never raises (C6); ``delivered`` cuts the
  sequence to what the consumer was handed (C3), even after the request finished.
- ``finish`` ends a request for a reason its consumer found (a stop string).
- Conversation operations are typed messages (:mod:`bargein.engine.messages`), applied in
  the order they were sent with everything else; ``open_conversation`` returns the id at
  once (the open is queued first).
- ``cluster()`` and ``register_metrics`` may block on remote parts: call them off the loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from bargein.engine.grammar import Grammars
from bargein.engine.messages import ConversationMessage
from bargein.engine.request import AbortResult, CancelReason, FinishReason, RequestOutput
from bargein.engine.runner import RunnerHealth, RunnerInfo
from bargein.engine.sampling import SamplingParams
from bargein.engine.stats import EngineCounters, EngineStats, RequestInfo, StepRecord
from bargein.engine.streams import RequestStream

T = TypeVar("T")


@dataclass(frozen=True)
class EngineInfo:
    """The model an engine client serves, and how it runs."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    block_size: int
    num_blocks: int  # of one engine (each replica has this many)
    precision: str  # "exact" | "fast"
    pipeline_stages: int = 0  # each engine a pipeline of this many stages on Ray (0: in process)
    replicas: int = 0  # engines behind this client (0: one, in this process)
    # A prefix hit covers every matching token, a partly filled last block included (C7).
    supports_partial_block_reuse: bool = True
    # A digest of the model's files (weights, tokenizer): what Conversation.save files carry
    # and load checks ("": unknown, e.g. in-memory weights without an identity).
    model_fingerprint: str = ""
    kv_fingerprint: str = ""  # the disk tier's full fingerprint digest ("": no tier)


@dataclass(frozen=True)
class ReplicaEntry:
    """One replica of a replica set as ``/v1/cluster`` shows it."""

    index: int
    routing: dict[str, Any]  # the router's view: up, load, routed, predicted hits, moves
    lost: int
    restarted: int
    node_id: str | None = None  # None: the replica did not answer (the rest is unknown)
    pid: int | None = None
    stats: EngineStats | None = None
    submitted: int = 0
    resumed: int = 0
    aborts: dict[str, int] | None = None
    dropped_late: int = 0
    evictions: int = 0
    weights_from: str | None = None
    weights_received_bytes: int = 0
    pipeline: RunnerInfo | None = None  # a replica that is a pipeline: its stages
    threads: int | None = None  # its compute threads
    wait_policy: str | None = None  # how they wait between kernels ("GOMP_SPINCOUNT=100")


@dataclass(frozen=True)
class ReplicaSetInfo:
    """A replica set: its replicas, routing and failovers."""

    replicas: tuple[ReplicaEntry, ...]
    stages_per_replica: int
    routing: str
    kv_blocks: int
    resubmitted: int
    dropped_late: int
    weights_shipped_bytes: int
    nodes_without_file: tuple[str, ...]


@runtime_checkable
class EngineClient(Protocol):
    """See the module doc."""

    tokenizer: Any
    grammars: Grammars  # the constraint compiler: a bad grammar is refused before any engine sees it
    counters: EngineCounters  # read with ``call`` (between steps)

    @property
    def is_alive(self) -> bool: ...

    def describe(self) -> EngineInfo: ...

    def start(self) -> EngineClient: ...

    async def shutdown(self, timeout: float = 30.0) -> None: ...

    def request_shutdown(self) -> None: ...

    # -- requests -----------------------------------------------------------------------
    def new_request_id(self) -> str: ...

    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               request_id: str | None = None, timeout: float | None = None,
               conversation_id: str | None = None,
               constraint_from: int | None = None) -> tuple[str, RequestStream]: ...

    async def next_output(self, stream: RequestStream) -> RequestOutput: ...

    def stream(self, request_id: str, stream: RequestStream, *,
               exit_reason: CancelReason = CancelReason.DISCONNECT) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str, reason: CancelReason = CancelReason.USER, *,
              delivered: int | None = None) -> AbortResult: ...

    def abort_all(self, reason: CancelReason = CancelReason.USER) -> list[str]: ...

    def finish(self, request_id: str, reason: FinishReason, *, delivered: int) -> CancelReason | None: ...

    # -- conversations ---------------------------------------------------------------------
    def open_conversation(self, token_ids: Sequence[int] = ()) -> str: ...

    async def conversation(self, message: ConversationMessage) -> Any: ...

    # -- reports --------------------------------------------------------------------------
    async def stats(self) -> EngineStats: ...

    async def requests(self) -> list[RequestInfo]: ...

    def live_request_ids(self) -> list[str]: ...

    def health(self) -> RunnerHealth: ...

    def cluster(self) -> RunnerInfo | ReplicaSetInfo: ...

    async def check_block_accounting(self) -> None: ...

    async def steps_after(self, index: int) -> list[StepRecord]: ...

    def register_metrics(self, registry: Any) -> None: ...

    def call_soon(self, fn: Callable[[], T]) -> Future: ...

    async def call(self, fn: Callable[[], T]) -> T: ...
