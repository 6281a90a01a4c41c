"""MoE models across pipeline stages: a tiny MoE split into two stages (the second built
from weights shipped as stored, as a node without the file builds it) gives the whole
model's logits bit for bit, and greedy tokens equal; the layer split weighs an MoE layer
by all its matrices' bytes (every expert's), its shipped experts are each their own slice.
Ray is not needed: the stages run in this process, as the pipeline's stage actors run them."""

from __future__ import annotations

import pytest
import torch

from bargein.config import EngineConfig
from bargein.distributed.split import head_layers, layer_matrices
from bargein.distributed.weights import materialize, read_stored
from bargein.engine.device import build_model
from bargein.loader import load_config, load_weights, resolve_model_ref
from bargein.model.attention import AttentionMetadata
from tests.model.moe_files import model_path


def _logits(stages, tokens: list[int], exact: bool) -> torch.Tensor:
    caches = [s.make_kv_caches(9, 4) for s in stages]
    n = len(tokens)
    meta = AttentionMetadata.build(block_tables=[list(range(-(-n // 4)))], query_lens=[n], context_lens=[n],
                                   block_size=4, decode_batch=exact)
    x = torch.tensor(tokens)
    for stage, cache in zip(stages, caches, strict=True):
        x = stage(x, torch.arange(n), meta, cache)
    return x


def _greedy(stages, prompt: list[int], steps: int, exact: bool) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps):  # recomputed from scratch each step: the test is the split, not the cache
        tokens.append(int(_logits(stages, tokens, exact)[-1].argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("name", ["qwen2moe"])  # the most parts: shared expert, biases (all load alike)
def test_two_stages_equal_the_whole_model(name: str, precision: str) -> None:
    source = resolve_model_ref(model_path(name, "gguf"))
    config = load_config(source)
    engine_config = EngineConfig(precision=precision, device="cpu")
    whole = build_model(config, load_weights(source, config, progress=False, blocks=True), engine_config,
                        max_positions=64)
    first = build_model(config, load_weights(source, config, layer_range=(0, 1), progress=False, blocks=True),
                        engine_config, max_positions=64, layer_range=(0, 1))
    layers = (1, config.num_layers)
    shipped = materialize(read_stored(source, config, layers), config, torch.float32, torch.device("cpu"),
                          blocks=True)
    assert shipped.keys() == load_weights(source, config, layer_range=layers, progress=False).keys()
    second = build_model(config, shipped, engine_config, max_positions=64, layer_range=layers)
    tokens = list(range(5, 25))
    exact = precision == "exact"
    assert torch.equal(_logits([first, second], tokens, exact), _logits([whole], tokens, exact))
    assert _greedy([first, second], tokens, 4, exact) == _greedy([whole], tokens, 4, exact)


def test_the_split_weighs_an_moe_layer_by_all_its_experts() -> None:
    config = load_config(resolve_model_ref(model_path("qwen2moe", "hf")))
    moe, h = config.moe, config.hidden_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    attention = 2 * q * h + 2 * kv * h
    experts = moe.num_experts * 3 * moe.expert_intermediate_size * h
    shared = 3 * moe.shared_expert_intermediate_size * h + h
    layer = attention + moe.num_experts * h + experts + shared  # router, experts, shared expert and its gate
    assert len(layer_matrices(config, 0)) == 4 + 1 + 3 * moe.num_experts + 4
    assert head_layers(config) == pytest.approx(config.vocab_size * h / (layer * 4 / 3))
