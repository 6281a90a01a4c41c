"""The layer split weighs each node's measured speed as well as its memory (split.speed_factors,
split_reason) and the calibration that measures it (calibrate: the model's layer shapes,
cached per node and model, the CPUs a cgroup quota allows), without Ray."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from bargein.distributed import calibrate
from bargein.distributed.calibrate import LayerShapes, layer_rate, node_rate
from bargein.distributed.node_cpus import usable_cpus
from bargein.distributed.split import SLOW_NODE, speed_factors, split_by_memory, split_reason
from tests import cpu_limits
from tests.tiny_models import TinySpec, tiny_config


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
    assert split_reason(["10.0.0.11", "10.0.0.12"], [600 * mib, 300 * mib], [812.4, 203.0]) == (
        "by memory and measured speed: 10.0.0.11 600 MiB 812 layers/s x1.00, 10.0.0.12 300 MiB 203 layers/s x0.25")
    assert split_reason(["a", "a"], [mib, mib], None) == "by memory: a 1 MiB, a 1 MiB"


def test_the_calibration_times_the_models_own_layer_matrices() -> None:
    spec = TinySpec(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2)
    shapes = LayerShapes.of(tiny_config(spec))
    # Q, K, V, O, then the MLP's gate, down and up projections: (output, input)
    assert shapes.matrices == ((64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (64, 128), (128, 64))
    assert layer_rate(1, shapes, seconds=0.02) > 0
    # A matrix wider than MAX_TIMED_ROWS is timed on that many rows and scaled, not allocated whole.
    assert layer_rate(1, LayerShapes(((calibrate.MAX_TIMED_ROWS * 64, 16),)), seconds=0.01) > 0
    # 64 experts of one shape: timed once, counted 64 times (slower per layer than one matrix).
    one, experts = LayerShapes(((256, 256),)), LayerShapes(((256, 256),) * 64)
    assert layer_rate(1, experts, seconds=0.05) < layer_rate(1, one, seconds=0.05) / 8


def test_a_stall_between_two_products_counts_against_the_node(monkeypatch) -> None:
    """A CPU quota throttles a node wherever its quota runs out, between two products as
    well as in one: the rate is the burst's layers over the burst's whole time (on a
    clock that each product moves by 1 ms and every fifth reading by a 10 ms stall)."""
    import torch

    clock, readings = [0.0], []

    def product(a, b):
        clock[0] += 0.001
        return a @ b

    def perf_counter() -> float:
        if len(readings) % 5 == 4:
            clock[0] += 0.010
        readings.append(clock[0])
        return clock[0]

    monkeypatch.setattr(torch, "mm", product)
    monkeypatch.setattr(calibrate, "time", SimpleNamespace(perf_counter=perf_counter))
    rate = layer_rate(1, LayerShapes(((8, 8),)), seconds=0.2)
    layers = len(readings) - 1  # a reading at the start, then one after each product
    assert rate == pytest.approx(layers / (readings[-1] - readings[0]))
    assert rate < 1 / (0.001 + 0.010 / 5) * 1.01


def test_a_nodes_rate_is_cached_per_node_model_and_threads(tmp_path, monkeypatch) -> None:
    measured: list[tuple[int, LayerShapes]] = []

    def fake_rate(threads: int, shapes: LayerShapes, seconds: float = 0.0) -> float:
        measured.append((threads, shapes))
        return 100.0 * threads + len(measured)

    monkeypatch.setattr(calibrate, "layer_rate", fake_rate)
    shapes, other = LayerShapes(((64, 64),)), LayerShapes(((128, 64),))
    first = node_rate("10.0.0.11", 1, shapes, directory=str(tmp_path))
    assert (first.layers_per_s, first.cached, len(measured)) == (102.0, False, 2)  # best of two bursts
    again = node_rate("10.0.0.11", 1, shapes, directory=str(tmp_path))
    assert (again.layers_per_s, again.cached, len(measured)) == (102.0, True, 2)
    # Another model, other threads, another node (its address), or refresh (the same entry): measured afresh.
    assert not node_rate("10.0.0.11", 1, other, directory=str(tmp_path)).cached
    assert not node_rate("10.0.0.11", 2, shapes, directory=str(tmp_path)).cached
    assert not node_rate("10.0.0.12", 1, shapes, directory=str(tmp_path)).cached
    assert not node_rate("10.0.0.11", 1, shapes, refresh=True, directory=str(tmp_path)).cached
    assert len(measured) == 10
    entries = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert len(entries) == 4 and not list(tmp_path.glob("*.tmp"))
    # Too old: measured again.
    monkeypatch.setattr(calibrate, "CACHE_MAX_AGE_S", 0.0)
    assert not node_rate("10.0.0.11", 1, shapes, directory=str(tmp_path)).cached


def test_a_cgroup_quota_lowers_the_cpus_a_node_offers() -> None:
    assert 0 < usable_cpus() <= len(__import__("os").sched_getaffinity(0))
    why = cpu_limits.unavailable()
    if why:
        pytest.skip(why)
    # Imported before the limit (the child waits for a line), asked under it.
    child = subprocess.Popen([sys.executable, "-c", "import sys; from bargein.distributed.node_cpus import "
                              "usable_cpus; print(flush=True); sys.stdin.readline(); print(usable_cpus())"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "\n"
    with cpu_limits.cpu_group([child.pid], cpus=0.25):
        out, _ = child.communicate("go\n", timeout=60)
    assert float(out) == 0.25
    assert child.returncode == 0
