"""A stage's weights: read from the node's own copy of the model file, or shipped by the head.

Where a node has no copy of the model file (or a different one), the head reads that
stage's tensors *in their stored form* (GGUF blocks stay quantized bytes; safetensors
keep their dtype) and ships them through Ray's object store; the stage converts them
exactly as the loader does: a matrix of a block type the kernels read becomes a
QuantWeight over the shipped bytes (as the single-process engine's is over the mapped
file; the received buffer is read-only, which nothing needs to write), anything else is
dequantized. So a Q4 stage costs the wire about a seventh of its float32 size, and a
stage holds the same weights whether it read or received them.

No Ray here: the caller does the shipping.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bargein.config import ModelConfig
from bargein.distributed.model_copy import Fingerprint, file_fingerprint, has_model_copy  # noqa: F401 (stage.py)
from bargein.kernels.block_quant import BlockWeight
from bargein.kernels.dequant import dequantize
from bargein.kernels.ggml_types import GGMLQuantizationType
from bargein.kernels.half_rows import HALF_DTYPES, half_rows
from bargein.kernels.quant_weight import QUANT_TYPES, QuantWeight
from bargein.loader.errors import CorruptModelError
from bargein.loader.families import norm_offset, stored_rows
from bargein.loader.gguf_file import PERMUTED_ARCHS, open_gguf, qk_row_order, unpermute_qk
from bargein.loader.hf_folder import _open as open_safetensors
from bargein.loader.hf_folder import _weight_map, text_model_names
from bargein.loader.names import gguf_location, wanted_tensors
from bargein.loader.source import ModelSource

Weight = torch.Tensor | BlockWeight | QuantWeight


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as the file stores it: GGUF raw data and type (``ggml_type`` set), or a
    safetensors tensor in its own dtype (``ggml_type`` None). ``shape`` is torch's."""

    data: np.ndarray | torch.Tensor
    shape: tuple[int, ...]
    ggml_type: int | None = None

    @property
    def nbytes(self) -> int:
        if isinstance(self.data, torch.Tensor):
            return self.data.numel() * self.data.element_size()
        return int(self.data.nbytes)


@dataclass(frozen=True)
class StoredWeights:
    """A stage's tensors in stored form, and how to convert them (the GGUF's architecture)."""

    tensors: dict[str, StoredTensor]
    gguf_arch: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def fingerprint(source: ModelSource) -> Fingerprint:
    """Names and sizes of the files a model is read from (:mod:`bargein.distributed.model_copy`)."""
    return file_fingerprint(Path(source.path), source.kind)


def read_stored(source: ModelSource, config: ModelConfig, layer_range: tuple[int, int]) -> StoredWeights:
    """The tensors layers ``layer_range`` need, as stored in the file (no conversion)."""
    wanted = wanted_tensors(config, *layer_range)
    if source.kind == "gguf":
        f = open_gguf(source.path)
        names = {canon: gguf_name for canon, (gguf_name, _) in wanted.items()}
        if "rope_freqs.weight" in f.tensors:
            names["rope_freq_factors"] = "rope_freqs.weight"
        tensors = {}
        for canon, stacked in names.items():
            name, e = gguf_location(f.tensors, canon, stacked)
            info = f.tensors.get(name)
            if info is None:
                raise CorruptModelError(f"{source.path}: tensor {name!r} is missing")
            shape = tuple(int(d) for d in reversed(info.shape.tolist()))
            data = np.asarray(info.data)
            if e is not None:  # its slice of the stacked experts, alone
                data, shape = data.reshape(shape[0], -1)[e], shape[1:]
            tensors[canon] = StoredTensor(data, shape, int(info.tensor_type))
        return StoredWeights(tensors, f.get("general.architecture"))
    where = _weight_map(source.path)
    tensors = {}
    names = text_model_names({canon: hf_name for canon, (_, hf_name) in wanted.items()}, where)
    for canon, hf_name in names.items():
        if hf_name not in where:
            raise CorruptModelError(f"{source.path}: tensor {hf_name!r} is missing (for {canon})")
        with open_safetensors(where[hf_name]) as handle:
            t = handle.get_tensor(hf_name)
        tensors[canon] = StoredTensor(t, tuple(t.shape))
    return StoredWeights(tensors)


def materialize(stored: StoredWeights, config: ModelConfig, dtype: torch.dtype,
                device: torch.device, *, blocks: bool = False) -> dict[str, Weight]:
    """Canonical weights from stored form, as the loader would have produced them from the
    file (``load_weights`` with the same ``blocks``): with ``blocks``, a GGUF's matrices of
    the kernels' block types and a folder's F16/BF16 matrices become QuantWeights over the
    shipped bytes (no copy), never widened to float32."""
    weights: dict[str, Weight] = {}
    for canon in list(stored.tensors):
        t = stored.tensors[canon]
        permuted = stored.gguf_arch in PERMUTED_ARCHS and (".wq." in canon or ".wk." in canon)
        heads = config.num_heads if ".wq." in canon else config.num_kv_heads
        if t.ggml_type is not None and blocks and GGMLQuantizationType(t.ggml_type) in QUANT_TYPES \
                and len(t.shape) == 2:
            with warnings.catch_warnings():
                # Read-only when Ray maps it from the object store: nothing writes to weights.
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                raw = torch.from_numpy(np.asarray(t.data).view(np.uint8).reshape(-1))
            held = QuantWeight.of(GGMLQuantizationType(t.ggml_type), raw, *t.shape)
            held = held.reorder_rows(qk_row_order(held.shape[0], heads)) if permuted else held
            weights[canon] = held.reorder_rows(rows) if (rows := stored_rows(config, canon)) is not None else held
            continue
        if t.ggml_type is None and blocks and len(t.shape) == 2 and t.data.dtype in HALF_DTYPES:
            held = half_rows(t.data)  # an F16/BF16 matrix: its 16-bit rows, as the loader holds them
            weights[canon] = held.reorder_rows(rows) if (rows := stored_rows(config, canon)) is not None else held
            continue
        if t.ggml_type is None:
            w = t.data
            if offset := norm_offset(config, "hf", canon):  # Gemma's norms, as the loader reads them
                w = w.float() + offset
        else:
            w = dequantize(t.data, GGMLQuantizationType(t.ggml_type), t.shape)
            if permuted:
                w = unpermute_qk(w, heads)
        if (rows := stored_rows(config, canon)) is not None:  # a share of a fused matrix, partial rotary
            w = w.index_select(0, rows)
        want = torch.float32 if canon == "rope_freq_factors" else dtype
        weights[canon] = w.to(device=device, dtype=want)
    return weights
