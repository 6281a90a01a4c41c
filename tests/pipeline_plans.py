"""Checks shared by the pipeline tests of both transports (``test_pipeline`` over the
session's cluster, ``graph_pipeline_checks`` over a one-node Ray instance)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bargein.engine.plan import ScheduledChunk, StepPlan
from bargein.engine.runner import StepFailed


def check_a_failing_plan_fails_alone(runner: Any, local_runner: Any, prompt: list[int]) -> None:
    """Stage 0 fails on a plan (a block id outside the pool) while the next plan is in
    flight: ``collect`` raises StepFailed naming the plan and the stage, no stage is lost,
    and the next plan runs in order on every stage with the single engine's logits."""
    bad = StepPlan(2001, (ScheduledChunk("x", (5, 6), 0, (10_000,), True),))
    good = StepPlan(2002, (ScheduledChunk("y", tuple(prompt), 0, (30, 31), True),))
    runner.submit(bad)
    runner.submit(good)
    with pytest.raises(StepFailed) as failed:
        runner.collect()
    assert failed.value.plan is bad and "pipeline stage 0 (layers 0-" in failed.value.error
    got = runner.collect()
    assert got.plan is good
    torch.testing.assert_close(got.logits, local_runner.execute(good), rtol=1e-5, atol=1e-5)
    assert runner.recovery.losses == 0 and runner.health().state == "ok"
    assert [c.steps_with("y")[-1:] for c in runner.stage_counters()] == [[2002]] * len(runner.actors)
