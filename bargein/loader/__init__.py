"""Model loading: references, configs, canonical weights, tokenizers and chat templates.

Public API::

    source = resolve_model_ref(None)          # the bundled SmolLM2 GGUF
    config = load_config(source)
    weights = load_weights(source, config, layer_range=(0, config.num_layers))
    tokenizer = load_tokenizer(source)

Weights come back under canonical names (``embed.weight``, ``layers.{i}.wq.weight``, ...,
see bargein.loader.names) with Q/K in the Hugging Face rotate_half RoPE layout, whatever
the file format. Every error is a LoaderError subclass whose message names the file.
"""

from __future__ import annotations

import torch

from bargein.config import ModelConfig
from bargein.loader.errors import (
    ChatTemplateError,
    CorruptModelError,
    LoaderError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from bargein.loader.gguf_file import load_gguf_weights, read_gguf_config
from bargein.loader.hf_folder import load_hf_weights, read_hf_config
from bargein.loader.names import expected_shape
from bargein.loader.source import ModelSource, resolve_model_ref
from bargein.loader.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "ChatTemplateError",
    "CorruptModelError",
    "LoaderError",
    "ModelNotFoundError",
    "ModelSource",
    "Tokenizer",
    "UnsupportedModelError",
    "load_config",
    "load_tokenizer",
    "load_weights",
    "resolve_model_ref",
]


def load_config(source: ModelSource) -> ModelConfig:
    """The architecture of ``source``; ``config.name`` is the served model id."""
    if source.kind == "gguf":
        return read_gguf_config(source.path, source.name)
    return read_hf_config(source.path, source.name)


def load_weights(
    source: ModelSource,
    config: ModelConfig,
    *,
    layer_range: tuple[int, int] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool = True,
) -> dict[str, torch.Tensor]:
    """Canonical weights for layers [start, end) (all layers when None), as ``dtype`` on ``device``.

    Each tensor is read, converted and moved to ``device`` before the next is read, so
    host memory holds one tensor at a time, never a float32 copy of the whole model
    (``rope_freq_factors`` stays float32).

    Layer names use global indices. ``embed.weight`` is included when start == 0, or at the
    last stage of a tied model; ``norm.weight`` and an untied ``lm_head.weight`` when
    end == num_layers. ``rope_freq_factors`` is included when the file has it. A tqdm bar
    on stderr shows progress unless ``progress`` is False.
    """
    load = load_gguf_weights if source.kind == "gguf" else load_hf_weights
    weights = load(source.path, config, layer_range=layer_range, dtype=dtype, device=torch.device(device),
                   progress=progress)
    for name, tensor in weights.items():
        shape = expected_shape(config, name)
        if shape is not None and tuple(tensor.shape) != shape:
            raise CorruptModelError(
                f"{source.path}: tensor for {name} has shape {tuple(tensor.shape)}, expected {shape}"
            )
    return weights
