"""``bargein serve --ray``: a set-up that cannot run ends with one line and exit 1,
before anything is started; the layer split helpers. No Ray cluster needed."""

from __future__ import annotations

import pytest

from bargein.cli import main
from bargein.config import ModelConfig
from bargein.distributed.split import (
    PipelineSetupError,
    check_split,
    head_layers,
    parse_stage_layers,
    split_by_memory,
)
from tests.tiny_models import TinySpec, tiny_weights, write_gguf


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    spec = TinySpec(num_layers=6)
    return str(write_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", spec, tiny_weights(spec)))


@pytest.mark.parametrize(("flags", "message"), [
    (["--ray", "local", "--pipeline-stages", "7"], "7 stages were asked for, but the model has only 6 layers"),
    (["--ray", "local", "--stage-layers", "0-2,3-6"], "the stage layers 0-2,3-6 do not cover the model's 6 layers in order "
     "(a stage must start at layer 2 and hold at least one layer)"),
    (["--ray", "local", "--stage-layers", "0-2,2-5"], "the stage layers 0-2,2-5 end at layer 5, but the model has 6 layers"),
    (["--ray", "local", "--stage-layers", "0-2,x"], "--stage-layers: 'x' is not a range like 0-10"),
    (["--ray", "127.0.0.1:1"], "no Ray cluster at 127.0.0.1:1: Connection refused"),
])
def test_a_bad_set_up_is_one_line_and_exit_1(model: str, flags: list[str], message: str, capsys) -> None:
    assert main(["serve", "--model", model, "--port", "0", *flags]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"bargein: error: {message}"
    assert not any("Traceback" in line for line in err)


def test_without_ray_the_error_says_how_to_install_it(model: str, monkeypatch, capsys) -> None:
    pipeline = pytest.importorskip("bargein.distributed.pipeline")
    monkeypatch.setattr(pipeline, "ray", None)
    assert main(["serve", "--model", model, "--port", "0", "--ray"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "bargein: error: Ray is not installed: pip install 'bargein[ray]'")


def test_split_by_memory_is_proportional_with_at_least_one_layer_each() -> None:
    assert split_by_memory(30, [2, 1]) == ((0, 20), (20, 30))
    assert split_by_memory(6, [600, 400, 200]) == ((0, 3), (3, 5), (5, 6))
    assert split_by_memory(4, [1000, 1, 1]) == ((0, 2), (2, 3), (3, 4))
    assert split_by_memory(7, [1, 1]) == ((0, 4), (4, 7))
    assert check_split(parse_stage_layers("0-10, 10-20,20-30"), 30) == ((0, 10), (10, 20), (20, 30))
    with pytest.raises(PipelineSetupError, match="3 stages were asked for, but the model has only 2 layers"):
        split_by_memory(2, [1, 1, 1])


def test_the_last_stage_s_lm_head_counts_as_work_in_the_split() -> None:
    smollm2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                          num_kv_heads=3, head_dim=64)
    # (49152 x 576) over 4/3 of a layer's (576 x (2 x 576 + 2 x 192) + 3 x 576 x 1536) multiply-adds
    assert head_layers(smollm2) == pytest.approx(6.0, abs=0.01)
    assert split_by_memory(30, [1, 1], head_layers(smollm2)) == ((0, 18), (18, 30))  # 18 and 12 + 6
    assert split_by_memory(30, [1, 1, 1], 6.0) == ((0, 12), (12, 24), (24, 30))
    assert split_by_memory(30, [2, 1], 6.0) == ((0, 24), (24, 30))  # 24 and 6 + 6
    assert split_by_memory(4, [1, 1], 9.0) == ((0, 3), (3, 4))  # every stage keeps a layer


def test_prefetched_inputs_wait_for_their_plan_raise_its_error_and_drop_voided_ones() -> None:
    pytest.importorskip("ray")
    import threading

    import torch

    from bargein.distributed.stage import PrefetchedInputs

    inputs = PrefetchedInputs()
    hidden = torch.ones(2, 3)
    later = threading.Timer(0.05, inputs.put, args=(7, (hidden, 0.25)))
    later.start()
    got, transfer_s = inputs.take(7)  # waits for the inputs thread
    assert got is hidden and transfer_s == 0.25
    inputs.put(8, (hidden, 0.0))  # a plan voided before it ran
    inputs.put(9, RuntimeError("stage 0 failed on plan 9"))
    inputs.put(10, (hidden, 0.0))
    with pytest.raises(RuntimeError, match="stage 0 failed on plan 9"):
        inputs.take(9)
    assert inputs.take(10)[0] is hidden
    assert len(inputs) == 0  # plan 8's input was dropped with plan 9's take


def test_voided_plans_fail_at_once_whether_waiting_or_not_yet_taken_and_late_inputs_are_dropped() -> None:
    """A lost stage voids every plan in flight: a surviving stage waiting for such a plan's
    hidden states (which will never come) fails it at once, and inputs of voided plans that
    arrive late are not kept; plans after the void are taken as usual."""
    pytest.importorskip("ray")
    import threading

    import torch

    from bargein.distributed.stage import PlanVoided, PrefetchedInputs

    inputs = PrefetchedInputs()
    hidden = torch.ones(2, 3)
    inputs.put(4, (hidden, 0.0))
    later = threading.Timer(0.05, inputs.void_through, args=(6,))
    later.start()
    with pytest.raises(PlanVoided, match="plan 5 was given up"):
        inputs.take(5)  # was waiting: woken by the void
    assert len(inputs) == 0  # plan 4's input went with the void
    inputs.put(6, (hidden, 0.0))  # arrives after the void: dropped
    assert len(inputs) == 0
    with pytest.raises(PlanVoided):
        inputs.take(6)
    inputs.void_through(3)  # an older void moves nothing back
    inputs.put(7, (hidden, 0.5))
    assert inputs.take(7) == (hidden, 0.5)
