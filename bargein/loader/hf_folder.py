"""Hugging Face model folders: config.json and (sharded) *.safetensors.

Never unpickles: only safetensors weights are read. Each file is memory-mapped once,
read-only (:class:`MappedSafetensors`), and tensors are views of the map: for the native
kernels (``blocks``), an F16 or BF16 matrix becomes 16-bit rows over the file's own bytes
(:func:`~bargein.kernels.half_rows.half_rows`: never widened, never copied, file-backed
pages shared with the page cache), as a GGUF's F16/BF16 matrices are. Norms and biases
(small) are copied out as float32; a float32 matrix is a view of the map until the model
holds it (``fast`` narrows it to 16-bit rows, ``exact`` packs it).
"""

from __future__ import annotations

import json
import struct
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from tqdm import tqdm

from bargein.config import ModelConfig
from bargein.kernels.half_rows import HALF_DTYPES, half_rows
from bargein.kernels.quant_weight import QuantWeight
from bargein.loader.errors import CorruptModelError, UnsupportedModelError
from bargein.loader.families import (
    HF_FAMILIES,
    hf_features,
    hf_moe,
    hf_text_config,
    norm_offset,
    stored_rows,
)
from bargein.loader.file_maps import map_ahead, map_whole_file
from bargein.loader.names import check_layer_range, read_whole, wanted_tensors

SUPPORTED_ARCHITECTURES = tuple(HF_FAMILIES)
INDEX_FILE = "model.safetensors.index.json"
# Where a multimodal checkpoint keeps its text model's tensors (transformers 5, then 4).
TEXT_MODEL_PREFIXES = ("model.language_model.", "language_model.model.")


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CorruptModelError(f"{path}: file is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptModelError(f"{path}: not valid JSON ({exc})") from exc


def read_hf_config(folder: Path, name: str) -> ModelConfig:
    """ModelConfig from config.json; unknown architectures and RoPE scalings are refused."""
    path = folder / "config.json"
    raw = read_json(path)
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"{path}: architecture {archs or raw.get('model_type')!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    family = HF_FAMILIES[arch]
    cfg = hf_text_config(raw, family)
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        return ModelConfig(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))),
            # Qwen2 always has q/k/v biases; Llama declares them with attention_bias
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False))
            or (arch == "Qwen2MoeForCausalLM" and bool(cfg.get("qkv_bias", True))),  # Qwen1.5-MoE: always
            name=name,
            **{**hf_features(family, cfg, path), **hf_moe(family, cfg)},
        )
    except KeyError as exc:
        raise CorruptModelError(f"{path}: required key {exc.args[0]!r} is missing") from None


def text_model_names(wanted: dict[str, str], where: dict[str, Path]) -> dict[str, str]:
    """Canonical name -> stored name, under a multimodal checkpoint's text-model prefix
    where the folder has one (Gemma 3 from 4B up); unchanged otherwise."""
    prefix = next((p for p in TEXT_MODEL_PREFIXES if f"{p}embed_tokens.weight" in where), None)
    if prefix is None:
        return wanted
    return {canon: prefix + name.removeprefix("model.") if name.startswith("model.") else name
            for canon, name in wanted.items()}


def _weight_map(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (index json, or every file's header)."""
    index = folder / INDEX_FILE
    if index.is_file():
        entries = read_json(index).get("weight_map")
        if not isinstance(entries, dict):
            raise CorruptModelError(f"{index}: no 'weight_map' object")
        return {name: folder / file for name, file in entries.items()}
    mapping: dict[str, Path] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with _open(file) as handle:
            mapping.update({name: file for name in handle.keys()})  # noqa: SIM118 (not a dict)
    return mapping


def _open(file: Path) -> Any:
    if not file.is_file():
        raise CorruptModelError(f"{file}: safetensors file is missing")
    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:  # safetensors raises its own error types on bad headers
        raise CorruptModelError(f"{file}: not a readable safetensors file ({exc})") from exc


# safetensors' dtype names -> (numpy dtype of the stored elements, torch dtype they are)
_DTYPES = {"F32": (np.float32, torch.float32), "F16": (np.float16, torch.float16),
           "BF16": (np.uint16, torch.bfloat16), "F64": (np.float64, torch.float64),
           "I64": (np.int64, torch.int64), "I32": (np.int32, torch.int32), "I16": (np.int16, torch.int16),
           "I8": (np.int8, torch.int8), "U8": (np.uint8, torch.uint8), "BOOL": (np.bool_, torch.bool)}


class MappedSafetensors:
    """One safetensors file mapped read-only, once; :meth:`tensor` views of it outlive this
    object (numpy holds the map, which goes when the last view does)."""

    def __init__(self, file: Path):
        with _open(file):  # safetensors' own check of the header: a clear error for a bad file
            pass
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            self.header: dict[str, Any] = json.loads(f.read(size))
        self.mapped = map_whole_file(file)
        self.file, self.base = file, 8 + size

    def span(self, name: str) -> tuple[int, int]:
        """(offset, nbytes) of a stored tensor in the file."""
        start, end = self.header[name]["data_offsets"]
        return self.base + start, end - start

    def tensor(self, name: str) -> torch.Tensor:
        """The stored tensor as a read-only view of the map, in its own dtype."""
        entry = self.header[name]
        stored, dtype = _DTYPES.get(entry["dtype"], (None, None))
        if stored is None:
            raise CorruptModelError(f"{self.file}: tensor {name!r} has dtype {entry['dtype']}, which bargein "
                                    f"does not read (readable: {', '.join(_DTYPES)})")
        offset, nbytes = self.span(name)
        raw = self.mapped[offset:offset + nbytes].view(stored)
        with warnings.catch_warnings():
            # torch warns that the array is not writable; nothing writes to weights, and a
            # write would fault rather than corrupt the file (the map is ACCESS_READ).
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(raw).view(dtype).reshape(entry["shape"])


def stored_dtypes(folder: Path, config: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Canonical name -> (safetensors dtype, stored shape) of every tensor the whole model
    reads, from the files' headers alone (nothing mapped or read besides them)."""
    wanted = {canon: hf_name for canon, (_, hf_name) in wanted_tensors(config, 0, config.num_layers).items()}
    where = _weight_map(folder)
    wanted = text_model_names(wanted, where)
    headers: dict[Path, dict[str, Any]] = {}
    out = {}
    for canon, hf_name in wanted.items():
        file = where.get(hf_name)
        if file is None:
            continue  # the loader reports it
        if file not in headers:
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                headers[file] = json.loads(f.read(size))
        entry = headers[file].get(hf_name)
        if entry is not None:
            out[canon] = (entry["dtype"], tuple(entry["shape"]))
    return out


def load_hf_weights(
    folder: Path,
    config: ModelConfig,
    *,
    layer_range: tuple[int, int] | None,
    dtype: torch.dtype,
    device: torch.device,
    progress: bool,
    blocks: bool = False,
) -> dict[str, torch.Tensor | QuantWeight]:
    """Canonical tensors for layers [start, end), read file by file from the mapped files,
    each moved to ``device`` as it is read. With ``blocks`` (the native kernels read the
    model), every F16 or BF16 matrix is 16-bit rows over the mapped file instead (on the
    CPU, whatever ``device``), in both precisions: never widened, never copied."""
    start, end = check_layer_range(config, layer_range)
    wanted = {canon: hf_name for canon, (_, hf_name) in wanted_tensors(config, start, end).items()}
    where = _weight_map(folder)
    wanted = text_model_names(wanted, where)
    for canon, hf_name in wanted.items():
        if hf_name not in where:
            raise CorruptModelError(f"{folder}: tensor {hf_name!r} is missing (for {canon})")
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for canon, hf_name in wanted.items():
        by_file.setdefault(where[hf_name], []).append((canon, hf_name))
    weights: dict[str, torch.Tensor | QuantWeight] = {}
    bar = tqdm(
        total=len(wanted),
        desc=f"Loading {config.name}",
        unit="tensor",
        file=sys.stderr,
        disable=not progress,
    )
    with bar:
        for file, names in by_file.items():
            mapped = MappedSafetensors(file)
            # the pages read whole come in beside the tokenizer's build (file_maps.map_ahead)
            map_ahead(mapped.mapped, [mapped.span(hf_name) for canon, hf_name in names
                                      if read_whole(config, canon, blocks=blocks, last=end == config.num_layers)])
            for canon, hf_name in names:
                try:
                    weights[canon] = _canonical(config, canon, mapped.tensor(hf_name), device, dtype, blocks)
                except CorruptModelError:
                    raise
                except Exception as exc:
                    raise CorruptModelError(f"{file}: cannot read tensor {hf_name!r} ({exc})") from exc
                bar.update()
    return {canon: weights[canon] for canon in wanted}


def _canonical(config: ModelConfig, canon: str, stored: torch.Tensor, device: torch.device,
               dtype: torch.dtype, blocks: bool) -> torch.Tensor | QuantWeight:
    """A stored tensor (a view of the mapped file) as the canonical one: its rows of a fused
    matrix, Q/K heads reordered for partial rotary, Gemma's norm as its multiplier (see
    bargein.loader.families); with ``blocks``, an F16/BF16 matrix as 16-bit rows over the
    file (the rows picked by their order, no bytes moved)."""
    rows = stored_rows(config, canon)
    if blocks and stored.dim() == 2 and stored.dtype in HALF_DTYPES:
        held = half_rows(stored)
        return held.reorder_rows(rows) if rows is not None else held
    if rows is not None:
        stored = stored.index_select(0, rows)
    if offset := norm_offset(config, "hf", canon):
        stored = stored.float() + offset  # in float32, as the reference adds it
    if stored.dim() < 2:
        stored = stored.to(dtype=dtype, copy=True)  # norms and biases: small, copied out of the map
    return stored.to(device=device, dtype=dtype)
