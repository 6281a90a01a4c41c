"""The layer split weighs each node's measured speed as well as its memory (split.speed_factors,
split_reason) and the calibration that measures it (calibrate.calibration_rate), without Ray."""

from __future__ import annotations

import pytest

from bargein.distributed.calibrate import calibration_rate
from bargein.distributed.split import SLOW_NODE, speed_factors, split_by_memory, split_reason


def test_only_a_clearly_slower_node_is_weighed_down() -> None:
    assert speed_factors([100.0, 80.0, 100 * SLOW_NODE]) == [1.0, 1.0, 1.0]  # noise between equal machines
    assert speed_factors([100.0, 25.0]) == [1.0, 0.25]
    assert speed_factors([]) == [] and speed_factors([0.0, 0.0]) == [1.0, 1.0]


def test_a_slow_node_gets_fewer_layers_than_its_memory_alone_would_give() -> None:
    memories = [400.0, 400.0]
    assert split_by_memory(12, memories) == ((0, 6), (6, 12))
    weights = [m * f for m, f in zip(memories, speed_factors([100.0, 25.0]), strict=True)]
    assert split_by_memory(12, weights) == ((0, 10), (10, 12))


def test_the_reason_names_each_node_its_memory_and_its_speed() -> None:
    mib = 2**20
    assert split_reason(["10.0.0.11", "10.0.0.12"], [600 * mib, 300 * mib], [1.0, 0.25]) == (
        "by memory and measured speed: 10.0.0.11 600 MiB x1.00 speed, 10.0.0.12 300 MiB x0.25 speed")
    assert split_reason(["a", "a"], [mib, mib], None) == "by memory: a 1 MiB, a 1 MiB"


def test_the_calibration_measures_a_positive_rate() -> None:
    pytest.importorskip("torch")
    assert calibration_rate(1, hidden=64) > 0
