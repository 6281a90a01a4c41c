"""The model runner: a step plan in, logits of the sampled positions out.

It owns the KV cache tensors (one pair per layer) of the model stages it drives, and
turns the plan's plain data (token ids, positions, block tables) into the tensors and
:class:`~bargein.model.attention.AttentionMetadata` of one forward. It never decides
anything: block ids come from the scheduler.

The engine drives it through ``submit(plan)`` / ``collect()``, a seam that lets a runner
hold several plans at once (a pipeline of stages on several machines, each busy with a
different micro-batch). This in-process runner keeps one plan in flight: ``collect``
runs it. The scheduler never puts a sequence in two plans in flight.

Device: the caches live where the model does. A step's integers are gathered on the
host and copied to the device once per tensor; pure-decode steps on CUDA replay CUDA
graphs (``bargein.engine.decode_graphs``), everything else runs eagerly. The caches
hold one block more than the scheduler's pool: a scratch block that graph padding
writes to and no sequence ever owns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from bargein.config import ModelConfig
from bargein.engine.decode_graphs import DecodeGraphs
from bargein.engine.logits_buffer import LogitsBuffer
from bargein.engine.plan import StepPlan
from bargein.model.attention import AttentionMetadata
from bargein.model.llama import LlamaStage


@dataclass(frozen=True)
class StepResult:
    """A plan that ran, and float32 logits of its sampled positions (len(plan.sampled), vocab;
    a chunk with guesses has ``chunk.num_logits`` consecutive rows, see ``ScheduledChunk``).

    A runner may pick plain rows' tokens itself (``tokens``: plan row -> token id, as
    ``sampler.sample_rows`` does); ``logits`` then holds only the other rows, in plan order.
    ``logits`` is valid until the runner's next ``collect``: a runner may write every step's
    logits into the same memory (the in-process runner does, see ``LogitsBuffer``).
    """

    plan: StepPlan
    logits: torch.Tensor
    tokens: dict[int, int] | None = None


class StepFailed(Exception):
    """A plan's forward failed; ``plan`` is that plan, ``error`` says why in one line."""

    def __init__(self, plan: StepPlan, error: str):
        super().__init__(error)
        self.plan, self.error = plan, error


class KVLost(Exception):
    """The runner lost the K/V of every block (a pipeline stage died or hung) and every
    plan in flight with it; it is getting ready again (see ``RunnerHealth``). The message
    names what was lost."""


@dataclass(frozen=True)
class RunnerHealth:
    """Whether a runner can run plans: "ok"; "recovering" (plans wait: a lost part is
    being re-created); "degraded" (it could not be re-created in time: plans fail with
    ``message`` until it is)."""

    state: str = "ok"
    message: str | None = None


@dataclass(frozen=True)
class StageWork:
    """What a stage running elsewhere has done (a pipeline stage's counters)."""

    weights_from: str  # "file" (its node's copy) or "head" (shipped)
    weights_received_bytes: int
    plans: int
    tokens: int
    busy_s: float
    wait_s: float
    transfer_s: float  # receiving hidden states from the previous stage
    idle_fraction: float
    hidden_bytes_out: int


@dataclass(frozen=True)
class StageInfo:
    """One model stage of a runner: its layers and where it runs."""

    index: int
    layers: tuple[int, int]  # [start, end)
    node_address: str = "local"
    device: str | None = None  # a stage in this process
    node_id: str | None = None  # a stage on a Ray node (a pipeline's)
    node_memory_bytes: int | None = None
    threads: int | None = None  # a pipeline stage's compute threads
    restarts: int = 0
    work: StageWork | None = None  # a pipeline stage's counters; None while it is lost


@dataclass(frozen=True)
class RecoveryInfo:
    """A pipeline's lost stages and their re-creation."""

    losses: int = 0  # times one or more stages were found lost
    recoveries: int = 0  # times every lost stage was re-created
    restarts: tuple[int, ...] = ()  # per stage
    recover_seconds: tuple[float, ...] = ()  # each recovery: loss noticed -> stages ready again


@dataclass(frozen=True)
class TrafficInfo:
    """Bytes that passed through the head's process (hidden states never do)."""

    plan_bytes: int = 0
    logits_bytes: int = 0
    weights_shipped_bytes: int = 0

    @property
    def total(self) -> int:
        return self.plan_bytes + self.logits_bytes + self.weights_shipped_bytes


@dataclass(frozen=True)
class PipelineInfo:
    """What only a pipeline of stages has: its transport, health, recoveries and traffic."""

    transport: str | None  # "graph" | "calls"
    health: RunnerHealth
    recovery: RecoveryInfo
    head_traffic: TrafficInfo
    logits_transfer_s: float
    split_reason: str = ""  # what the automatic layer split weighed (node memory, measured speed)
    wait_policy: str = ""  # how the stages' OpenMP threads wait, as the head hands it to them (worker_env)


@dataclass(frozen=True)
class RunnerInfo:
    """A runner described in plain data (``GET /v1/cluster`` is formatted from it)."""

    kv_blocks: int
    max_in_flight: int
    stages: tuple[StageInfo, ...]
    pipeline: PipelineInfo | None = None  # None: every stage runs in this process


RowSamplingFn = Callable[[str], Any]  # request id -> RowSampling | None (bargein.engine.sampler)


@runtime_checkable
class Runner(Protocol):
    """What the engine needs of a runner: the model's shape, the KV pool's size, the
    device its logits come on, the plan seam, its health and a description.

    ``submit`` may be called while ``num_in_flight < max_in_flight``; ``collect``
    returns the oldest submitted plan's result (plans finish in submission order), or
    raises :class:`StepFailed` naming it, or :class:`KVLost` (every plan in flight and
    every block's K/V gone; ``health()`` then says whether it is recovering).
    ``health`` may be called from any thread; ``wait_ready(timeout)`` blocks until the
    runner can run plans again (True) or the timeout passes (False). ``row_sampling``,
    set by the engine, lets a runner that samples plain rows where the logits are (a
    pipeline's last stage) ask for a request's sampling; a runner may ignore it.
    """

    model_config: ModelConfig
    num_blocks: int
    device: torch.device
    max_in_flight: int
    row_sampling: RowSamplingFn | None

    @property
    def num_in_flight(self) -> int: ...

    def submit(self, plan: StepPlan) -> None: ...

    def collect(self) -> StepResult: ...

    def health(self) -> RunnerHealth: ...

    def wait_ready(self, timeout: float) -> bool: ...

    def describe(self) -> RunnerInfo: ...

    def close(self) -> None: ...


class ModelRunner:
    """Drives one or more consecutive model stages in this process (one plan in flight)."""

    max_in_flight = 1
    row_sampling: RowSamplingFn | None = None  # every row's logits are returned: nothing to ask

    def __init__(self, stages: Sequence[LlamaStage], num_blocks: int, block_size: int, *,
                 cuda_graph_batch_sizes: Sequence[int] = ()):
        """``cuda_graph_batch_sizes``: decode batch sizes to capture graphs for on CUDA
        (empty: no graphs). Ignored on other devices."""
        if not stages or not stages[0].is_first or not stages[-1].is_last:
            raise ValueError("the stages must cover the model from its first layer to its last")
        self.stages = list(stages)
        self.model_config = stages[0].config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.pad_block = num_blocks  # the scratch block past the pool's ids
        self.kv_caches = [s.make_kv_caches(num_blocks + 1, block_size) for s in self.stages]
        self.device = stages[0].device
        self.vocab_size = stages[-1].vocab_size
        self.decode_graphs: DecodeGraphs | None = None
        # A sliding window or soft cap (Mistral, Gemma) attends sequence by sequence: no graphs.
        if cuda_graph_batch_sizes and self.device.type == "cuda" and all(s.graph_safe for s in self.stages):
            self.decode_graphs = self.padded_decode(cuda_graph_batch_sizes, capture=True)
        self._submitted: StepPlan | None = None
        self.logits_buffer = LogitsBuffer(self.vocab_size)  # where execute writes the logits, step after step
        self._decode_batch = any(s.reads_decode_batch for s in self.stages)

    @property
    def num_in_flight(self) -> int:
        return int(self._submitted is not None)

    def submit(self, plan: StepPlan) -> None:
        """Hands a plan over; its result comes from ``collect``. One plan at a time here."""
        if self._submitted is not None:
            raise RuntimeError("this runner holds one plan at a time: collect() the previous one first")
        self._submitted = plan

    def collect(self) -> StepResult:
        """Runs the submitted plan; raises StepFailed if its forward raised."""
        plan, self._submitted = self._submitted, None
        if plan is None:
            raise RuntimeError("no plan was submitted")
        try:
            return StepResult(plan, self.execute(plan))
        except Exception as exc:
            raise StepFailed(plan, f"{type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        """Nothing to release: the caches go with this object."""

    def health(self) -> RunnerHealth:
        """Always ok: nothing here can be lost but the process itself."""
        return RunnerHealth()

    def wait_ready(self, timeout: float) -> bool:
        return True

    def describe(self) -> RunnerInfo:
        """One process, no pipeline."""
        return RunnerInfo(self.num_blocks, self.max_in_flight,
                          tuple(StageInfo(i, (s.start, s.end), device=str(self.device))
                                for i, s in enumerate(self.stages)))

    def padded_decode(self, batch_sizes: Sequence[int], *, capture: bool) -> DecodeGraphs:
        """A :class:`DecodeGraphs` over this runner's stages and caches."""
        return DecodeGraphs(self.stages, self.kv_caches, pad_block=self.pad_block, block_size=self.block_size,
                            batch_sizes=batch_sizes, capture=capture)

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Runs the plan's forward; returns float32 logits (one row per ``chunk.num_logits``),
        valid until the next ``execute``: on the CPU, a view of this runner's reused memory
        (``LogitsBuffer``) where the model's fused head writes them. Clone what you keep."""
        for caches in self.kv_caches:
            for src, dst in plan.block_copies:
                for cache in caches:
                    cache.copy_block(src, dst)
        if plan.is_empty:
            return torch.empty((0, self.vocab_size), dtype=torch.float32, device=self.device)
        if (self.decode_graphs is not None and not plan.has_drafts
                and (logits := self.decode_graphs.run(plan)) is not None):
            return logits
        x, pos, meta, indices = plan_inputs(plan, self.block_size, self.device, decode_batch=self._decode_batch)
        out = self.logits_buffer.rows(indices.shape[0]) if self.device.type == "cpu" else None
        for stage, caches in zip(self.stages, self.kv_caches, strict=True):
            x = stage(x, pos, meta, caches, logits_indices=indices if stage.is_last else None,
                      logits_out=out if stage.is_last else None)
        return x


def plan_inputs(plan: StepPlan, block_size: int, device: torch.device, *, decode_batch: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """A plan's token ids, positions, attention metadata and sampled rows, on ``device``
    (``decode_batch``: see ``AttentionMetadata.build``).

    Every stage of a pipeline derives the same from the same plan (plain data), so no
    stage needs another's inputs besides the hidden states.
    """
    ids: list[int] = []
    positions: list[int] = []
    logits_indices: list[int] = []
    for chunk in plan.chunks:
        query = chunk.query_ids  # a chunk's guesses follow its tokens (speculative decoding)
        ids.extend(query)
        positions.extend(range(chunk.start_pos, chunk.start_pos + len(query)))
        logits_indices.extend(range(len(ids) - chunk.num_logits, len(ids)))
    meta = AttentionMetadata.build(
        block_tables=[list(c.block_table) for c in plan.chunks],
        query_lens=[len(c.query_ids) for c in plan.chunks],
        context_lens=[c.start_pos + len(c.query_ids) for c in plan.chunks],
        block_size=block_size,
        device=device,
        decode_batch=decode_batch,
    )
    # One tensor, one copy to the device; the three are views of it.
    x, pos, indices = torch.tensor(ids + positions + logits_indices, dtype=torch.int64).to(
        device, non_blocking=True).split([len(ids), len(positions), len(logits_indices)])
    return x, pos, meta, indices
