"""The cancellation contract for every family (C3, C4, C5, C7), with cancels inside and
beyond the sliding window of the families that have one (8 tokens, tests/data/families).

A conversation is cancelled mid-answer, continued, forked and rewound across the window;
each answer must equal, token for token, what an engine that never cancelled, forked or
rewound (and has no prefix cache) gives for the same tokens, in ``exact`` and in ``fast``;
a continuation computes only tokens without K/V; when all is closed no block is held
(``tests/engine/contract_harness.py``).
"""

from __future__ import annotations

import pytest

from tests.engine.contract_harness import ContractHarness, Turns, check_cancel_continue_fork_rewind
from tests.model.family_files import NAMES, model_path, spec

FAMILIES = ContractHarness(model_path)

# A cancel at 6 tokens (inside an 8-token window) and at 16 (beyond it) where the family's
# file has a window; one cancel (at 16) where it has none, for whom the two are alike.
CASES = [pytest.param(name, prompt_len, id=f"{name}-{where if spec(name).window else 'no-window'}")
         for name in NAMES for prompt_len, where in ((3, "inside-window"), (13, "beyond-window"))
         if spec(name).window or prompt_len == 13]


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize(("name", "prompt_len"), CASES)
def test_cancel_continue_fork_rewind_equal_no_cancel(name: str, precision: str, prompt_len: int) -> None:
    # The rewind goes back 10 tokens: across the window's worth of tokens.
    check_cancel_continue_fork_rewind(FAMILIES, name, precision, Turns(prompt_len, seed_offset=prompt_len,
                                                                       rewind_back=10))
