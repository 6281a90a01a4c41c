"""What a proposer is: guesses of a decoding request's next tokens, from its tokens alone."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class DraftRequest:
    """Guess at most ``k`` tokens to follow ``token_ids`` (the prompt and the answer so far)."""

    request_id: str
    token_ids: Sequence[int]
    k: int


class Proposer(Protocol):
    """Guesses tokens; guesses are only ever a hint, so any answer is correct for the
    engine's output (a wrong guess only costs its row in the verification forward).

    ``propose`` returns, per request it has guesses for, 1..k token ids (a request with
    none is left out). It may keep state per request id (an index, a draft model's K/V),
    checked against ``token_ids`` on every call, since a cancel or a rejected guess may
    have cut or changed the tail; ``forget`` drops it once the request ended.
    """

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, tuple[int, ...]]: ...

    def forget(self, request_id: str) -> None: ...
