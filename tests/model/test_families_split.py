"""Every family split into pipeline stages equals the whole model, whatever layer kinds
meet at a boundary (Gemma 3: five local layers, then a global one; Gemma 2 alternates),
and a stage built from shipped weights (a node without the file) holds exactly the
weights the loader reads. Ray is not needed: the stages run in this process, as the
pipeline's stage actors run them."""

from __future__ import annotations

import pytest
import torch

from bargein.config import EngineConfig
from bargein.distributed.weights import materialize, read_stored
from bargein.engine.device import build_model
from bargein.loader import load_config, load_weights, resolve_model_ref
from bargein.model.attention import AttentionMetadata
from tests.model.family_files import FORMATS, NAMES, model_path

TOKENS = list(range(5, 35))  # 30 positions: past the 8-token window


def _forward(stages, precision: str) -> torch.Tensor:
    caches = [s.make_kv_caches(9, 4) for s in stages]
    meta = AttentionMetadata.build(block_tables=[list(range(8))], query_lens=[len(TOKENS)],
                                   context_lens=[len(TOKENS)], block_size=4, decode_batch=precision == "exact")
    x = torch.tensor(TOKENS)
    for stage, cache in zip(stages, caches, strict=True):
        x = stage(x, torch.arange(len(TOKENS)), meta, cache)
    return x


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("name", NAMES)
def test_stages_equal_the_whole_model(name: str, precision: str) -> None:
    # One format: both load the same canonical weights (test_families.py, and shipped below).
    source = resolve_model_ref(model_path(name, "gguf"))
    config = load_config(source)
    engine_config = EngineConfig(precision=precision, device="cpu")

    def stage(layers: tuple[int, int]):
        weights = load_weights(source, config, layer_range=layers, progress=False, blocks=True)
        return build_model(config, weights, engine_config, max_positions=64, layer_range=layers)

    whole = _forward([stage((0, config.num_layers))], precision)
    cut = config.num_layers - 1  # Gemma 3: between its last local layer and its global one
    split = _forward([stage((0, cut)), stage((cut, config.num_layers))], precision)
    assert torch.equal(split, whole)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", NAMES)
def test_shipped_weights_equal_the_loaded_ones(name: str, fmt: str) -> None:
    source = resolve_model_ref(model_path(name, fmt))
    config = load_config(source)
    layers = (1, config.num_layers)
    loaded = load_weights(source, config, layer_range=layers, progress=False)
    shipped = materialize(read_stored(source, config, layers), config, torch.float32, torch.device("cpu"))
    assert shipped.keys() == loaded.keys()
    for key, tensor in loaded.items():
        assert torch.equal(shipped[key], tensor), key
