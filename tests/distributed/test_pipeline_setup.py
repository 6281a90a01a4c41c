"""``bargein serve --ray``: a set-up that cannot run ends with one line and exit 1,
before anything is started; the layer split helpers. No Ray cluster needed."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from bargein.cli import main
from bargein.config import EngineConfig, ModelConfig
from bargein.distributed.errors import PipelineSetupError
from bargein.distributed.split import (
    LAYER_MATRICES,
    MatrixWidths,
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
    (["--ray", "127.0.0.1:1"], "no Ray head answers at 127.0.0.1:1 from this machine (Connection refused): "
     "is the head started, and is the port open?"),
])
def test_a_bad_set_up_is_one_line_and_exit_1(model: str, flags: list[str], message: str, capsys) -> None:
    assert main(["serve", "--model", model, "--port", "0", *flags]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"bargein: error: {message}"
    assert not any("Traceback" in line for line in err)


def test_without_ray_the_error_says_how_to_install_it(model: str, monkeypatch, capsys) -> None:
    connect = pytest.importorskip("bargein.distributed.connect")
    monkeypatch.setattr(connect, "ray", None)
    assert main(["serve", "--model", model, "--port", "0", "--ray"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "bargein: error: Ray is not installed: install it with `make ray` in a bargein checkout "
        "(or `pip install 'bargein[ray]'`) on every machine")


def test_split_by_memory_is_proportional_with_at_least_one_layer_each() -> None:
    assert split_by_memory(30, [2, 1]) == ((0, 20), (20, 30))
    assert split_by_memory(6, [600, 400, 200]) == ((0, 3), (3, 5), (5, 6))
    assert split_by_memory(4, [1000, 1, 1]) == ((0, 2), (2, 3), (3, 4))
    assert split_by_memory(7, [1, 1]) == ((0, 4), (4, 7))
    assert check_split(parse_stage_layers("0-10, 10-20,20-30"), 30) == ((0, 10), (10, 20), (20, 30))
    with pytest.raises(PipelineSetupError, match="3 stages were asked for, but the model has only 2 layers"):
        split_by_memory(2, [1, 1, 1])


SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, tie_word_embeddings=True)
# The bundled GGUF: every layer matrix Q4_1 (20 bytes per 32 values), the tied head Q8_0 (34 per 32).
SMOLLM2_BLOCKS = {f"layers.{i}.{m}": 20 / 32 for i in range(30) for m in LAYER_MATRICES} | {"embed.weight": 34 / 32}


def test_the_last_stage_s_lm_head_counts_as_work_in_the_split() -> None:
    # A layer's matrices: 576 x (2 x 576 + 2 x 192) + 3 x 576 x 1536 = 3,538,944 values; the
    # head 49152 x 576 = 28,311,552 values, 8 times as many. A layer's other work adds a third.
    # exact, or a dense model at any one width: the ratio of values, 8 / (4/3) = 6.0.
    for dense in (MatrixWidths(), MatrixWidths(dense=2.0)):  # float32 copies; bf16 safetensors
        assert head_layers(SMOLLM2, dense) == pytest.approx(6.0)
        assert split_by_memory(30, [1, 1], head_layers(SMOLLM2, dense)) == ((0, 18), (18, 30))  # 18 and 12 + 6
    assert split_by_memory(30, [1, 1, 1], 6.0) == ((0, 12), (12, 24), (24, 30))
    assert split_by_memory(30, [2, 1], 6.0) == ((0, 24), (24, 30))  # 24 and 6 + 6
    assert split_by_memory(4, [1, 1], 9.0) == ((0, 3), (3, 4))  # every stage keeps a layer

    # fast reads the blocks: a layer 3,538,944 x 0.625 = 2,211,840 bytes, the head
    # 28,311,552 x 1.0625 = 30,081,024 bytes: 13.6 layers' matrices, over 4/3 = 10.2.
    fast = MatrixWidths(SMOLLM2_BLOCKS)
    assert head_layers(SMOLLM2, fast) == pytest.approx(10.2)
    # 40.2 layers' work, 20.1 each: 20.1 and 20.1 - 10.2 = 9.9 layers; floors 20 + 9, the
    # 30th layer to the larger remainder (0.9).
    assert split_by_memory(30, [1, 1], 10.2) == ((0, 20), (20, 30))
    # 13.4 each: 13.4, 13.4, 3.2; floors 13 + 13 + 3, the 30th to the first 0.4.
    assert split_by_memory(30, [1, 1, 1], 10.2) == ((0, 14), (14, 27), (27, 30))
    # memory 2:1: 26.8 and 13.4 - 10.2 = 3.2; floors 26 + 3, the 30th to the 0.8.
    assert split_by_memory(30, [2, 1], 10.2) == ((0, 27), (27, 30))
    # memory 1:2: 13.4 and 26.8 - 10.2 = 16.6; floors 13 + 16, the 30th to the 0.6.
    assert split_by_memory(30, [1, 2], 10.2) == ((0, 13), (13, 30))

    # Untied, the head is lm_head.weight: Q8_0 there prices as the tied one; dense float32
    # there (the embedding Q8_0) it is 28,311,552 x 4 / 2,211,840 = 51.2 layers' matrices, 38.4.
    untied = replace(SMOLLM2, tie_word_embeddings=False)
    layers_q4_1 = {k: v for k, v in SMOLLM2_BLOCKS.items() if k.startswith("layers.")}
    assert head_layers(untied, MatrixWidths(layers_q4_1 | {"lm_head.weight": 34 / 32})) == pytest.approx(10.2)
    assert head_layers(untied, MatrixWidths(layers_q4_1 | {"embed.weight": 34 / 32})) == pytest.approx(38.4)
    # Layers of two widths price as their average: half Q4_1, half Q8_0 is 0.84375 bytes a
    # value, 2,985,984 bytes a layer; 30,081,024 / 2,985,984 = 272/27, over 4/3 = 68/9.
    mixed = {k: (20 / 32 if int(k.split(".")[1]) < 15 else 34 / 32) for k in layers_q4_1}
    assert head_layers(SMOLLM2, MatrixWidths(mixed | {"embed.weight": 34 / 32})) == pytest.approx(68 / 9)


def test_stage_widths_come_from_the_gguf_tensor_table_where_stages_read_blocks(tmp_path) -> None:
    pytest.importorskip("gguf")
    import gguf
    from gguf.quants import quantize

    from bargein.distributed.widths import stage_widths, stages_read_blocks
    from bargein.loader.source import ModelSource
    from tests.tiny_models import tiny_config

    spec = TinySpec(num_layers=3)
    weights = tiny_weights(spec)
    q8 = gguf.GGMLQuantizationType.Q8_0
    embed = (quantize(weights["embed.weight"].numpy(), q8), q8)
    path = write_gguf(tmp_path / "q4_1.gguf", spec, weights, tensor_type="Q4_1", skip=("token_embd.weight",),
                      extra_tensors={"token_embd.weight": embed})
    config = tiny_config(spec)
    source = ModelSource("gguf", path, "tiny")
    cpu_fast = EngineConfig(device="cpu", precision="fast")
    expected = {f"layers.{i}.{m}": 0.625 for i in range(3) for m in LAYER_MATRICES} | {"embed.weight": 1.0625}
    assert stage_widths(source, config, cpu_fast) == MatrixWidths(expected)  # norms are no matrices
    f32 = ModelSource("gguf", write_gguf(tmp_path / "f32.gguf", spec, weights), "tiny")
    assert stage_widths(f32, config, cpu_fast) == MatrixWidths()  # nothing held in blocks
    # exact reads the file's blocks too
    assert stage_widths(source, config, replace(cpu_fast, precision="exact")) == MatrixWidths(expected)
    # A safetensors folder is dense: nothing is read (this one does not even exist).
    assert stage_widths(ModelSource("hf", tmp_path / "absent", "tiny"), config, cpu_fast) == MatrixWidths()
    assert stages_read_blocks(cpu_fast)
    assert stages_read_blocks(replace(cpu_fast, precision="exact"))
    for other in (dict(dtype="bfloat16"), dict(native_kernels=False),
                  dict(device="cuda")):
        assert not stages_read_blocks(replace(cpu_fast, **other))


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


def test_auto_picks_a_compiled_graph_only_on_the_head_s_node_with_a_core_per_stage_thread() -> None:
    from bargein.distributed.errors import PipelineSetupError
    from bargein.distributed.transport import pick_transport

    assert pick_transport("auto", ["h", "h"], "h", 2, 1) == "graph"
    assert pick_transport("auto", ["h", "h"], "h", 3, 2) == "calls"  # 4 stage threads on 3 CPUs
    assert pick_transport("auto", ["h", "h", "h"], "h", 6, 2) == "graph"
    assert pick_transport("auto", ["h", "n"], "h", 64, 1) == "calls"  # across nodes: actor calls
    assert pick_transport("calls", ["h", "h"], "h", 64, 1) == "calls"
    assert pick_transport("graph", ["h", "h"], "h", 1, 1) == "graph"  # forced: the cores are the user's call
    with pytest.raises(PipelineSetupError, match="needs every pipeline stage on the head's node"):
        pick_transport("graph", ["h", "n"], "h", 64, 1)
    assert pick_transport("graph", ["h", "n"], "h", 64, 1, strict=False) == "calls"  # a stage re-created elsewhere


def test_a_node_is_asked_for_its_model_copy_by_a_module_without_torch(model: str, tmp_path) -> None:
    """The probe task's worker process imports only ``model_copy`` (seconds saved on every
    node of every start), and it answers by the files' names and sizes."""
    import subprocess
    import sys

    from bargein.distributed.model_copy import file_fingerprint, has_model_copy
    from bargein.distributed.weights import fingerprint
    from bargein.loader.source import ModelSource

    done = subprocess.run([sys.executable, "-c", "import sys, bargein.distributed.model_copy; "
                           "print(sorted({'torch', 'bargein.loader', 'ray'} & set(sys.modules)))"],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stderr
    expected = fingerprint(ModelSource("gguf", Path(model), "tiny"))
    assert expected == file_fingerprint(Path(model), "gguf") == (("tiny.gguf", Path(model).stat().st_size),)
    assert has_model_copy(model, "gguf", expected)
    other = tmp_path / "tiny.gguf"
    other.write_bytes(b"GGUF")
    assert not has_model_copy(str(other), "gguf", expected) and not has_model_copy(str(tmp_path / "none"), "gguf",
                                                                                   expected)
