"""GGUF files: config from metadata, canonical weights from tensors.

Metadata is parsed by bargein.loader.gguf_parse (plain Python values). Tensor data is
memory-mapped, once per file, read-only (as llama.cpp does): a matrix of a block type the
kernels read (:data:`~bargein.kernels.quant_weight.QUANT_TYPES`) becomes a
:class:`~bargein.kernels.quant_weight.QuantWeight` over a view of the map, so start-up
reads nothing through Python, no private copy of a weight exists, and the pages are the
page cache's, shared with every process serving the same file (RSS counts them as
file-backed, not anonymous). F16 and BF16 matrices are such weights too (16-bit rows,
half_matmul.c), never widened. Norms and biases (small, float) are copied out; any other
tensor (F32 matrices) is read as float32, tensor by tensor.

llama.cpp stores Q/K of the ``llama`` architecture in an interleaved RoPE layout; it is
put back into the Hugging Face "rotate_half" layout here, so the model sees one layout:
for a QuantWeight by its row order (:meth:`QuantWeight.reorder_rows`, no bytes moved).
"""

from __future__ import annotations

import functools
import logging
import struct
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from bargein.config import ModelConfig
from bargein.kernels.block_quant import BLOCK, BlockWeight
from bargein.kernels.dequant import SUPPORTED_TYPES, dequantize
from bargein.kernels.ggml_types import GGMLQuantizationType
from bargein.kernels.quant_weight import QUANT_TYPES, QuantWeight
from bargein.loader.errors import CorruptModelError, LoaderError, UnsupportedModelError
from bargein.loader.families import GGUF_FAMILIES, gguf_features, gguf_moe, stored_rows
from bargein.loader.file_maps import map_ahead, map_whole_file
from bargein.loader.gguf_parse import StringArray, TensorInfo, parse_gguf
from bargein.loader.names import check_layer_range, gguf_location, read_whole, wanted_tensors

SUPPORTED_ARCHS = tuple(GGUF_FAMILIES)
# The types whose blocks BlockWeight holds as they are: (bits, bytes before the quants).
# Q4_1: d (f16), m (f16), 16 bytes of nibbles; Q8_0: d (f16), 32 int8.
BLOCK_TYPES = {GGMLQuantizationType.Q4_1: 4, GGMLQuantizationType.Q8_0: 8}
# Architectures whose Q/K llama.cpp's converter permuted (qwen2 keeps the HF layout).
PERMUTED_ARCHS = ("llama",)

log = logging.getLogger(__name__)


class GGUFFile:
    """An opened GGUF file: metadata fields and tensors by name (see bargein.loader.gguf_parse)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            parsed = parse_gguf(path)
        except LoaderError:
            raise
        except (ValueError, OverflowError, struct.error) as exc:  # a string that is not UTF-8, say
            raise CorruptModelError(f"{path}: not a readable GGUF file ({exc})") from exc
        self.fields: dict[str, Any] = parsed.fields
        self.tensors: dict[str, TensorInfo] = parsed.tensors
        self._mapped: np.ndarray | None = None  # the whole file, mapped on first use
        self._stacked: tuple[str, torch.Tensor] | None = None  # the stacked experts :meth:`expert` last widened

    def mapped(self) -> np.ndarray:
        """The whole file as a read-only uint8 array over one memory map (made on first call).

        Views of it keep the map alive (numpy holds the buffer), so weights outlive this
        object and :func:`close_gguf_files`; the map goes when the last view does.
        """
        if self._mapped is None:
            self._mapped = map_whole_file(self.path)
        return self._mapped

    def view(self, name: str) -> torch.Tensor:
        """A tensor's stored bytes as a flat uint8 tensor over the map (no copy, read-only)."""
        info = self.info(name)
        raw = self.mapped()[info.data_offset:info.data_offset + info.n_bytes]
        with warnings.catch_warnings():
            # torch warns that the array is not writable; nothing writes to weights, and
            # a write would fault rather than corrupt the file (the map is ACCESS_READ).
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(raw)

    def quant(self, name: str) -> QuantWeight | None:
        """A matrix of a block type the kernels read, as a QuantWeight over the mapped file
        (None for any other type or shape); its values are :meth:`tensor`'s bit for bit."""
        info = self.info(name)
        shape = info.torch_shape
        if GGMLQuantizationType(info.tensor_type) not in QUANT_TYPES or len(shape) != 2:
            return None
        return QuantWeight.of(GGMLQuantizationType(info.tensor_type), self.view(name), *shape)

    def expert(self, name: str, e: int, blocks: bool) -> torch.Tensor | QuantWeight:
        """Expert ``e``'s matrix of a stacked expert tensor (experts, rows, k): with ``blocks``
        and a block type the kernels read, a QuantWeight over its slice of the mapped file
        (no copy); else float32, a view of the stacked tensor dequantized once per name."""
        info = self.info(name)
        shape = info.torch_shape
        if len(shape) != 3 or not 0 <= e < shape[0]:
            raise CorruptModelError(f"{self.path}: tensor {name!r} of shape {tuple(shape)} has no expert {e}")
        qtype = GGMLQuantizationType(info.tensor_type)
        if blocks and qtype in QUANT_TYPES:
            per_expert = info.n_bytes // shape[0]
            return QuantWeight.of(qtype, self.view(name)[e * per_expert:(e + 1) * per_expert], shape[1], shape[2])
        if self._stacked is None or self._stacked[0] != name:  # experts of one tensor are read one after another
            self._stacked = (name, self.tensor(name))
        return self._stacked[1][e]

    def forget_stacked(self) -> None:
        """Drop :meth:`expert`'s widened stacked tensor (the experts taken from it keep their views)."""
        self._stacked = None

    def has(self, key: str) -> bool:
        return key in self.fields

    def get(self, key: str, default: Any = None) -> Any:
        """A scalar, string or (small) array metadata value; ``default`` when absent."""
        if key not in self.fields:
            return default
        value = self.fields[key]
        if isinstance(value, StringArray):
            return value.decoded()
        if isinstance(value, np.ndarray):
            return value.tolist()
        return value

    def require(self, key: str) -> Any:
        if key not in self.fields:
            raise CorruptModelError(f"{self.path}: metadata key {key!r} is missing")
        return self.get(key)

    def strings(self, key: str) -> list[str] | None:
        """A string-array field, decoded (invalid UTF-8 replaced, as in a byte-level vocabulary)."""
        value = self.string_array(key)
        return None if value is None else value.decoded(errors="replace")

    def string_array(self, key: str) -> StringArray | None:
        """A string-array field as stored (see :class:`StringArray`)."""
        value = self.fields.get(key)
        if value is None:
            return None
        if not isinstance(value, StringArray):
            raise CorruptModelError(f"{self.path}: metadata {key!r} is not an array of STRING")
        return value

    def ints(self, key: str) -> list[int] | None:
        return self._numbers(key, int)

    def floats(self, key: str) -> list[float] | None:
        return self._numbers(key, float)

    def array(self, key: str) -> np.ndarray | None:
        """A numeric-array field as the numpy array it was parsed into (not to be written)."""
        value = self.fields.get(key)
        if value is None:
            return None
        if not isinstance(value, np.ndarray):
            raise CorruptModelError(f"{self.path}: metadata {key!r} is not a numeric array")
        return value

    def _numbers(self, key: str, kind: type) -> list[Any] | None:
        value = self.array(key)
        return None if value is None else [kind(v) for v in value.tolist()]

    def info(self, name: str, shape_hint: str = "") -> TensorInfo:
        """A tensor's table entry, checked: present, of a type we read, all its bytes in the file."""
        info = self.tensors.get(name)
        if info is None:
            raise CorruptModelError(f"{self.path}: tensor {name!r} is missing{shape_hint}")
        try:
            qtype = GGMLQuantizationType(info.tensor_type)
        except ValueError:
            raise UnsupportedModelError(f"{self.path}: tensor {name!r} has unknown type {info.tensor_type}") from None
        if qtype not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"{self.path}: tensor {name!r} has type {qtype.name}, which bargein has no kernels for "
                f"(supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))}); use a file of a "
                "supported type (e.g. Q4_K_M)"
            )
        if info.present != info.n_bytes:
            raise CorruptModelError(
                f"{self.path}: tensor {name!r} is truncated ({info.present} of {info.n_bytes} bytes present)"
            )
        return info

    def tensor(self, name: str, shape_hint: str = "") -> torch.Tensor:
        """Dequantized float32 tensor in torch shape (GGUF lists dims innermost first)."""
        info = self.info(name, shape_hint)
        qtype = GGMLQuantizationType(info.tensor_type)
        raw = self.mapped()[info.data_offset:info.data_offset + info.n_bytes]
        typed = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}.get(qtype)
        return dequantize(raw.view(typed) if typed is not None else raw, qtype, info.torch_shape)

    def blocks(self, name: str) -> BlockWeight | None:
        """A Q4_1 or Q8_0 matrix as its stored blocks (None for any other type or shape).

        ``BlockWeight.dequantize()`` of the answer equals :meth:`tensor` bit for bit: both
        compute ``d * q + m`` (``d * q``) in float32 from the same float16 d and m.
        """
        info = self.info(name)
        if not holds_blocks(info.tensor_type, info.torch_shape):
            return None
        return stored_blocks(info.read(), info.tensor_type, info.torch_shape)


def holds_blocks(ggml_type: int, shape: tuple[int, ...]) -> bool:
    """Whether a tensor of this type and (torch) shape can be held as a BlockWeight."""
    return GGMLQuantizationType(ggml_type) in BLOCK_TYPES and len(shape) == 2 and shape[1] % BLOCK == 0


def stored_blocks(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> BlockWeight:
    """A Q4_1 or Q8_0 matrix's stored bytes (uint8, as in the file) as a BlockWeight
    (see :func:`holds_blocks`); the quants are the file's bytes, never widened."""
    bits = BLOCK_TYPES[GGMLQuantizationType(ggml_type)]
    rows, num_blocks = shape[0], shape[1] // BLOCK
    data = torch.from_numpy(raw).view(rows, num_blocks, -1)
    scales = data[..., 0:2].contiguous().view(torch.float16).float().view(rows, num_blocks)
    if bits == 4:
        mins = data[..., 2:4].contiguous().view(torch.float16).float().view(rows, num_blocks)
        return BlockWeight(4, data[..., 4:].contiguous(), scales, mins)
    return BlockWeight(8, data[..., 2:].contiguous().view(torch.int8), scales, None)


@functools.lru_cache(maxsize=4)
def _open_cached(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: Path) -> GGUFFile:
    """Open (or reuse) a GGUF file; config, weights and tokenizer all read the same one."""
    stat = path.stat()
    return _open_cached(path, stat.st_mtime_ns, stat.st_size)


def close_gguf_files() -> None:
    """Forget the files :func:`open_gguf` keeps (their metadata: the vocabulary, merges, ...)
    once everything is read from them."""
    _open_cached.cache_clear()


def read_gguf_config(path: Path, name: str) -> ModelConfig:
    """ModelConfig from GGUF metadata. Unknown architectures and RoPE scalings are refused."""
    f = open_gguf(path)
    arch = f.require("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"{path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})"
        )

    def key(k: str) -> str:
        return f"{arch}.{k}"

    hidden = int(f.require(key("embedding_length")))
    num_heads = int(f.require(key("attention.head_count")))
    head_dim = int(f.get(key("attention.key_length"), hidden // num_heads))
    num_layers = int(f.require(key("block_count")))
    if "token_embd.weight" not in f.tensors:
        raise CorruptModelError(f"{path}: tensor 'token_embd.weight' is missing")
    vocab_size = int(f.tensors["token_embd.weight"].shape[-1])

    def small_tensor(name: str) -> torch.Tensor | None:
        return f.tensor(name) if name in f.tensors else None

    features = gguf_features(GGUF_FAMILIES[arch], lambda k, default=None: f.get(key(k), default), small_tensor,
                             path, num_layers, head_dim, hidden, num_heads)
    features.update(gguf_moe(arch, lambda k, default=None: f.get(key(k), default), f.tensors.__contains__,
                             num_layers, int(f.require(key("feed_forward_length")))))
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(f.require(key("feed_forward_length"))),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(f.get(key("attention.head_count_kv"), num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(f.get(key("attention.layer_norm_rms_epsilon"), 1e-5)),
        rope_theta=float(f.get(key("rope.freq_base"), 10000.0)),
        max_position_embeddings=int(f.get(key("context_length"), 4096)),
        tie_word_embeddings="output.weight" not in f.tensors,
        attention_bias="blk.0.attn_q.bias" in f.tensors,
        name=name,
        **features,
    )


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Invert llama.cpp's ``w.reshape(n, 2, d // n // 2, *rest).swapaxes(1, 2)``.

    Works for weights (out, in), biases (out,) and any tensor with one row per output
    (a BlockWeight's parts): rows of each head go from interleaved pairs (x0, y0, x1, y1,
    ...) back to halves (x0, x1, ..., y0, y1, ...).
    """
    rest = w.shape[1:]
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def unpermute_qk_blocks(w: BlockWeight, n_heads: int) -> BlockWeight:
    """:func:`unpermute_qk` of a block-held weight: blocks run along a row, so moving whole
    rows (quants, scales and mins alike) is the same permutation."""
    def rows(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else unpermute_qk(t, n_heads).contiguous()

    return BlockWeight(w.bits, rows(w.qs), rows(w.scales), rows(w.mins))


def qk_row_order(rows: int, n_heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's Q/K permutation: row i of the Hugging Face
    layout is stored row ``order[i]`` (:func:`unpermute_qk` of the row indices)."""
    return unpermute_qk(torch.arange(rows), n_heads).contiguous()


Weight = torch.Tensor | BlockWeight | QuantWeight


def load_gguf_weights(
    path: Path,
    config: ModelConfig,
    *,
    layer_range: tuple[int, int] | None,
    dtype: torch.dtype,
    device: torch.device,
    progress: bool,
    blocks: bool = False,
) -> dict[str, Weight]:
    """Canonical tensors for layers [start, end) (see bargein.loader.names), each moved to
    ``device`` as soon as it is read. With ``blocks``, every matrix of a type in
    :data:`QUANT_TYPES` is a QuantWeight over the mapped file (on the CPU, whatever
    ``device``): never read here, never widened, never copied."""
    f = open_gguf(path)
    start, end = check_layer_range(config, layer_range)
    wanted = {
        canon: gguf_name for canon, (gguf_name, _) in wanted_tensors(config, start, end).items()
    }
    if "rope_freqs.weight" in f.tensors:
        wanted["rope_freq_factors"] = "rope_freqs.weight"
    # the pages read whole come in beside the tokenizer's build (file_maps.map_ahead)
    map_ahead(f.mapped(), _read_whole(f, config, wanted, blocks=blocks, last=end == config.num_layers))
    arch = f.get("general.architecture")
    weights: dict[str, Weight] = {}
    stored = widened = 0  # quantized matrices widened here (without ``blocks``): their bytes before and after
    for canon, gguf_name in _progress(wanted.items(), len(wanted), config.name, progress):
        heads = config.num_heads if ".wq." in canon else config.num_kv_heads
        permuted = arch in PERMUTED_ARCHS and (".wq." in canon or ".wk." in canon)
        gguf_name, e = gguf_location(f.tensors, canon, gguf_name)  # an expert's own tensor is read as any matrix
        if e is not None:  # a slice of the layer's stacked experts
            expert = f.expert(gguf_name, e, blocks)
            weights[canon] = expert if isinstance(expert, QuantWeight) else expert.to(device=device, dtype=dtype)
            continue
        rows = stored_rows(config, canon)  # a share of a fused matrix, or partial rotary's order
        held = f.quant(gguf_name) if blocks else None
        if held is not None:
            held = held.reorder_rows(qk_row_order(held.shape[0], heads)) if permuted else held
            weights[canon] = held.reorder_rows(rows) if rows is not None else held
            continue
        w = f.tensor(gguf_name)
        if permuted:
            w = unpermute_qk(w, heads)
        if rows is not None:
            w = w.index_select(0, rows)
        weights[canon] = w.to(device=device, dtype=torch.float32 if canon == "rope_freq_factors" else dtype)
        del w  # before the next tensor is read
        if GGMLQuantizationType(f.tensors[gguf_name].tensor_type) in QUANT_TYPES:
            stored += f.tensors[gguf_name].n_bytes
            widened += weights[canon].numel() * weights[canon].element_size()
    f.forget_stacked()
    if widened and device.type != "cpu":
        log.warning("the file's quantized matrices (%.0f MiB of blocks) are widened to %.0f MiB of %s on upload "
                    "to %s", stored / 2**20, widened / 2**20, str(dtype).removeprefix("torch."), device)
    return weights


def _read_whole(f: GGUFFile, config: ModelConfig, wanted: dict[str, str], *, blocks: bool,
                last: bool) -> list[tuple[int, int]]:
    """(offset, nbytes) in the file of the wanted tensors read whole (names.read_whole)."""
    spans = []
    for canon, gguf_name in wanted.items():
        info = f.tensors.get(gguf_name)
        if info is not None and read_whole(config, canon, blocks=blocks, last=last):  # a missing one: the load says
            spans.append((info.data_offset, info.n_bytes))
    return spans


def _progress(items: Any, total: int, name: str, enabled: bool) -> Iterator[Any]:
    return iter(
        tqdm(
            items,
            total=total,
            desc=f"Loading {name}",
            unit="tensor",
            file=sys.stderr,
            disable=not enabled,
        )
    )
