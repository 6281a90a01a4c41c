"""Batched sampling: one row of logits per request -> one token per request.

Per row, in this order (see ``SamplingParams``):

0. ``GrammarMasks.apply``: a constrained row's tokens that its grammar forbids become
   -inf (the masks of all constrained rows are filled together, before anything else).
1. ``adjust_logits``: mask eos and ``stop_token_ids`` while fewer than ``min_tokens``
   tokens were generated; add ``logit_bias``; apply ``repetition_penalty`` over prompt
   and output tokens (positive logits divided, negative multiplied); subtract
   ``presence_penalty * (count > 0) + frequency_penalty * count`` over output tokens.
2. ``truncate_logits``: a greedy row keeps only its argmax. Otherwise divide by the
   temperature, then keep the ``top_k`` largest, then the smallest prefix by probability
   whose mass reaches ``top_p``, then the tokens whose probability is at least ``min_p``
   times the largest. Dropped tokens become -inf. Ties at a cut are all kept.
3. Draw: ``argmax(kept_logits + gumbel)``, where the Gumbel noise comes from the row's own
   generator (the exponential-race trick, in log space). That samples exactly from
   ``softmax(kept_logits)``.

Reproducibility: before each draw, a non-greedy row's generator is re-seeded from
``(seed, token index)`` (index = tokens the request has kept so far) and then draws
exactly ``V`` uniforms; nothing comes from any shared RNG, and every operation works row
by row. So a seeded request's tokens depend neither on what else is in the batch nor on
where its row is, nor on the history of any generator object: a sequence that is
preempted, or whose batch died with a pipeline stage or a replica, and is recomputed from
its tokens draws the same noise for its next token as it would have without the fault.

Log-probabilities are of the model's distribution, ``log_softmax`` of the raw logits
passed to ``sample``, before bias, penalties, temperature and truncation: they say what
the model thought, not how the token was picked.

Device syncs: none until the chosen token ids (and log-probabilities) are copied to
Python at the end of ``sample``.

Vocabulary-wide rows (Gemma's 262,144 tokens): top_k alone takes its threshold from a
partial selection (``topk``), top_p sorts with numpy's vectorised sort, and a step where a
row truncates by top_k or top_p runs torch's operations on one intra-op thread
(``one_torch_thread``): with two, each of the dozen vocabulary-wide operations per row pays
an OpenMP fork and join whose second thread competes with the native kernels' pool (still
spinning after the forward) or anything else on a busy machine, and such steps took 3-15x
longer (gemma3-1b, 8 streams, interleaved in one engine). Temperature-only and logprobs
steps keep torch's threads: there one thread measured slower about as often as faster.
The operations are row-wise or exact (maxima, sorts, selections, cumulative sums along the
row), so the tokens and log-probabilities do not depend on any of this
(tests/engine/test_sampler_wide_vocab.py).
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from bargein.engine.device import one_torch_thread
from bargein.engine.grammar import GrammarMasks, GrammarMatcher
from bargein.engine.sampling import SamplingParams


@dataclass
class SamplingState:
    """What the sampler needs to know about one request, owned by the request.

    The sampler reads ``params``, ``prompt_token_ids``, ``output_token_ids`` and
    ``grammar`` (its mask) and advances ``generator``; it never appends to
    ``output_token_ids`` nor advances ``grammar``: the caller ``accept``s each token it
    keeps, so a token dropped by a cancel never counts for penalties or the grammar.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]  # for repetition_penalty
    output_token_ids: list[int]  # tokens generated so far, appended by the caller
    generator: torch.Generator  # this request's private random stream, re-seeded per token
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)  # masked for min_tokens
    grammar: GrammarMatcher | None = None  # the constrained request's matcher, made at admission
    seed: int = 0  # the random stream's key: token i draws from stream_seed(seed, i)
    # Output tokens generated before this request's prompt ended: a request resumed from its
    # tokens elsewhere (a lost replica) carries its earlier output as the prompt's tail. They
    # count as output for the random stream's index and for presence/frequency penalties,
    # so the resumed request draws exactly what the original would have (its params carry
    # the rest of min_tokens/max_tokens, counted in its own output).
    output_offset: int = 0

    @property
    def token_index(self) -> int:
        """The index of the next token in the whole answer (earlier output included)."""
        return self.output_offset + len(self.output_token_ids)

    @property
    def penalised_output(self) -> list[int]:
        """The answer's tokens so far, those resumed in the prompt included."""
        if not self.output_offset:
            return self.output_token_ids
        return [*self.prompt_token_ids[len(self.prompt_token_ids) - self.output_offset:], *self.output_token_ids]

    def accept(self, token_id: int) -> bool:
        """Records a kept token; False if the request's grammar does not allow it."""
        self.output_token_ids.append(token_id)
        return self.grammar is None or self.grammar.accept(token_id)

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        eos_token_ids: Iterable[int] = (),
        device: torch.device | str = "cpu",
        output_offset: int = 0,
    ) -> SamplingState:
        """A fresh state whose generator is seeded from ``params.seed``, else at random.

        ``device`` is where the generator draws; draw where the logits live to avoid a
        copy per step. ``output_offset``: how many of the prompt's last tokens are an
        earlier part of this answer (a resumed request).
        """
        generator = torch.Generator(device=device)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        generator.manual_seed(seed)
        if not 0 <= output_offset <= len(prompt_token_ids):
            raise ValueError(f"output_offset {output_offset} is outside the prompt (0..{len(prompt_token_ids)})")
        return cls(params, prompt_token_ids, [], generator, frozenset(eos_token_ids), seed=seed,
                   output_offset=output_offset)

    @property
    def masks_eos(self) -> bool:
        """Whether eos and ``stop_token_ids`` are masked now (``min_tokens`` not reached).

        Counted in this request's own output, as the scheduler's stop check counts it: a
        resumed request's ``params`` hold what is left of ``min_tokens``/``max_tokens``."""
        return len(self.output_token_ids) < self.params.min_tokens


@dataclass(frozen=True)
class SampledToken:
    """One sampled token and, if the request asked for them, log-probabilities."""

    token_id: int
    logprob: float | None  # of the sampled token under the model; None without logprobs
    top_logprobs: tuple[tuple[int, float], ...]  # (token_id, logprob), best first


class Sampler:
    """Picks one token per row of a (B, V) logits tensor; holds no request state (the
    grammar masks' worker threads are its only state)."""

    def __init__(self) -> None:
        self.grammar_masks = GrammarMasks()

    def sample(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> list[SampledToken]:
        """Sample row i of ``logits`` for ``states[i]``, advancing its generator."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(
                f"logits must be (len(states), V) = ({len(states)}, V), got {tuple(logits.shape)}"
            )
        logits = logits.float()  # the model's distribution, for log-probabilities
        allowed = self.grammar_masks.apply(logits, [s.grammar for s in states])
        if all(_plain_greedy(state) for state in states):
            # Fast path: nothing to adjust and nothing to report, one batched argmax.
            return [SampledToken(t, None, ()) for t in argmax_rows(allowed)]
        with _threads_for([s.params for s in states]):  # see the module's docstring (Threads)
            kept = truncate_logits(adjust_logits(allowed, states), [s.params for s in states])
            token_ids = (kept + _gumbel_noise(logits, states)).argmax(dim=-1)  # (B,)
            return _with_logprobs(logits, token_ids, states)


def adjust_logits(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Step 1: min_tokens masking, logit bias, repetition, presence and frequency penalties.

    Returns a new (B, V) tensor; ``logits`` is not changed.
    """
    logits = logits.clone()
    rows, cols = _flat_indices(
        (row, state.eos_token_ids | frozenset(state.params.stop_token_ids))
        for row, state in enumerate(states)
        if state.masks_eos
    )
    if rows:
        logits[_index(rows, logits), _index(cols, logits)] = float("-inf")

    rows, cols = _flat_indices(
        (row, [token_id for token_id, _ in state.params.logit_bias])
        for row, state in enumerate(states)
    )
    if rows:
        biases = [bias for state in states for _, bias in state.params.logit_bias]
        logits.index_put_(
            (_index(rows, logits), _index(cols, logits)),
            torch.tensor(biases, dtype=logits.dtype, device=logits.device),
            accumulate=True,
        )

    if any(state.params.repetition_penalty != 1.0 for state in states):
        logits = _repetition_penalty(logits, states)
    if any(s.params.presence_penalty or s.params.frequency_penalty for s in states):
        logits = _presence_frequency_penalty(logits, states)
    return logits


def truncate_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Step 2: temperature, top_k, top_p and min_p; dropped tokens become -inf.

    Kept tokens hold ``(logit - row_max) / temperature``, so ``softmax`` of a row is the
    distribution that row samples from. A greedy row keeps exactly its (first) argmax.
    """
    # Shifting by the row max before dividing keeps a tiny temperature from overflowing:
    # the best token is 0 and the rest go to -inf, which is the right limit.
    row_max = logits.max(dim=-1, keepdim=True).values
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    temperature = _column([p.temperature if not p.greedy else 1.0 for p in params], logits)
    scaled = (logits - row_max) / temperature  # (B, V)

    threshold = torch.full_like(row_max, float("-inf"))  # (B, 1): keep scaled >= threshold
    vocab_size = logits.shape[-1]
    top_k = [min(p.top_k or vocab_size, vocab_size) for p in params]
    if all(p.top_p == 1.0 for p in params) and any(p.top_k is not None for p in params):
        # top_k alone: its k-th largest value is the threshold (below, ``last_kept`` is
        # then -inf or that same value), and a partial selection finds it without sorting
        # the whole vocabulary.
        has_k = [p.top_k is not None for p in params]
        largest = scaled.topk(max(k for k, has in zip(top_k, has_k, strict=True) if has), dim=-1).values
        kth = largest.gather(1, _column([k if has else 1 for k, has in zip(top_k, has_k, strict=True)],
                                        logits, torch.long) - 1)  # (B, 1)
        threshold = torch.where(_column(has_k, logits, torch.bool), kth, threshold)  # no top_k: keep all
    elif any(p.top_k is not None or p.top_p < 1.0 for p in params):
        sorted_desc = _sorted_descending(scaled)  # (B, V)
        kth = sorted_desc.gather(1, _column(top_k, logits, torch.long) - 1)  # (B, 1)
        sorted_desc = torch.where(sorted_desc >= kth, sorted_desc, float("-inf"))
        probs = sorted_desc.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # nondecreasing, so `within` is a prefix
        within = mass_before < _column([p.top_p for p in params], logits)
        within |= _column([p.top_p == 1.0 for p in params], logits, torch.bool)
        last_kept = sorted_desc.gather(1, within.sum(dim=-1, keepdim=True) - 1)
        threshold = torch.maximum(kth, last_kept)
    if any(p.min_p > 0.0 for p in params):
        # p / p_max >= min_p  <=>  scaled >= log(min_p), since the best token is at 0.
        log_min_p = _column([p.min_p for p in params], logits).log()
        threshold = torch.maximum(threshold, log_min_p)
    kept = torch.where(scaled >= threshold, scaled, float("-inf"))

    if any(p.greedy for p in params):
        best = logits.argmax(dim=-1, keepdim=True)
        one_hot = torch.full_like(logits, float("-inf")).scatter_(1, best, 0.0)
        kept = torch.where(_column([p.greedy for p in params], logits, torch.bool), one_hot, kept)
    return kept


def _threads_for(params: Sequence[SamplingParams]) -> contextlib.AbstractContextManager[None]:
    """One torch thread where a row truncates by top_k or top_p (see the module's docstring,
    Threads); torch's own count otherwise, where one thread measured slower as often as faster."""
    truncates = any(p.top_k is not None or p.top_p < 1.0 for p in params if not p.greedy)
    return one_torch_thread() if truncates else contextlib.nullcontext()


def _sorted_descending(values: torch.Tensor) -> torch.Tensor:
    """Each row's values from largest to smallest (the values of ``sort(descending=True)``):
    on the CPU by numpy's vectorised sort, several times torch's on a 262,144-token row."""
    if values.device.type != "cpu":
        return values.sort(dim=-1, descending=True).values
    return torch.from_numpy(np.ascontiguousarray(np.sort(values.numpy(), axis=-1)[:, ::-1]))


def _plain_greedy(state: SamplingState) -> bool:
    """Whether the row's token is simply the argmax of the raw logits, with no logprobs."""
    p = state.params
    return (
        p.greedy
        and p.logprobs is None
        and not p.logit_bias
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
        and not (state.masks_eos and (state.eos_token_ids or p.stop_token_ids))
    )


@dataclass(frozen=True)
class RowSampling:
    """Everything a *plain* row's token depends on besides its logits: the params that
    truncate it and its random stream's key. Plain: no grammar, logit bias, penalties,
    logprobs, nor eos masking now, so ``sample_rows`` picks exactly the token that
    ``Sampler.sample`` would, anywhere (a pipeline's last stage picks it there and sends
    one integer instead of a row of logits)."""

    params: SamplingParams
    seed: int
    token_index: int  # tokens the request has kept so far


def row_sampling(state: SamplingState) -> RowSampling | None:
    """The row's ``RowSampling`` if it is plain, else None (the head samples it)."""
    p = state.params
    plain = (state.grammar is None and p.logprobs is None and not p.logit_bias and p.repetition_penalty == 1.0
             and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
             and not (state.masks_eos and (state.eos_token_ids or p.stop_token_ids)))
    return RowSampling(p, state.seed, state.token_index) if plain else None


def sample_rows(logits: torch.Tensor, rows: Sequence[RowSampling]) -> list[int]:
    """The tokens ``Sampler.sample`` picks for plain rows (same truncation, same noise)."""
    logits = logits.float()
    if all(r.params.greedy for r in rows):
        return argmax_rows(logits)
    with _threads_for([r.params for r in rows]):  # see the module's docstring (Threads)
        kept = truncate_logits(logits, [r.params for r in rows])
        generator = torch.Generator(device=logits.device)
        noise = [_row_noise(r.params.greedy, generator, r.seed, r.token_index, logits) for r in rows]
        return argmax_rows(kept + torch.stack(noise))


def argmax_rows(values: torch.Tensor) -> list[int]:
    """Each row's argmax (the first of equal maxima, as ``torch.argmax``), on one thread
    on the CPU: torch reduces several vocabulary-wide rows in an OpenMP region, whose
    fork and join (and its threads' spinning after it, against the kernels' own pool)
    cost more than the reduction (a batch's decodes, speculative verification's 1 + k rows)."""
    if values.device.type != "cpu":
        return values.argmax(dim=-1).tolist()
    return values.numpy().argmax(axis=-1).tolist()


_MASK64 = (1 << 64) - 1


def stream_seed(seed: int, token_index: int) -> int:
    """The generator seed for a request's ``token_index``-th token: a 63-bit mix of both.

    SplitMix64's finalizer over ``seed`` and the index, so neighbouring indices (and
    neighbouring seeds) give unrelated streams.
    """
    z = (seed * 0x9E3779B97F4A7C15 + (token_index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _gumbel_noise(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """(B, V) Gumbel noise, V draws from each non-greedy row's generator; 0 for greedy rows."""
    return torch.stack([_row_noise(s.params.greedy, s.generator, s.seed, s.token_index, logits) for s in states])


def _row_noise(greedy: bool, generator: torch.Generator, seed: int, token_index: int,
               logits: torch.Tensor) -> torch.Tensor:
    """One row's (V,) Gumbel noise for its ``token_index``-th token: ``generator`` is
    re-seeded from ``(seed, token_index)`` and draws V uniforms; zeros for a greedy row."""
    vocab_size = logits.shape[-1]
    if greedy:
        return torch.zeros(vocab_size, device=logits.device)
    generator.manual_seed(stream_seed(seed, token_index))
    uniform = torch.rand(vocab_size, generator=generator, device=generator.device).to(logits.device)
    # -log(u) ~ Exp(1) and -log(Exp(1)) ~ Gumbel; clamping u keeps both finite.
    return -(-uniform.clamp_min(torch.finfo(torch.float32).tiny).log()).log()


def _with_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, states: Sequence[SamplingState]
) -> list[SampledToken]:
    """Package the chosen tokens with the model's log-probabilities where asked for."""
    wanted = [state.params.logprobs for state in states]
    if all(n is None for n in wanted):
        return [SampledToken(t, None, ()) for t in token_ids.tolist()]
    logprobs = logits.log_softmax(dim=-1)  # of the raw logits: the model's distribution
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    num_top = max(n for n in wanted if n is not None)
    top = logprobs.topk(num_top, dim=-1) if num_top else None
    # The first .tolist() waits for the device; the later ones find the work done.
    ids, values = token_ids.tolist(), chosen.tolist()
    top_ids = top.indices.tolist() if top is not None else [[] for _ in states]
    top_values = top.values.tolist() if top is not None else [[] for _ in states]
    out = []
    for row, n in enumerate(wanted):
        if n is None:
            out.append(SampledToken(ids[row], None, ()))
        else:
            alternatives = tuple(zip(top_ids[row][:n], top_values[row][:n], strict=True))
            out.append(SampledToken(ids[row], values[row], alternatives))
    return out


def _repetition_penalty(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    seen_rows, seen_cols = _flat_indices(
        (row, [*state.prompt_token_ids, *state.output_token_ids])
        for row, state in enumerate(states)
        if state.params.repetition_penalty != 1.0
    )
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen[_index(seen_rows, logits), _index(seen_cols, logits)] = True
    penalty = _column([s.params.repetition_penalty for s in states], logits)
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def _presence_frequency_penalty(
    logits: torch.Tensor, states: Sequence[SamplingState]
) -> torch.Tensor:
    rows, cols = _flat_indices((row, state.penalised_output) for row, state in enumerate(states))
    counts = torch.zeros_like(logits)
    counts.index_put_(
        (_index(rows, logits), _index(cols, logits)),
        torch.ones(len(rows), dtype=logits.dtype, device=logits.device),
        accumulate=True,
    )
    presence = _column([s.params.presence_penalty for s in states], logits)
    frequency = _column([s.params.frequency_penalty for s in states], logits)
    return logits - presence * (counts > 0) - frequency * counts


def _flat_indices(
    row_tokens: Iterable[tuple[int, Iterable[int]]],
) -> tuple[list[int], list[int]]:
    """(row, token ids) pairs -> parallel row and column index lists for one index_put."""
    rows: list[int] = []
    cols: list[int] = []
    for row, tokens in row_tokens:
        tokens = list(tokens)
        rows.extend([row] * len(tokens))
        cols.extend(tokens)
    return rows, cols


def _index(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)


def _column(values: list, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Per-row values as a (B, 1) tensor on ``like``'s device, to broadcast over V."""
    return torch.tensor(values, dtype=dtype or like.dtype, device=like.device).unsqueeze(1)
