"""Engine: the synchronous core. ``add_request``, ``abort``, ``step``, ``generate``.

One step reads like the architecture::

    plan = scheduler.schedule()
    logits = runner.execute(plan)
    tokens = sampler.sample(logits, states)
    requests = scheduler.update(plan, tokens)

with the inbox drained before the schedule and again right after the forward, so a
cancel requested while step k runs takes effect at the end of step k (C1), and the
token sampled in step k is then dropped (C2).

Threads: ``step`` and the session methods belong to one thread (the engine's owner:
the caller of a plain Engine, or AsyncEngine's loop thread). ``add_request``, ``abort``
and ``call_soon`` may be called from any thread; they go through the ordered inbox.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from bargein.config import EngineConfig, ModelConfig
from bargein.engine.blocks import BlockPool
from bargein.engine.detokenizer import IncrementalDetokenizer
from bargein.engine.messages import AbortRequest, AddRequest, CallInEngine, EngineMessage
from bargein.engine.request import (
    AbortResult,
    CancelReason,
    FinishReason,
    Request,
    RequestOutput,
    RequestStatus,
    TokenLogprob,
)
from bargein.engine.request import (
    Sequence as TokenSequence,
)
from bargein.engine.runner import ModelRunner
from bargein.engine.sampler import SampledToken, Sampler, SamplingState
from bargein.engine.sampling import SamplingParams
from bargein.engine.scheduler import Scheduler
from bargein.engine.stats import EngineCounters, EngineStats, RequestInfo
from bargein.model.llama import LlamaStage

log = logging.getLogger("bargein.engine")

_MIN_BLOCKS = 16
_ID_MEMORY = 10_000


class EngineError(Exception):
    """A request the engine refuses (bad prompt, id in use); the message says why."""


@dataclass
class _Tracker:
    """Per-request output state, owned by the engine thread."""

    request: Request
    sampling: SamplingState
    detokenizer: IncrementalDetokenizer
    delivered: int = 0  # output tokens already reported
    cancel_requested_at: float | None = None
    cancel_requested_step: int | None = None


class _IdRegistry:
    """Which request ids are live or recently finished, readable from any thread (C6)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[str] = set()
        self._finished: OrderedDict[str, None] = OrderedDict()

    def claim(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._live:
                raise EngineError(f"request id {request_id!r} is already in use")
            self._finished.pop(request_id, None)
            self._live.add(request_id)

    def finish(self, request_id: str) -> None:
        with self._lock:
            self._live.discard(request_id)
            self._finished[request_id] = None
            if len(self._finished) > _ID_MEMORY:
                self._finished.popitem(last=False)

    def status(self, request_id: str) -> AbortResult:
        with self._lock:
            if request_id in self._live:
                return AbortResult.CANCELLED
            if request_id in self._finished:
                return AbortResult.ALREADY_FINISHED
            return AbortResult.NOT_FOUND

    def live(self) -> list[str]:
        with self._lock:
            return list(self._live)


class Engine:
    """A model, its KV cache, a scheduler and a sampler, stepped by one thread."""

    def __init__(self, stages: LlamaStage | Sequence[LlamaStage], tokenizer: Any,
                 config: EngineConfig | None = None, *, model_name: str = "model"):
        self.config = config or EngineConfig()
        stages = [stages] if isinstance(stages, LlamaStage) else list(stages)
        self.model_config: ModelConfig = stages[0].config
        self.tokenizer = tokenizer
        self.model_name = model_name
        cache = self.config.cache
        bytes_per_block = sum(s.kv_bytes_per_block(cache.block_size) for s in stages)
        num_blocks = cache.num_blocks or max(_MIN_BLOCKS, cache.memory_bytes // bytes_per_block)
        self.pool = BlockPool(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.runner = ModelRunner(stages, num_blocks, cache.block_size)
        max_len = self.config.max_model_len or self.model_config.max_position_embeddings
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self.scheduler = Scheduler(self.config.scheduler, self.pool, max_len, self.eos_token_ids)
        self.sampler = Sampler()
        self.counters = EngineCounters()
        self._inbox: queue.SimpleQueue[EngineMessage] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._ids = _IdRegistry()
        self._trackers: dict[str, _Tracker] = {}
        self._pending_outputs: list[RequestOutput] = []  # outputs made between steps

    # -- construction -------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, ref: str | None = None, config: EngineConfig | None = None, *,
                        progress: bool = True) -> Engine:
        """Loads a model reference: None (the bundled SmolLM2), a .gguf file or an HF folder."""
        from bargein.loader import load_config, load_tokenizer, load_weights, resolve_model_ref

        config = config or EngineConfig()
        source = resolve_model_ref(ref)
        model_config = load_config(source)
        dtype = getattr(torch, config.dtype)
        weights = load_weights(source, model_config, dtype=dtype, progress=progress)
        weights = {name: w.to(config.device) for name, w in weights.items()}
        max_len = config.max_model_len or model_config.max_position_embeddings
        # Built on the target device, so each layer picks that device's fastest kernel.
        model = LlamaStage(model_config, weights, max_positions=max_len,
                           native_kernels=config.native_kernels).to(config.device)
        return cls(model, load_tokenizer(source), config, model_name=source.name)

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    # -- any thread ---------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{uuid.uuid4().hex[:16]}"

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, timeout: float | None = None,
                    session_id: str | None = None) -> str:
        """Queues a generation; returns its id. Raises EngineError for a bad request.

        With ``session_id``, the prompt's tokens are appended to that conversation's
        sequence and the answer generated onto it; the sequence keeps its K/V after.
        ``timeout`` (seconds) sets a deadline, after which the request is cancelled
        with reason ``deadline``.
        """
        params = params or SamplingParams()
        params.validate_for_vocab(self.model_config.vocab_size)
        token_ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        bad = [t for t in token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise EngineError(f"token id {bad[0]} is outside the vocabulary (0..{self.model_config.vocab_size - 1})")
        if session_id is None:
            if not token_ids:
                raise EngineError("the prompt is empty")
            if len(token_ids) >= self.max_model_len:
                raise EngineError(f"the prompt is {len(token_ids)} tokens, but the context holds "
                                  f"{self.max_model_len} (room is needed for at least one generated token)")
        if timeout is not None and not timeout > 0:
            raise EngineError("timeout must be a positive number of seconds")
        request_id = request_id or self.new_request_id()
        self._ids.claim(request_id)
        sequence = TokenSequence(request_id if session_id is None else session_id, list(token_ids))
        request = Request(
            request_id=request_id, sequence=sequence, params=params,
            prompt_len=len(token_ids), new_prompt_tokens=len(token_ids),
            owns_sequence=session_id is None,
            deadline=None if timeout is None else time.monotonic() + timeout,
        )
        self._post(AddRequest(request, session_id, tuple(token_ids)))
        return request_id

    def abort(self, request_id: str, reason: CancelReason = CancelReason.USER) -> AbortResult:
        """Cancels a request from any thread (C6): idempotent, never raises.

        Returns NOT_FOUND for an unknown id and ALREADY_FINISHED for a finished one.
        The request's last output, with ``finish_reason == "cancelled"``, follows at
        the next step boundary.
        """
        result = self._ids.status(request_id)
        if result == AbortResult.CANCELLED:
            self._post(AbortRequest(request_id, CancelReason(reason), time.monotonic()))
        return result

    def call_soon(self, fn: Callable[[], Any]) -> Future:
        """Runs ``fn`` in the engine's thread at the next step boundary."""
        message = CallInEngine(fn)
        self._post(message)
        return message.future

    def live_request_ids(self) -> list[str]:
        return self._ids.live()

    def wait_for_work(self, timeout: float | None = None) -> None:
        """Blocks until a message arrives or there is work to step (for a step loop)."""
        if self.has_work:
            return
        self._wakeup.wait(timeout)
        self._wakeup.clear()

    def wake(self) -> None:
        """Ends a ``wait_for_work`` early (the step loop is being stopped)."""
        self._wakeup.set()

    def _post(self, message: EngineMessage) -> None:
        self._inbox.put(message)
        self._wakeup.set()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    # -- the engine's thread ------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or not self._inbox.empty()

    def step(self) -> list[RequestOutput]:
        """Runs one step; returns an output for every request it changed."""
        touched: dict[str, Request] = {}
        self._drain_inbox(touched)
        for req in self.scheduler.expire_deadlines():
            touched[req.request_id] = req
        plan = self.scheduler.schedule()
        sampled: dict[str, SampledToken] = {}
        if not plan.is_empty:
            started = time.perf_counter()
            try:
                logits = self.runner.execute(plan)
                chunks = plan.sampled
                tokens = self.sampler.sample(logits, [self._trackers[c.request_id].sampling for c in chunks])
            except Exception as exc:  # the loop survives; the step's requests fail, the rest go on
                log.exception("step %d failed", plan.step)
                self.scheduler.fail_step(plan, f"the model step failed: {type(exc).__name__}: {exc}")
                return self._finish_step(touched, {})
            sampled = {c.request_id: t for c, t in zip(chunks, tokens, strict=True)}
            self.counters.step_durations.append(time.perf_counter() - started)
            self.counters.steps += 1
        self._drain_inbox(touched)  # cancels that arrived during the forward (C1)
        for req in self.scheduler.expire_deadlines():
            touched[req.request_id] = req
        for req in self.scheduler.update(plan, {rid: t.token_id for rid, t in sampled.items()}):
            touched[req.request_id] = req
        return self._finish_step(touched, sampled)

    def _finish_step(self, touched: dict[str, Request], sampled: dict[str, SampledToken]) -> list[RequestOutput]:
        for req in self.scheduler.drain_finished():
            touched[req.request_id] = req
        outputs, self._pending_outputs = self._pending_outputs, []
        outputs += [out for req in touched.values() if (out := self._output(req, sampled)) is not None]
        return outputs

    def _drain_inbox(self, touched: dict[str, Request]) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, AddRequest):
                self._admit(message, touched)
            elif isinstance(message, AbortRequest):
                self._apply_abort(message, touched)
            else:
                self._run_call(message)

    def _admit(self, message: AddRequest, touched: dict[str, Request]) -> None:
        req = message.request
        try:
            if message.session_id is not None:
                self._bind_to_session(req, message.session_id, message.new_token_ids)
            else:
                self.scheduler.add(req)
        except Exception as exc:  # a bad request must never take the loop down
            req.finish(FinishReason.ERROR, error=str(exc))
            self._trackers[req.request_id] = self._make_tracker(req)
            touched[req.request_id] = req
            return
        self._trackers[req.request_id] = self._make_tracker(req)

    def _bind_to_session(self, req: Request, session_id: str, new_tokens: tuple[int, ...]) -> None:
        session = self.scheduler.session(session_id)
        seq = session.sequence
        if session.active is not None:
            raise EngineError(f"conversation {session_id!r} is already generating")
        if not seq.token_ids and not new_tokens:
            raise EngineError("the conversation is empty: prompt it first")
        if seq.num_tokens + len(new_tokens) >= self.max_model_len:
            raise EngineError(f"the conversation would be {seq.num_tokens + len(new_tokens)} tokens, "
                              f"but the context holds {self.max_model_len}")
        seq.token_ids.extend(new_tokens)
        req.sequence = seq
        req.prompt_len = seq.num_tokens
        self.scheduler.start_session_request(req)

    def _make_tracker(self, req: Request) -> _Tracker:
        state = SamplingState.create(req.params, req.sequence.token_ids[:req.prompt_len], self.eos_token_ids,
                                     device=self.runner.device)
        detok = IncrementalDetokenizer(self.tokenizer, stop=req.params.stop,
                                       skip_special_tokens=req.params.skip_special_tokens)
        return _Tracker(req, state, detok)

    def _apply_abort(self, message: AbortRequest, touched: dict[str, Request]) -> None:
        tracker = self._trackers.get(message.request_id)
        if tracker is not None and tracker.cancel_requested_at is None:
            tracker.cancel_requested_at = message.requested_at
            tracker.cancel_requested_step = self.counters.steps
        result = self.scheduler.abort(message.request_id, message.reason)
        if result == AbortResult.CANCELLED and tracker is not None:
            touched[message.request_id] = tracker.request

    def _run_call(self, message: CallInEngine) -> None:
        if not message.future.set_running_or_notify_cancel():
            return
        try:
            message.future.set_result(message.fn())
        except BaseException as exc:  # delivered to the caller, never raised here
            message.future.set_exception(exc)

    def _output(self, req: Request, sampled: dict[str, SampledToken] | None = None) -> RequestOutput | None:
        tracker = self._trackers.get(req.request_id)
        if tracker is None:
            return None
        new_tokens = req.output_token_ids[tracker.delivered:]
        delta = []
        for token in new_tokens:
            tracker.sampling.output_token_ids.append(token)
            delta.append(tracker.detokenizer.push(token))
        tracker.delivered += len(new_tokens)
        self.counters.generated_tokens += len(new_tokens)
        if tracker.detokenizer.stop_matched is not None and not req.is_finished:
            self.scheduler.finish_request(req.request_id, FinishReason.STOP)
            self.scheduler.drain_finished()
        if req.is_finished:
            delta.append(tracker.detokenizer.flush())
        if not new_tokens and not req.is_finished:
            return None
        logprobs: tuple[TokenLogprob, ...] = ()
        token = (sampled or {}).get(req.request_id)
        if new_tokens and token is not None and token.logprob is not None and token.token_id == new_tokens[-1]:
            logprobs = (TokenLogprob(token.token_id, token.logprob, token.top_logprobs),)
        out = RequestOutput(
            request_id=req.request_id,
            new_token_ids=tuple(new_tokens),
            token_ids=tuple(req.output_token_ids),
            delta_text="".join(delta),
            text=tracker.detokenizer.text,
            finished=req.is_finished,
            finish_reason=req.finish_reason,
            usage=req.usage(),
            cancel_reason=req.cancel_reason if req.finish_reason == FinishReason.CANCELLED else None,
            error=req.error,
            new_logprobs=logprobs,
            prompt_token_ids=tuple(req.sequence.token_ids[:req.prompt_len]),
        )
        if req.is_finished:
            self._retire(req, tracker)
        return out

    def _retire(self, req: Request, tracker: _Tracker) -> None:
        del self._trackers[req.request_id]
        self._ids.finish(req.request_id)
        reason = req.finish_reason.value if req.finish_reason else "unknown"
        self.counters.finished[reason] += 1
        if req.finish_reason == FinishReason.CANCELLED and req.cancel_reason is not None:
            self.counters.cancelled[req.cancel_reason.value] += 1
            if tracker.cancel_requested_at is not None:
                self.counters.cancel_latencies.append(time.monotonic() - tracker.cancel_requested_at)
                self.counters.cancel_latency_steps.append(self.counters.steps - tracker.cancel_requested_step)
                self.counters.cancel_samples += 1
            log.info("request %s cancelled (%s) after %d tokens", req.request_id, req.cancel_reason.value,
                     req.num_output_tokens)
        elif req.finish_reason == FinishReason.ERROR:
            log.warning("request %s failed: %s", req.request_id, req.error)

    # -- batch generation --------------------------------------------------------
    def generate(self, prompts: Iterable[str | Sequence[int]] | str,
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generates for every prompt; returns each one's final output, in order."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    # -- conversations' sequences (engine thread) ----------------------------------
    def open_session(self, token_ids: Iterable[int] = (), session_id: str | None = None) -> str:
        session_id = session_id or f"conv-{uuid.uuid4().hex[:16]}"
        self.scheduler.open_session(session_id, token_ids)
        return session_id

    def session_tokens(self, session_id: str) -> list[int]:
        return list(self.scheduler.session(session_id).sequence.token_ids)

    def append_session_tokens(self, session_id: str, token_ids: Sequence[int]) -> None:
        seq = self.scheduler.idle_session(session_id).sequence
        if seq.num_tokens + len(token_ids) >= self.max_model_len:
            raise EngineError(f"the conversation would be {seq.num_tokens + len(token_ids)} tokens, "
                              f"but the context holds {self.max_model_len}")
        seq.token_ids.extend(int(t) for t in token_ids)

    def fork_session(self, session_id: str) -> str:
        new_id = f"conv-{uuid.uuid4().hex[:16]}"
        self.scheduler.fork_session(session_id, new_id)
        return new_id

    def truncate_session(self, session_id: str, num_tokens: int) -> None:
        self.scheduler.truncate_session(session_id, num_tokens)

    def close_session(self, session_id: str) -> None:
        """Closes a conversation, cancelling its request if one is generating."""
        session = self.scheduler.sessions.get(session_id)
        if session is None:
            return
        active = session.active
        if active is not None:
            self.scheduler.abort(active.request_id, CancelReason.USER)
            self.scheduler.drain_finished()
            if (out := self._output(active)) is not None:
                self._pending_outputs.append(out)  # reported by the next step
        self.scheduler.close_session(session_id)

    # -- reporting ------------------------------------------------------------------
    def stats(self) -> EngineStats:
        pool = self.pool
        return EngineStats(
            kv_blocks_total=pool.num_blocks,
            kv_blocks_free=pool.num_free,
            kv_blocks_cached=pool.num_cached,
            kv_blocks_used=pool.num_referenced,
            block_size=pool.block_size,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            conversations=len(self.scheduler.sessions),
            steps=self.counters.steps,
            prefix_cache_hit_tokens=self.scheduler.num_prefix_hit_tokens,
            prefix_cache_hit_blocks=pool.prefix_hit_blocks,
            prefix_cache_query_blocks=pool.prefix_query_blocks,
            computed_tokens=self.scheduler.num_computed_tokens,
            generated_tokens=self.counters.generated_tokens,
            preemptions=self.scheduler.num_preemptions,
            finished=dict(self.counters.finished),
            cancelled=dict(self.counters.cancelled),
        )

    def list_requests(self) -> list[RequestInfo]:
        """Queued and running requests, oldest first (engine thread)."""
        now = time.monotonic()
        names = {RequestStatus.WAITING: "queued", RequestStatus.RUNNING: "running",
                 RequestStatus.PREEMPTED: "preempted"}
        infos = []
        for req in sorted(self.scheduler.requests.values(), key=lambda r: r.arrival_time):
            infos.append(RequestInfo(
                request_id=req.request_id,
                status=names.get(req.status, req.status.name.lower()),
                prompt_tokens=req.prompt_len,
                completion_tokens=req.num_output_tokens,
                age_s=now - req.arrival_time,
                deadline_s=None if req.deadline is None else max(0.0, req.deadline - now),
                session_id=None if req.owns_sequence else req.sequence.seq_id,
            ))
        return infos

    def check_block_accounting(self) -> None:
        """Asserts contract C5 against every live block table (for tests and debugging)."""
        self.pool.check_invariants(self.scheduler.live_block_tables())
