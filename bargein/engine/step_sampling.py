"""One step's tokens from its forward's result: sampled rows and verified guesses.

Split from :mod:`bargein.engine.engine` (engine thread). A plain chunk's token is sampled
from its logits row (or was picked by the runner: a pipeline's last stage); a chunk with
guesses (speculative decoding) gets the tokens its rows confirm
(:func:`bargein.engine.speculative.verify.verify`), a tuple of one or more.
"""

from __future__ import annotations

from collections.abc import Mapping

from bargein.engine.request import Request
from bargein.engine.runner import StepResult
from bargein.engine.sampler import SampledToken, Sampler
from bargein.engine.speculative.verify import verify

StepTokens = dict[str, SampledToken | tuple[SampledToken, ...]]


def sample_step(result: StepResult, requests: Mapping[str, Request], sampler: Sampler) -> StepTokens:
    """Each live sampling chunk's token(s), by request id. Requests no longer in
    ``requests`` (a conversation closed while its plan was in flight) are skipped."""
    plan = result.plan
    rows = plan.sampled  # a property that builds a tuple: once, not per row
    chosen = result.tokens or {}
    live = [i for i, c in enumerate(rows) if c.request_id in requests]
    sampled: StepTokens = {rows[i].request_id: SampledToken(chosen[i], None, ()) for i in live if i in chosen}
    if plan.has_drafts:
        return sampled | _verify_step(result, requests, sampler, live)
    need = [i for i in live if i not in chosen]
    if not need:
        return sampled
    logit_rows = [i for i in range(len(rows)) if i not in chosen]  # rows result.logits holds
    where = {row: k for k, row in enumerate(logit_rows)}
    picks = [where[i] for i in need]
    logits = result.logits if picks == list(range(len(logit_rows))) else result.logits[picks]
    chunks = [rows[i] for i in need]
    tokens = sampler.sample(logits, [requests[c.request_id].sampling for c in chunks])
    return sampled | {c.request_id: t for c, t in zip(chunks, tokens, strict=True)}


def _verify_step(result: StepResult, requests: Mapping[str, Request], sampler: Sampler,
                 live: list[int]) -> StepTokens:
    """A step with guesses (an in-process runner: every row's logits are returned)."""
    rows = result.plan.sampled
    first = [0]
    for c in rows:
        first.append(first[-1] + c.num_logits)
    plain = [i for i in live if not rows[i].draft_token_ids]
    out: StepTokens = {}
    if plain:
        logits = result.logits[[first[i] for i in plain]]
        tokens = sampler.sample(logits, [requests[rows[i].request_id].sampling for i in plain])
        out |= {rows[i].request_id: t for i, t in zip(plain, tokens, strict=True)}
    for i in live:
        chunk = rows[i]
        if chunk.draft_token_ids:
            logits = result.logits[first[i]:first[i + 1]]
            out[chunk.request_id] = verify(logits, chunk.draft_token_ids, requests[chunk.request_id].sampling)
    return out
