"""An engine's :class:`Speculation` from its config (None when speculation is off)."""

from __future__ import annotations

from bargein.config import EngineConfig
from bargein.engine.runner import ModelRunner, Runner
from bargein.engine.speculative.controller import Speculation
from bargein.engine.speculative.draft_model import DraftModelProposer, load_draft_model
from bargein.engine.speculative.ngram import NgramProposer
from bargein.engine.speculative.proposer import Proposer


def build_speculation(config: EngineConfig, runner: Runner, *, proposer: Proposer | None = None) -> Speculation | None:
    """``config.speculative``'s speculation for an engine over ``runner``; ``proposer``
    overrides the one the config names (tests pass a draft model built in memory).

    Raises ValueError where it cannot run: verification needs every row's logits, which
    only a runner in this process returns (a pipeline's last stage samples plain rows)."""
    spec = config.speculative
    if not spec.enabled and proposer is None:
        return None
    if not isinstance(runner, ModelRunner):
        raise ValueError("speculative decoding needs the model in this process; it does not run on a pipeline")
    if proposer is None:
        if spec.method == "ngram":
            proposer = NgramProposer(spec.ngram_min, spec.ngram_max)
        else:
            assert spec.draft_model is not None  # SpeculativeConfig checks it
            proposer = DraftModelProposer(load_draft_model(spec.draft_model, config), kv_tokens=spec.draft_kv_tokens,
                                          block_size=runner.block_size, target_vocab_size=runner.vocab_size)
    return Speculation(spec, proposer, max_num_batched_tokens=config.scheduler.max_num_batched_tokens)
