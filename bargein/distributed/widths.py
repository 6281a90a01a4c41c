"""What the head knows, before placing stages, of the bytes a stage will read per value of
each weight matrix: the :class:`~bargein.distributed.split.MatrixWidths` that price a
layer and the LM head for the layer split.

A stage computes from a GGUF's matrices of the kernels' block types
(:data:`~bargein.kernels.quant_weight.QUANT_TYPES`) as stored, in blocks, in both
precisions, where the native kernels run with a float32 model on the CPU (see
``build_model`` and ``resolve_kernels``). Every other matrix is dequantized to the model's
dtype (in ``fast`` a float one is read as 16-bit rows, in ``exact`` as float32; priced
at 4 here either way); a safetensors folder is dense throughout.
Only the GGUF's tensor table is read (no tensor data), through ``open_gguf``, which the
head opened already to read the model's config.
"""

from __future__ import annotations

import torch

from bargein.config import EngineConfig, ModelConfig
from bargein.distributed.split import MatrixWidths
from bargein.engine.device import resolve_dtype
from bargein.kernels.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType
from bargein.kernels.quant_weight import QUANT_TYPES
from bargein.loader.gguf_file import open_gguf
from bargein.loader.names import gguf_location, wanted_tensors
from bargein.loader.source import ModelSource


def stages_read_blocks(config: EngineConfig) -> bool:
    """Whether stages built from ``config`` compute from blocks: the native kernels, on the
    CPU, float32, in either precision.
    A device of "auto" is judged by this (the head's) PyTorch; stages on nodes with a GPU
    the head lacks would compute densely on it."""
    if not config.native_kernels:
        return False
    on_cuda = config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if on_cuda else "cpu")
    return device.type == "cpu" and resolve_dtype(config.dtype, device) == torch.float32


def stage_widths(source: ModelSource, model_config: ModelConfig, config: EngineConfig) -> MatrixWidths:
    """The bytes per value stages will read of each of the model's matrices: a GGUF's
    block-held ones (every type in QUANT_TYPES) at their stored size where stages read
    blocks, every other at 4 (float32); all at one width where stages read no blocks."""
    if source.kind != "gguf" or not stages_read_blocks(config):
        return MatrixWidths()
    tensors = open_gguf(source.path).tensors
    stored: dict[str, float] = {}
    for canon, (gguf_name, _) in wanted_tensors(model_config, 0, model_config.num_layers).items():
        info = tensors.get(gguf_location(tensors, canon, gguf_name)[0])
        try:
            if info is None or GGMLQuantizationType(info.tensor_type) not in QUANT_TYPES \
                    or len(info.torch_shape) not in (2, 3):  # 3: an MoE layer's stacked experts
                continue  # a missing or unknown tensor is the loader's to report
        except ValueError:
            continue
        values, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(info.tensor_type)]
        stored[canon] = nbytes / values
    return MatrixWidths(stored)
