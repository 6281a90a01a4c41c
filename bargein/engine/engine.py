"""Engine: the synchronous core. ``add_request``, ``abort``, ``finish``, ``step``.

One step reads like the architecture::

    plan = scheduler.schedule()
    runner.submit(plan); result = runner.collect()
    tokens = sampler.sample(result.logits, states)
    scheduler.update(plan, tokens)
    return scheduler.take_outcome()

with the inbox drained before the schedule and again right after the forward, so a
cancel requested while step k runs takes effect at the end of step k (C1), and the
token sampled in step k is then dropped (C2). A step returns one :class:`StepOutcome`:
per request it changed, a delta (new token ids, raw logprobs, the finish, usage
counts). Turning deltas into text and outputs is the consumer's job
(:mod:`bargein.engine.outputs`), off the engine thread.

Threads: ``step`` and the conversation methods belong to one thread (the engine's owner:
the caller of a plain Engine, or AsyncEngine's loop thread). ``add_request``,
``abort``, ``finish`` and ``call_soon`` may be called from any thread; they go through
the ordered inbox (a ``queue.SimpleQueue``, whose ``put`` is reentrant). ``abort``
takes no lock at all, so it is safe in a signal handler.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

from bargein.config import EngineConfig, ModelConfig
from bargein.engine import reports
from bargein.engine.admission import Admitted, EngineError, admit, encode_prompt
from bargein.engine.blocks import BlockPool, BlockTable
from bargein.engine.conversations import EngineConversations
from bargein.engine.disk_cache import DiskCache
from bargein.engine.grammar import Grammars
from bargein.engine.messages import (
    AbortRequest,
    AddRequest,
    CallInEngine,
    EngineMessage,
    FinishRequest,
    Wake,
)
from bargein.engine.outputs import OutputCollector, RequestDelta, StepOutcome
from bargein.engine.plan import StepPlan
from bargein.engine.request import (
    AbortResult,
    CancelReason,
    FinishReason,
    Request,
    RequestOutput,
)
from bargein.engine.request import (
    Sequence as TokenSequence,
)
from bargein.engine.request_ids import IdInUse
from bargein.engine.runner import KVLost, ModelRunner, Runner, RunnerHealth, StepFailed
from bargein.engine.sampler import RowSampling, Sampler, SamplingState, row_sampling
from bargein.engine.sampling import SamplingParams
from bargein.engine.scheduler import Scheduler
from bargein.engine.speculative.build import build_speculation
from bargein.engine.speculative.controller import Speculation
from bargein.engine.speculative.proposer import Proposer
from bargein.engine.stats import EngineCounters, EngineStats, RequestInfo, StepRecord
from bargein.engine.step_sampling import sample_step
from bargein.model.llama import LlamaStage

log = logging.getLogger("bargein.engine")

_MIN_BLOCKS = 16


class Engine(EngineConversations):
    """A model, its KV cache, a scheduler and a sampler, stepped by one thread."""

    def __init__(self, model: LlamaStage | Sequence[LlamaStage] | Runner, tokenizer: Any,
                 config: EngineConfig | None = None, *, model_name: str = "model",
                 model_identity: str | os.PathLike[str] | None = None, draft_proposer: Proposer | None = None):
        """``model``: the stages to run in this process, or a runner that drives them
        elsewhere (a pipeline on a Ray cluster); the runner sizes the KV pool.
        ``model_identity``: the model's file or folder (or a string naming in-memory
        weights), from which the disk tier's fingerprint starts (``cache.kv_disk_dir``).
        ``draft_proposer``: speculative decoding's guesser, instead of the one
        ``config.speculative`` names (a draft model built in memory)."""
        self.config = config or EngineConfig()
        cache = self.config.cache
        self.runner: Runner = model if isinstance(model, Runner) else self._local_runner(model)
        self.model_config: ModelConfig = self.runner.model_config
        self.tokenizer, self.model_name, self.model_identity = tokenizer, model_name, model_identity
        self.pool = BlockPool(self.runner.num_blocks, cache.block_size, cache.enable_prefix_caching, window=self.model_config.every_layer_window)
        max_len = self.config.max_model_len or self.model_config.max_position_embeddings
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self.scheduler = Scheduler(self.config.scheduler, self.pool, max_len, self.eos_token_ids)
        self.disk: DiskCache | None = (DiskCache.open(cache, self.runner, self.pool, self.scheduler, model_identity)
                                       if cache.kv_disk_dir else None)
        self.sampler = Sampler()
        self.speculation: Speculation | None = build_speculation(self.config, self.runner, proposer=draft_proposer)
        self.grammars = Grammars(tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.counters = EngineCounters()
        self._inbox: queue.SimpleQueue[EngineMessage] = queue.SimpleQueue()
        self._held: EngineMessage | None = None  # taken by wait_for_work, handled first by the next drain
        self.runner.row_sampling = self._row_sampling  # for a runner that samples plain rows itself

    def _local_runner(self, stages: LlamaStage | Sequence[LlamaStage]) -> ModelRunner:
        stages = [stages] if isinstance(stages, LlamaStage) else list(stages)
        cache = self.config.cache
        bytes_per_block = sum(s.kv_bytes_per_block(cache.block_size) for s in stages)
        num_blocks = cache.counted_blocks or max(_MIN_BLOCKS, cache.memory_bytes // bytes_per_block)
        return ModelRunner(stages, num_blocks, cache.block_size,
                           cuda_graph_batch_sizes=self.config.cuda_graph_batch_sizes
                           if self.config.cuda_graphs else ())

    # -- construction -------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, ref: str | None = None, config: EngineConfig | None = None, *,
                        progress: bool = True) -> Engine:
        """Loads a model reference into this process: None (the bundled SmolLM2), a .gguf
        file or an HF folder. A pipeline on Ray (``config.pipeline``) is built by
        :func:`bargein.build.build_engine`, which knows the runners of the layers above."""
        from bargein.engine.load import load_in_process

        return load_in_process(cls, ref, config, progress=progress)

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    # -- any thread ---------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{uuid.uuid4().hex[:16]}"

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, timeout: float | None = None,
                    conversation_id: str | None = None, on_claimed: Callable[[str], Any] | None = None,
                    constraint_from: int | None = None, output_offset: int = 0) -> str:
        """Queues a generation (checked by ``admission.admit``); returns its id. Raises
        EngineError for a bad request.

        With ``conversation_id``, the prompt's tokens are appended to that conversation and the
        answer generated onto it; the sequence keeps its K/V after. ``timeout`` (seconds)
        sets a deadline (reason ``deadline``). Outputs come as deltas in the ``StepOutcome``
        of later steps. ``on_claimed(request_id)`` runs once the id is claimed and before
        the request is queued (AsyncEngine registers the request's stream there).

        ``constraint_from`` continues a constrained answer that began at that token of the
        prompt (of the conversation): the tokens since are replayed into a new matcher, so a
        cancelled constrained answer goes on as it would have without the cancel (C4).
        ``output_offset`` resumes an answer begun on a lost replica: the prompt's (the
        conversation's) last ``output_offset`` tokens are its earlier output, so seeded
        sampling draws token i from the original stream; out of the conversation's range,
        the request ends with an error and the conversation is unchanged.
        """
        admitted = admit(prompt, params, tokenizer=self.tokenizer, grammars=self.grammars,
                         vocab_size=self.model_config.vocab_size, max_model_len=self.max_model_len,
                         timeout=timeout, conversation_id=conversation_id, constraint_from=constraint_from,
                         output_offset=output_offset)
        return self.add_admitted(admitted, request_id=request_id, on_claimed=on_claimed)

    def add_admitted(self, admitted: Admitted, *, request_id: str | None = None,
                     on_claimed: Callable[[str], Any] | None = None) -> str:
        """Queues a request that passed ``admit`` (see ``add_request``); returns its id."""
        token_ids, params, timeout = list(admitted.token_ids), admitted.params, admitted.timeout
        conversation_id = admitted.conversation_id
        request_id = request_id or self.new_request_id()
        try:
            self.scheduler.ids.claim(request_id)
        except IdInUse as exc:
            raise EngineError(str(exc)) from None
        if on_claimed is not None:
            try:
                on_claimed(request_id)
            except BaseException:
                self.scheduler.ids.forget(request_id)
                raise
        sequence = TokenSequence(request_id if conversation_id is None else conversation_id, list(token_ids),
                                 block_table=BlockTable.in_namespace(params.cache_salt))
        request = Request(
            request_id=request_id, sequence=sequence, params=params,
            prompt_len=len(token_ids), new_prompt_tokens=len(token_ids), owns_sequence=conversation_id is None,
            deadline=None if timeout is None else time.monotonic() + timeout,
            constraint_from=admitted.constraint_from, output_offset=admitted.output_offset,
        )
        self._post(AddRequest(request, conversation_id, tuple(token_ids)))
        return request_id

    def abort(self, request_id: str, reason: CancelReason = CancelReason.USER, *,
              delivered: int | None = None) -> AbortResult:
        """Cancels a request from any thread (C6): idempotent, lock-free, never raises.

        Returns NOT_FOUND for an unknown id and ALREADY_FINISHED for a finished one. When
        it returns CANCELLED the request's last output says ``finish_reason ==
        "cancelled"`` (even if the step in flight would have finished it otherwise; its
        token is then dropped). With ``delivered`` (the output tokens its consumer was
        handed), the sequence keeps only those, even if the request already finished.
        """
        try:
            result = self.scheduler.ids.request_cancel(request_id, CancelReason(reason))
            if result == AbortResult.CANCELLED or (delivered is not None and result != AbortResult.NOT_FOUND):
                self._post(AbortRequest(request_id, CancelReason(reason), time.monotonic(), delivered))
            return result
        except Exception:  # C6: never raises (a bad reason is the caller's bug, not the loop's)
            log.exception("abort(%r) failed", request_id)
            return AbortResult.NOT_FOUND

    def finish(self, request_id: str, reason: FinishReason, *, delivered: int) -> CancelReason | None:
        """Ends a request for a reason its consumer found (a stop string), keeping
        ``delivered`` output tokens; applied at the next step boundary. Lock-free.

        Returns the cancel reason if an abort claimed the request first: it then ends
        cancelled (as that abort answered), and the consumer's last output should say so.
        """
        claimed = self.scheduler.ids.claim_end(request_id)
        self._post(FinishRequest(request_id, reason, delivered))
        return claimed

    def call_soon(self, fn: Callable[[], Any]) -> Future:
        """Runs ``fn`` in the engine's thread at the next step boundary."""
        message = CallInEngine(fn)
        self._post(message)
        return message.future

    def live_request_ids(self) -> list[str]:
        return self.scheduler.ids.live()

    def wait_for_work(self, timeout: float | None = None) -> None:
        """Blocks until a message arrives or there is work to step (for a step loop)."""
        if self.has_work:
            return
        with contextlib.suppress(queue.Empty):
            self._held = self._inbox.get(timeout=timeout)

    def wake(self) -> None:
        """Ends a ``wait_for_work`` early (the step loop is being stopped); lock-free."""
        self._inbox.put(Wake())

    def _post(self, message: EngineMessage) -> None:
        self._inbox.put(message)

    def encode(self, text: str) -> list[int]:
        """A prompt of its own as tokens (``admission.encode_prompt``: the one tokenization)."""
        return encode_prompt(self.tokenizer, text, in_conversation=False)

    # -- the engine's thread ------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._held is not None or not self._inbox.empty()

    def step(self) -> StepOutcome:
        """Runs one step; returns its one result: a delta for every request it changed.

        A step submits plans while the runner has room (one for the in-process runner,
        one per micro-batch for a pipeline), then collects the oldest, samples its
        tokens and applies it. A sequence is in at most one plan in flight; its next
        token is scheduled once its plan came back.
        """
        self._drain_inbox()
        self.scheduler.expire_deadlines()
        if self.disk is not None:
            self.disk.before_schedule()
        if not self._runner_ready():
            return self._outcome()
        submitted = self._submit_plans()
        if submitted is not None:  # nothing to run: apply the empty plan
            self._drain_inbox()
            self.scheduler.expire_deadlines()
            self.scheduler.update(submitted, {})
            return self._outcome()
        started = time.perf_counter()
        try:
            result = self.runner.collect()
        except KVLost as exc:  # a pause, not a loss: every sequence recomputes from its tokens
            dropped = self.scheduler.invalidate_kv()
            self.counters.kv_losses += 1
            self.counters.recomputed_tokens += dropped
            log.warning("%s; %d computed tokens dropped, every sequence recomputes from its tokens", exc, dropped)
            return self._outcome()
        except StepFailed as exc:  # the loop survives; the step's requests fail, the rest go on
            log.error("step %d failed: %s", exc.plan.step, exc.error, exc_info=exc)
            self.scheduler.fail_step(exc.plan, f"the model step failed: {exc.error}")
            return self._outcome()
        plan = result.plan
        try:
            sampled = sample_step(result, self.scheduler.requests, self.sampler)
            if self.speculation is not None:
                self.speculation.observe(plan, sampled)
        except Exception as exc:
            log.exception("step %d failed", plan.step)
            self.scheduler.fail_step(plan, f"the model step failed: {type(exc).__name__}: {exc}")
            return self._outcome()
        forward_s = time.perf_counter() - started
        self.counters.step_durations.append(forward_s)
        self.counters.steps += 1
        self._drain_inbox()  # cancels that arrived during the forward (C1)
        self.scheduler.expire_deadlines()
        self.scheduler.update(plan, sampled)
        outcome = self._outcome()
        self.counters.recent_steps.append(StepRecord(
            self.counters.steps, time.monotonic(), forward_s, len(plan.chunks), plan.num_tokens,
            sum(1 for c in plan.chunks if len(c.token_ids) == 1)))
        return outcome

    def _row_sampling(self, request_id: str) -> RowSampling | None:
        """For a runner that picks plain rows' tokens itself (engine thread, at submit)."""
        req = self.scheduler.requests.get(request_id)
        return None if req is None or req.sampling is None else row_sampling(req.sampling)

    def runner_health(self) -> RunnerHealth:
        """The runner's health (a pipeline may be re-creating a lost stage); any thread."""
        return self.runner.health()

    def _runner_ready(self) -> bool:
        """True if plans can run now. While a lost part is re-created, requests wait
        (cancels and deadlines still apply); once the runner gave up, they fail."""
        health = self.runner_health()
        if health.state == "ok":
            return True
        if health.state == "degraded":
            self.scheduler.fail_all(health.message or "the model's runner is degraded")
        if self.scheduler.has_work:
            self.runner.wait_ready(0.05)  # not a busy loop; the inbox is drained next step
        return False

    def _submit_plans(self) -> StepPlan | None:
        """Schedules and submits plans while the runner has room. Returns the empty plan
        when nothing is in flight (there was nothing to run), else None."""
        runner = self.runner
        while runner.num_in_flight < runner.max_in_flight:
            share = self._micro_batch_seqs()
            plan = self.scheduler.schedule() if share is None else self.scheduler.schedule(share)
            if self.speculation is not None and not plan.is_empty:
                plan = self.speculation.extend(plan, self.scheduler)
            if self.disk is not None:
                self.disk.after_schedule()  # evicted blocks leave before the forward writes their ids
            if plan.is_empty:
                return plan if runner.num_in_flight == 0 else None
            try:
                runner.submit(plan)
            except Exception as exc:
                log.exception("step %d could not be submitted", plan.step)
                self.scheduler.fail_step(plan, f"the model step failed: {type(exc).__name__}: {exc}")
        return None

    def _micro_batch_seqs(self) -> int | None:
        """Sequences per plan: all of them in one plan, or an even share per micro-batch."""
        n = self.runner.max_in_flight
        if n == 1:
            return None
        active = len(self.scheduler.running) + len(self.scheduler.waiting)
        return max(1, -(-active // n))

    def close(self) -> None:
        """Writes the cache's full blocks to the disk tier (``close_kv_disk``), then releases
        the runner's resources (a pipeline's stage actors); idempotent; once the loop has stopped."""
        self.close_kv_disk()
        self.runner.close()

    def close_kv_disk(self, timeout: float = 10.0) -> bool:
        """Writes every full block to the disk tier within ``timeout`` seconds (the rest is
        dropped, never half-written), then closes it; True if all was written or there is no tier."""
        disk, self.disk = self.disk, None
        return True if disk is None else disk.close(timeout)

    def _outcome(self) -> StepOutcome:
        outcome = self.scheduler.take_outcome()
        for delta in outcome.deltas:
            self.counters.generated_tokens += len(delta.new_token_ids)
            if delta.finished:
                self._count_finish(delta)
                if self.speculation is not None:
                    self.speculation.forget(delta.request_id)
        return outcome

    def _drain_inbox(self) -> None:
        while True:
            if self._held is not None:
                message, self._held = self._held, None
            else:
                try:
                    message = self._inbox.get_nowait()
                except queue.Empty:
                    return
            if isinstance(message, AddRequest):
                self._admit(message)
            elif isinstance(message, AbortRequest):
                self._apply_abort(message)
            elif isinstance(message, FinishRequest):
                self.scheduler.finish([message.request_id], message.reason, delivered=message.delivered)
            elif isinstance(message, CallInEngine):
                self._run_call(message)

    def _admit(self, message: AddRequest) -> None:
        """Queues a new request; any failure fails that request alone (the loop goes on)."""
        req = message.request
        try:
            if message.conversation_id is not None:
                length = self.scheduler.idle_conversation(message.conversation_id).sequence.num_tokens \
                    + len(message.new_token_ids)
                if req.output_offset > length:
                    raise EngineError(f"output_offset {req.output_offset} is past the conversation's "
                                      f"end ({length} tokens)")
                self.scheduler.start_conversation_request(req, message.new_token_ids)
            else:
                self.scheduler.add(req)
            req.sampling = SamplingState.create(req.params, req.sequence.token_ids[:req.prompt_len],
                                                self.eos_token_ids, device=self.runner.device,
                                                output_offset=req.output_offset)
            if req.params.constraint is not None:
                tokens = req.sequence.token_ids[:req.prompt_len]
                start = req.prompt_len if req.constraint_from is None else req.constraint_from
                if start > req.prompt_len:
                    raise EngineError(f"constraint_from {start} is past the conversation's end ({req.prompt_len})")
                req.sampling.grammar = self.grammars.matcher(req.params.constraint, tokens[start:], budget=min(req.params.max_tokens or self.max_model_len, self.max_model_len - req.prompt_len))  # the context ends it too
        except Exception as exc:  # a bad request must never take the loop down
            if req.request_id in self.scheduler.requests:
                self.scheduler.finish([req.request_id], FinishReason.ERROR, error=str(exc))
            else:
                self.scheduler.reject(req, str(exc) or type(exc).__name__)

    def _apply_abort(self, message: AbortRequest) -> None:
        req = self.scheduler.requests.get(message.request_id)
        if req is not None and req.cancel_requested_at is None:
            req.cancel_requested_at = message.requested_at
            req.cancel_requested_step = self.counters.steps
        self.scheduler.finish([message.request_id], FinishReason.CANCELLED, cancel_reason=message.reason,
                              delivered=message.delivered)

    def _run_call(self, message: CallInEngine) -> None:
        if not message.future.set_running_or_notify_cancel():
            return
        try:
            message.future.set_result(message.fn())
        except BaseException as exc:  # delivered to the caller, never raised here
            message.future.set_exception(exc)

    def _count_finish(self, delta: RequestDelta) -> None:
        reason = delta.finish_reason
        self.counters.finished[reason.value if reason else "unknown"] += 1
        if reason == FinishReason.CANCELLED and delta.cancel_reason is not None:
            self.counters.cancelled[delta.cancel_reason.value] += 1
            if delta.cancel_requested is not None:
                requested_at, requested_step = delta.cancel_requested
                self.counters.cancel_latencies.append(time.monotonic() - requested_at)
                self.counters.cancel_latency_steps.append(self.counters.steps - requested_step)
                self.counters.cancel_samples += 1  # a running total: metrics observe each sample once
            log.info("request %s cancelled (%s)", delta.request_id, delta.cancel_reason.value)
        elif reason == FinishReason.ERROR:
            log.warning("request %s failed: %s", delta.request_id, delta.error)

    # -- batch generation --------------------------------------------------------
    def generate(self, prompts: Iterable[str | Sequence[int]] | str,
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generates for every prompt; returns each one's final output, in order.

        Returns once the engine has ended every request too (a stop string found by
        the consumer side is applied at the next step).
        """
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        collector = OutputCollector(self)
        ids = [collector.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids) or collector.pending:
            for out in collector.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    # -- reporting (engine thread) ----------------------------------------------------
    def stats(self) -> EngineStats:
        return reports.engine_stats(self.scheduler, self.pool, self.counters,
                                    kv_disk=None if self.disk is None else self.disk.stats(),
                                    speculation=None if self.speculation is None else self.speculation.counts())

    def steps_after(self, index: int) -> list[StepRecord]:
        """The recent steps whose index is above ``index``, oldest first (see ``reports``)."""
        return reports.steps_after(self.counters, index)

    def list_requests(self) -> list[RequestInfo]:
        """Queued and running requests, oldest first."""
        return reports.request_infos(self.scheduler)

    def check_block_accounting(self) -> None:
        """Asserts contract C5 against every live block table (for tests and debugging)."""
        self.pool.check_invariants(self.scheduler.live_block_tables())
