"""One pipeline stage, as it runs inside its Ray actor.

A stage holds a :class:`~bargein.model.llama.LlamaStage` for its layer range and the
K/V of those layers for every block id of the head's pool: the head's scheduler is the
one allocator, so a block id means the same on every stage. It keeps no per-request
state: each plan (plain data, pickled once by the head) says which tokens go where.

Plans run strictly in order of their sequence numbers (the stage checks it), so a block
reused by a later plan is never written before an earlier plan in flight has read it.
Hidden states go from stage to stage, never through the head's process, by one of two
transports (the head picks, see ``transport``):

- ``graph``: the stages form one Ray compiled graph (``step``); its channels carry the
  plan from the head to every stage, stage k's output to stage k+1 and the last
  stage's output back, through shared memory: tens of microseconds a hop. Ray runs
  each stage's part on a thread of its own, one plan after another. Used where every
  stage runs on the head's node.
- ``calls``: the head calls every stage's ``run`` with the plan; a stage calls the next
  stage's ``receive`` with its hidden states (Ray sends a small array inline in that
  call, worker to worker, and a larger one through the object store). ``receive`` runs
  on the stage's own inputs thread, so a plan's transfer overlaps the compute of the
  plans before it. An actor call costs a millisecond or more a hop; used across nodes.

The last stage returns the float32 logits of the sampled positions only. A stage that
fails on a plan passes the error on instead of hidden states, so the head hears of it
from the last stage. When the head gives up the plans in flight (a lost stage), it tells
the surviving stages of a ``calls`` pipeline (``void_through``): a plan they wait for or
have queued fails at once instead of waiting for hidden states that will never come (a
``graph`` is torn down instead).

The counters (plans executed, and which request ids at which plan step) are what tests
and ``/v1/cluster`` read to see exactly what each stage computed.

Weights: the stage reads its own layers from the model file at ``node_path`` if this
node holds the same file there (``~`` is this node's home), else it fetches the tensors
the head shipped (``shipped``: a reference in a list, fetched only when needed, stored
form). Either way a GGUF's Q4_1/Q8_0 matrices stay in their stored blocks and the stage
is built as the single-process engine builds its model (``build_model``), so it holds
the same weights bit for bit. Without either source, it fails to start, saying so.

Disk tier: with ``--kv-disk``, each stage keeps its own layers' blocks on its node
(``stage_disk``): the head opens it (``open_kv_disk``), reads go on the stage's disk
thread (``kv_disk_read``), and the operations a plan carries (``StepPlan.kv_disk``:
spills, installs of what was read, deletions) run before its block copies and forward.

Health: ``ping`` runs in its own concurrency group (its own thread), so the head's
heartbeat is answered while a plan computes and never queues behind plans; a stage
that does not answer it is dead or hung. Other calls (counters, weights) may run beside
a plan (a graph's thread); the counters are guarded by a lock.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import pickle
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from bargein.config import EngineConfig, ModelConfig
from bargein.distributed.stage_disk import StageDisk, StageTierBusy, StageTierOpened
from bargein.distributed.weights import Fingerprint, has_model_copy, materialize
from bargein.distributed.worker_env import worker_runtime_env
from bargein.engine.block_keys import ChainBlock
from bargein.engine.device import build_model, one_torch_thread, resolve_device, resolve_dtype
from bargein.engine.disk_cache import stage_fingerprint, stage_tier_directory
from bargein.engine.kv_disk.lock import DirectoryBusy
from bargein.engine.kv_disk.stage_ops import KVDiskOp
from bargein.engine.kv_disk.stats import DiskTierStats
from bargein.engine.plan import StepPlan
from bargein.engine.runner import plan_inputs
from bargein.engine.sampler import RowSampling, sample_rows
from bargein.kernels.block_quant import BlockWeight
from bargein.kernels.quant_weight import QuantWeight
from bargein.loader import close_model_files, load_weights
from bargein.loader.source import ModelSource
from bargein.model.attention import KVCache
from bargein.model.llama import LlamaStage

log = logging.getLogger("bargein.distributed")

LOG_LENGTH = 4096  # plans remembered per stage for the executed log
TIMELINE_LENGTH = 1024  # plans remembered per stage for the timeline (a benchmark's run)


@dataclass
class StageCounters:
    """What one stage did: plain data, read by the head."""

    index: int
    layers: tuple[int, int]
    node_id: str
    weights_from: str  # "file" (read on the node) or "head" (shipped)
    weights_received_bytes: int
    plans: int = 0
    tokens: int = 0
    busy_s: float = 0.0  # computing (the plan, block copies, forward, picking tokens)
    wait_s: float = 0.0  # between plans: waiting for the next plan or its hidden states
    transfer_s: float = 0.0  # previous stage's send -> here (arrives ahead where the stage was busy)
    first_start: float | None = None
    last_end: float | None = None
    hidden_bytes_out: int = 0
    last_seq: int = -1  # the last plan it finished
    executed: deque[tuple[int, tuple[str, ...]]] = field(default_factory=lambda: deque(maxlen=LOG_LENGTH))
    # Per plan, wall clock (time.time): (plan step, call entered, input here, done): where idle time goes.
    timeline: deque[tuple[int, float, float, float]] = field(default_factory=lambda: deque(maxlen=TIMELINE_LENGTH))

    @property
    def span_s(self) -> float:
        return 0.0 if self.first_start is None or self.last_end is None else self.last_end - self.first_start

    @property
    def idle_fraction(self) -> float:
        """Share of the time from its first plan to its last that the stage did not compute."""
        span = self.span_s
        return 0.0 if span <= 0 else max(0.0, 1.0 - self.busy_s / span)

    def steps_with(self, request_id: str) -> list[int]:
        """Plan steps (the head's numbers) this stage executed that held ``request_id``."""
        return [step for step, ids in self.executed if request_id in ids]


class PlanVoided(RuntimeError):
    """The head gave up this plan (a stage was lost): it is not computed."""


class EarlierStageFailed(RuntimeError):
    """An earlier stage failed on this plan; the message says which and why."""


class PrefetchedInputs:
    """Hidden states that arrived ahead of their plans (the inputs thread puts, the plan
    thread takes): plan seq -> (tensor, transfer seconds), or the error the previous
    stage sent instead. Plans up to ``voided`` were given up by the head: their inputs
    are dropped and taking one raises :class:`PlanVoided`."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[torch.Tensor, float] | BaseException] = {}
        self._arrived = threading.Condition()
        self.voided = 0

    def put(self, seq: int, item: tuple[torch.Tensor, float] | BaseException) -> None:
        with self._arrived:
            if seq > self.voided:
                self._items[seq] = item
                self._arrived.notify_all()

    def void_through(self, seq: int) -> None:
        """Gives up plans up to ``seq``: a take waiting for one raises; later puts are dropped."""
        with self._arrived:
            self.voided = max(self.voided, seq)
            for old in [k for k in self._items if k <= self.voided]:
                del self._items[old]
            self._arrived.notify_all()

    def take(self, seq: int) -> tuple[torch.Tensor, float]:
        """Waits for plan ``seq``'s input; raises the error sent instead, or PlanVoided.
        Inputs of earlier plans that never ran are dropped."""
        with self._arrived:
            self._arrived.wait_for(lambda: seq in self._items or seq <= self.voided)
            if seq <= self.voided:
                raise PlanVoided(f"plan {seq} was given up by the head")
            item = self._items.pop(seq)
            for old in [k for k in self._items if k < seq]:
                del self._items[old]
        if isinstance(item, BaseException):
            raise item
        return item

    def __len__(self) -> int:
        with self._arrived:
            return len(self._items)


class StageWorker:
    """The body of a stage actor (``ray.remote(StageWorker)`` in ``pipeline``)."""

    def __init__(self, index: int, config: EngineConfig, model_config: ModelConfig, source_kind: str,
                 node_path: str, expected: Fingerprint, layers: tuple[int, int],
                 shipped: list[ray.ObjectRef] | None, prefer_shipped: bool, threads: int):
        torch.set_num_threads(threads)
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        path = os.path.expanduser(node_path)
        own_copy = has_model_copy(path, source_kind, expected)
        blocks = device.type == "cpu"  # a GGUF's Q4_1/Q8_0 stay in their stored blocks, as in one process
        received = 0
        from_shipped = shipped is not None and (prefer_shipped or not own_copy)
        with one_torch_thread():
            if from_shipped:
                stored = ray.get(shipped[0])
                received = stored.nbytes
                weights = materialize(stored, model_config, dtype, device, blocks=blocks)
                del stored
            elif own_copy:
                source = ModelSource(source_kind, Path(path), model_config.name)  # type: ignore[arg-type]
                weights = load_weights(source, model_config, layer_range=layers, dtype=dtype, device=device,
                                       progress=False, blocks=blocks)
                close_model_files()
            else:
                raise RuntimeError(f"stage {index}: this node has no copy of the model at {node_path} "
                                   f"and the head shipped none")
            max_positions = config.max_model_len or model_config.max_position_embeddings
            # shipped weights are private memory already: only this node's file is copied
            self.stage = build_model(model_config, weights, config, max_positions=max_positions, layer_range=layers,
                                     private_copy=not from_shipped)
        self.device = device
        self.caches: list[KVCache] = []
        self.block_size = 0
        self.disk: StageDisk | None = None  # this stage's own disk tier, once the head opened it
        self.inputs = PrefetchedInputs()
        self.next_stage: Any = None  # the next stage's actor handle; None for the last stage
        self._last_started = -1  # plans must come in order
        self._doorbell: int | None = None  # the head's doorbell (graph transport)
        self._counting = threading.Lock()  # plans (a graph's thread) write the counters; other calls read them
        self.counters = StageCounters(index, layers, ray.get_runtime_context().get_node_id(),
                                      "head" if received else "file", received)

    @ray.method(concurrency_group="health")
    def ping(self) -> tuple[str, int]:
        """The heartbeat: answered on its own thread, even while a plan computes."""
        return self.counters.node_id, os.getpid()

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.stage.kv_bytes_per_block(block_size)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """K/V for every block id of the head's pool (block ids 0 .. num_blocks - 1)."""
        self.caches = self.stage.make_kv_caches(num_blocks, block_size)
        self.block_size = block_size

    def open_kv_disk(self, base: str, files: tuple[tuple[str, int, str], ...], blocks: int
                     ) -> StageTierOpened | StageTierBusy:
        """Opens this stage's own tier in ``base/stage-<start>-<end>`` on this node (``~``:
        this node's home), for the model whose files' identities are ``files`` (computed
        by the head), bounded to ``blocks`` blocks; who holds it if another process does."""
        layers = (self.stage.start, self.stage.end)
        fingerprint = stage_fingerprint([self.stage], self.block_size, "", files=files)
        try:
            self.disk = StageDisk(stage_tier_directory(os.path.expanduser(base), layers), fingerprint,
                                  [(c.k, c.v) for c in self.caches], blocks)
        except DirectoryBusy as exc:
            return StageTierBusy(str(exc))  # the head says it (this log does not reach the server's)
        return self.disk.opened()

    @ray.method(concurrency_group="disk")
    def kv_disk_read(self, ticket: str, wanted: list[ChainBlock]) -> int:
        """Reads a chain from this stage's tier for the head (beside the plans); how many blocks."""
        return 0 if self.disk is None else self.disk.read(ticket, wanted)

    @ray.method(concurrency_group="disk")
    def kv_disk_apply(self, ops: list[KVDiskOp]) -> None:
        """Operations the head sends outside a plan (deletions while the pipeline is idle)."""
        if self.disk is not None:
            self.disk.apply(ops)

    @ray.method(concurrency_group="disk")
    def kv_disk_stats(self) -> DiskTierStats | None:
        return None if self.disk is None else self.disk.stats()

    def kv_disk_close(self, ops: list[KVDiskOp], timeout: float) -> bool:
        """Shutdown: applies the last operations, writes within ``timeout`` seconds, closes the tier."""
        disk, self.disk = self.disk, None
        return True if disk is None else disk.close(ops, timeout)

    def connect_next(self, handles: list[Any]) -> None:
        """Where this stage sends its hidden states: ``[handle]`` of the next stage's
        actor (in a list, so Ray passes the handle), ``[]`` for the last stage. Called
        by the head at set-up and when the next stage was re-created; it runs in plan
        order, so no later plan's hidden states go to the old actor."""
        self.next_stage = handles[0] if handles else None

    @ray.method(concurrency_group="inputs")
    def receive(self, seq: int, hidden: np.ndarray | None, sent_at: float, error: str | None = None) -> None:
        """Plan ``seq``'s input from the previous stage (its hidden states, or the error it
        failed with), on this stage's inputs thread: it arrives while earlier plans
        compute, and ``run`` takes it."""
        if error is not None:
            self.inputs.put(seq, EarlierStageFailed(error))
        else:
            self.inputs.put(seq, (_own_copy(hidden), max(0.0, time.time() - sent_at)))

    @ray.method(concurrency_group="inputs")
    def void_through(self, seq: int) -> None:
        """The head gave up plans up to ``seq``: one waiting for its input, or queued, fails at once."""
        self.inputs.void_through(seq)

    @ray.method(concurrency_group="health")
    def progress(self) -> int:
        """The last plan (sequence number) this stage finished: the head finds which stage
        holds a plan past its deadline."""
        return self.counters.last_seq

    def run(self, seq: int, payload: bytes, receives: bool, rows_payload: bytes | None = None) -> tuple | None:
        """Executes plan number ``seq`` (pickled ``StepPlan``), sent by an actor call
        (the ``calls`` transport).

        ``receives``: False for the first stage; else the previous stage sends this plan's
        hidden states to ``receive``, and they are waited for here (not by Ray before the
        call, so the heartbeat is never held behind a plan). A stage before the last sends
        its hidden states (or, if it fails, the error) to the next stage and returns None;
        the last stage returns what :meth:`_execute` says.
        """
        entered = time.time()
        hidden = None
        try:
            self._check_order(seq)
            if seq <= self.inputs.voided:
                raise PlanVoided(f"plan {seq} was given up by the head")
            if receives:
                hidden, transfer_s = self.inputs.take(seq)
                with self._counting:
                    self.counters.transfer_s += transfer_s
            out = self._execute(seq, payload, rows_payload, hidden, entered)
        except PlanVoided:
            raise
        except Exception as exc:
            failure = str(exc) if isinstance(exc, EarlierStageFailed) else _failure(self.counters, seq, exc)
            if self.next_stage is not None:
                self.next_stage.receive.remote(seq, None, time.time(), failure)
            raise RuntimeError(failure) from exc
        if self.stage.is_last:
            return out
        self.next_stage.receive.remote(seq, out[0], out[1])
        return None

    def step(self, inputs: tuple[int, bytes, bytes | None], previous: tuple[np.ndarray, float] | None = None
             ) -> tuple:
        """Executes a plan in the pipeline's compiled graph (the ``graph`` transport, see
        ``transport``): ``inputs`` is the head's ``(seq, pickled StepPlan, rows_payload)``,
        ``previous`` the previous stage's output (None for the first stage). Returns what
        :meth:`_execute` says; the graph carries it to the next stage or the head."""
        entered = time.time()
        seq, payload, rows_payload = inputs
        hidden = None
        try:
            self._check_order(seq)
            if previous is not None:
                hidden = _own_copy(previous[0])
                with self._counting:
                    self.counters.transfer_s += max(0.0, entered - previous[1])  # nodes' clocks assumed in sync
            return self._execute(seq, payload, rows_payload, hidden, entered)
        except Exception as exc:
            self._ring()  # the graph carries the error to the head, which is waiting for a ring
            raise RuntimeError(_failure(self.counters, seq, exc)) from exc

    def ring_on(self, path: str) -> None:
        """The head's doorbell for a graph (a FIFO on this node, see ``transport``): rung
        when the last stage finished a plan's forward, or any stage failed one."""
        if self._doorbell is not None:
            os.close(self._doorbell)
        self._doorbell = os.open(path, os.O_WRONLY | os.O_NONBLOCK)

    def _ring(self) -> None:
        if self._doorbell is not None:
            with contextlib.suppress(OSError):  # the head closed it: the graph is being torn down
                os.write(self._doorbell, b"r")

    def _check_order(self, seq: int) -> None:
        if seq <= self._last_started:
            raise RuntimeError(f"got plan {seq} after plan {self._last_started}: plans must run in order")
        self._last_started = seq

    def _execute(self, seq: int, payload: bytes, rows_payload: bytes | None, hidden: torch.Tensor | None,
                 entered: float) -> tuple:
        """Runs plan ``seq`` on this stage's layers (``hidden``: the previous stage's output,
        here; None for the first stage) and counts it.

        A stage before the last returns ``(hidden states, sent at)``; the last returns the
        float32 logits of the plan's sampled positions, as ``(logits, tokens, sent at)``:
        with ``rows_payload`` (the pickled RowSampling of each sampled row, None for a row
        the head samples), the plain rows' tokens are picked here (``tokens``: plan row ->
        token id), ``logits`` holds only the other rows, and is None if there are none.
        Arrays go as NumPy: Ray sends one far faster than a tensor.
        """
        started = time.perf_counter()
        input_at = time.time()
        plan: StepPlan = pickle.loads(payload)
        out = self._forward(plan, hidden)
        if self.stage.is_last:  # the head wakes while the tokens are picked and the result is sent
            self._ring()
        tokens = None
        if self.stage.is_last and rows_payload is not None:
            rows: tuple[RowSampling | None, ...] = pickle.loads(rows_payload)
            plain = [i for i, r in enumerate(rows) if r is not None]
            tokens = dict(zip(plain, sample_rows(out[plain], [rows[i] for i in plain]), strict=True))
            out = out[[i for i, r in enumerate(rows) if r is None]]
        ended = time.perf_counter()
        with self._counting:
            c = self.counters
            c.last_seq = seq
            c.plans += 1
            c.tokens += plan.num_tokens
            c.busy_s += ended - started
            if c.first_start is None:
                c.first_start = started
            else:
                c.wait_s += max(0.0, started - (c.last_end or started))
            c.last_end = ended
            if not self.stage.is_last:
                c.hidden_bytes_out += out.numel() * out.element_size()
            c.executed.append((plan.step, tuple(ch.request_id for ch in plan.chunks)))
            c.timeline.append((plan.step, entered, input_at, time.time()))
        if self.stage.is_last:
            return (out.numpy() if len(out) else None, tokens, time.time())
        return (out.numpy(), time.time())

    def _forward(self, plan: StepPlan, hidden: torch.Tensor | None) -> torch.Tensor:
        if plan.kv_disk and self.disk is not None:  # before any block is written (stage_ops)
            self.disk.apply(plan.kv_disk)
        for src, dst in plan.block_copies:
            for cache in self.caches:
                cache.copy_block(src, dst)
        x, pos, meta, indices = plan_inputs(plan, self.block_size, self.device,
                                            decode_batch=self.stage.reads_decode_batch)
        if hidden is not None:
            x = hidden.to(self.device)
        out = self.stage(x, pos, meta, self.caches, logits_indices=indices if self.stage.is_last else None)
        return out.cpu()

    def read_counters(self) -> StageCounters:
        with self._counting:
            return copy.deepcopy(self.counters)

    def read_weights(self) -> dict[str, torch.Tensor]:
        """What the stage holds as weights (see :func:`held_weights`), for tests to compare."""
        return held_weights(self.stage)

    def reset_counters(self) -> None:
        """Starts the counters afresh (identity and plan order kept), e.g. between benchmark runs."""
        with self._counting:
            c = self.counters
            self.counters = StageCounters(c.index, c.layers, c.node_id, c.weights_from, c.weights_received_bytes,
                                          last_seq=c.last_seq)


def _own_copy(hidden: np.ndarray) -> torch.Tensor:
    """The previous stage's hidden states as a tensor of this stage's own: Ray hands over
    a read-only buffer (a channel's, or the call's), and the forward owns its input."""
    return torch.from_numpy(np.array(hidden))


def _failure(counters: StageCounters, seq: int, exc: BaseException) -> str:
    return (f"pipeline stage {counters.index} (layers {counters.layers[0]}-{counters.layers[1]}) failed on "
            f"plan {seq}: {type(exc).__name__}: {exc}")


def held_weights(stage: LlamaStage) -> dict[str, torch.Tensor]:
    """Every tensor a stage computes from, by name with global layer numbers: parameters
    and buffers, each block-held weight's parts (``<module>.blocks.qs`` / ``scales`` /
    ``mins``) and each QuantWeight's segments (``<module>.quant.<i>.data`` / ``order``).
    Two stages that hold equal tensors under equal names compute the same."""
    def global_name(name: str) -> str:
        if not name.startswith("layers."):
            return name
        _, index, rest = name.split(".", 2)
        return f"layers.{stage.start + int(index)}.{rest}"

    out = {global_name(name): t for name, t in stage.state_dict().items()}
    for name, module in stage.named_modules():
        blocks = getattr(module, "blocks", None)
        if isinstance(blocks, BlockWeight):
            parts = {"qs": blocks.qs, "scales": blocks.scales, "mins": blocks.mins}
            out |= {global_name(f"{name}.blocks.{k}"): v for k, v in parts.items() if v is not None}
        quant = getattr(module, "quant", None)
        if isinstance(quant, QuantWeight):
            for i, segment in enumerate(quant.segments):
                parts = {"data": segment.data, "order": segment.order}
                out |= {global_name(f"{name}.quant.{i}.{k}"): v for k, v in parts.items() if v is not None}
    return out


def stage_actor(config: EngineConfig, on_node: Any, num_cpus: float) -> Any:
    """The stage actor class with its options: a CPU per torch thread, the node resource
    if one is set, a health thread for the heartbeat, an inputs thread that takes in the
    next plans' hidden states while one computes and a disk thread (its tier's reads),
    never restarted by Ray (the head re-creates a lost stage, knowing its K/V is gone)."""
    pipe = config.pipeline
    options: dict[str, Any] = {"num_cpus": num_cpus, "max_restarts": 0,
                               "concurrency_groups": {"health": 1, "inputs": 1, "disk": 1}}
    if pipe.node_resource is not None:
        options["resources"] = {pipe.node_resource: 0.001}
    if on_node is not None:
        options["scheduling_strategy"] = on_node
    return ray.remote(**options, **worker_runtime_env())(StageWorker)  # the head's wait policy (worker_env)
