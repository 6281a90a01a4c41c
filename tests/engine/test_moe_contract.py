"""The cancellation contract on mixture-of-experts models (C3, C4, C5, C7; tests/data/moe).

A conversation is cancelled mid-answer, continued, forked and rewound; each answer must
equal, token for token, what an engine that never cancelled, forked or rewound (and has
no prefix cache) gives for the same tokens, in ``exact`` and in ``fast``
(``tests/engine/contract_harness.py``): the experts a token chooses, and so its answer,
must not depend on which other rows shared its steps or on whether its K/V came from a
decode step or a continuation's prefill.
"""

from __future__ import annotations

import pytest

from tests.engine.contract_harness import ContractHarness, Turns, check_cancel_continue_fork_rewind
from tests.model.moe_files import NAMES, model_path

MOE = ContractHarness(model_path)
# Qwen3-MoE's renormalised top k, and Qwen2-MoE's plain top k with a shared expert (Mixtral's
# routing is Qwen3-MoE's; tests/model/test_moe_families.py covers its parity).
CONTRACT_NAMES = [n for n in NAMES if n != "mixtral"]


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("name", CONTRACT_NAMES)
def test_cancel_continue_fork_rewind_equal_no_cancel(name: str, precision: str) -> None:
    check_cancel_continue_fork_rewind(MOE, name, precision, Turns(prompt_len=9, seed_offset=0, rewind_back=7))
