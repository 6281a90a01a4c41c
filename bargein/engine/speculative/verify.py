"""Acceptance: which guesses a verification forward confirms.

A request speculates only while its sampling is *plain* (``sampler.row_sampling``: no
grammar, bias, penalties, logprobs or eos masking), so its token at index i depends on
nothing but its logits row and its random stream's key (seed, i). Row j of a verification
chunk holds the logits after the request's tokens and the first j guesses; if those
guesses were the tokens the request picks anyway, row j's token is exactly the token
index ``token_index + j`` it would have picked without speculation: the argmax for a
greedy request, the draw from the stream for (seed, token_index + j) for a sampled one.
So the confirmed tokens are rows 0..m where guesses 1..m equal the tokens of rows 0..m-1.
This keeps the stream itself, not only its distribution (the usual rejection rule would
change which token a seeded request gets).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bargein.engine.sampler import (
    RowSampling,
    SampledToken,
    SamplingState,
    row_sampling,
    sample_rows,
)


def can_verify(state: SamplingState | None) -> bool:
    """Whether a request's tokens can be confirmed row by row (its sampling is plain)."""
    return state is not None and row_sampling(state) is not None


def verify(logits: torch.Tensor, drafts: Sequence[int], state: SamplingState) -> tuple[SampledToken, ...]:
    """The tokens a verification chunk confirms: ``1 + m`` of them, where the first ``m``
    equal the first ``m`` guesses and the last is the request's own token after them.

    ``logits``: (1 + len(drafts), V), the chunk's rows in order. ``state`` must pass
    ``can_verify``; it is not changed (the scheduler ``accept``s the tokens it keeps).
    """
    plain = row_sampling(state)
    if plain is None:
        raise ValueError("a request whose sampling is not plain cannot be verified row by row")
    rows = [RowSampling(plain.params, plain.seed, plain.token_index + j) for j in range(len(drafts) + 1)]
    if plain.params.greedy:  # an argmax is cheap: every row at once
        targets = sample_rows(logits, rows)
        m = 0
        while m < len(drafts) and drafts[m] == targets[m]:
            m += 1
        return tuple(SampledToken(t, None, ()) for t in targets[:m + 1])
    # A sampled row costs about what a decode's forward does on a CPU (its truncation sorts
    # the vocabulary), so rows are drawn in order and only until the first miss: a step
    # draws as many rows as it yields tokens, as decoding without guesses would.
    out: list[SampledToken] = []
    for j, row in enumerate(rows):
        token = sample_rows(logits[j:j + 1], [row])[0]
        out.append(SampledToken(token, None, ()))
        if j == len(drafts) or token != drafts[j]:
            break
    return tuple(out)
