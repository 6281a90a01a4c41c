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

import contextlib
import logging
import struct
from collections.abc import Iterator

import torch

from bargein.config import ModelConfig
from bargein.kernels.block_quant import BlockWeight
from bargein.loader.errors import (
    ChatTemplateError,
    CorruptModelError,
    LoaderError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from bargein.loader.families import missing_window_warning, with_sliding_window
from bargein.loader.gguf_file import (
    close_gguf_files,
    load_gguf_weights,
    open_gguf,
    read_gguf_config,
)
from bargein.loader.gguf_tokenizer import tokenizer_from_gguf
from bargein.loader.hf_folder import load_hf_weights, read_hf_config
from bargein.loader.names import check_layer_range, expected_shape, expert_index
from bargein.loader.private_weights import PrivateWeights, private_copy, wait_private_copies
from bargein.loader.source import ModelSource, resolve_model_ref
from bargein.loader.tokenizer import Tokenizer, tokenizer_from_folder

__all__ = [
    "ChatTemplateError",
    "CorruptModelError",
    "LoaderError",
    "ModelNotFoundError",
    "ModelSource",
    "Tokenizer",
    "UnsupportedModelError",
    "close_model_files",
    "load_config",
    "load_tokenizer",
    "load_weights",
    "private_copy_of",
    "resolve_model_ref",
    "wait_private_copies",
]


log = logging.getLogger(__name__)

# What parsing a malformed file raises below the loader's own checks (the gguf reader,
# int() of a string field, a reshape of a wrong-sized tensor, a division by a zero count).
_MALFORMED = (ValueError, TypeError, IndexError, KeyError, OverflowError, ZeroDivisionError,
              struct.error, RuntimeError)


@contextlib.contextmanager
def _malformed_is_corrupt(source: ModelSource, what: str,
                          kinds: tuple[type[Exception], ...] = _MALFORMED) -> Iterator[None]:
    """Any error of a malformed file becomes a CorruptModelError naming the file; LoaderErrors pass."""
    try:
        yield
    except LoaderError:
        raise
    except kinds as exc:
        raise CorruptModelError(f"{source.path}: malformed {what} ({type(exc).__name__}: {exc})") from exc


def load_config(source: ModelSource, *, sliding_window: int | None = None) -> ModelConfig:
    """The architecture of ``source``; ``config.name`` is the served model id.

    ``sliding_window`` (``--sliding-window``) overrides the file's window, see
    :func:`~bargein.loader.families.with_sliding_window`; without it, a GGUF of a family
    trained with a window that carries none is loaded as it is, with a warning."""
    with _malformed_is_corrupt(source, "model metadata"):
        read = read_gguf_config if source.kind == "gguf" else read_hf_config
        config = read(source.path, source.name)
        if sliding_window is None and source.kind == "gguf":
            f = open_gguf(source.path)
            names = [str(f.get("general.name") or ""), str(f.get("general.basename") or ""), source.path.name]
            if (warning := missing_window_warning(config, names, source.path)) is not None:
                log.warning(warning)
    if sliding_window is not None:
        config = with_sliding_window(config, sliding_window)
    _check_sizes(config, source)
    return config


# Sizes a header may claim before anything is allocated from them. The tensors' own sizes
# are checked against the bytes present; these are the values nothing else bounds (the
# RoPE table is sized by the context length) or that must be positive to mean anything.
MAX_POSITIONS = 1 << 22


def _check_sizes(config: ModelConfig, source: ModelSource) -> None:
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "max_position_embeddings"):
        if getattr(config, name) < 1:
            raise CorruptModelError(f"{source.path}: {name} must be positive, got {getattr(config, name)}")
    if config.max_position_embeddings > MAX_POSITIONS:
        raise UnsupportedModelError(
            f"{source.path}: a context of {config.max_position_embeddings} positions is more than "
            f"bargein supports ({MAX_POSITIONS})")


def close_model_files() -> None:
    """Drop what is kept of opened model files between the loads of config, weights and
    tokenizer (a GGUF's parsed metadata); call it once all three are loaded."""
    close_gguf_files()


def load_tokenizer(source: ModelSource) -> Tokenizer:
    """The tokenizer of ``source`` (GGUF metadata or the folder's tokenizer.json)."""
    # The tokenizers library raises plain Exception for an inconsistent vocabulary or merges.
    with _malformed_is_corrupt(source, "tokenizer", (Exception,)):
        if source.kind == "gguf":
            return tokenizer_from_gguf(open_gguf(source.path))
        return tokenizer_from_folder(source.path)


def load_weights(
    source: ModelSource,
    config: ModelConfig,
    *,
    layer_range: tuple[int, int] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool = True,
    blocks: bool = False,
) -> dict[str, torch.Tensor | BlockWeight]:
    """Canonical weights for layers [start, end) (all layers when None), as ``dtype`` on ``device``.

    With ``blocks``, a GGUF's matrices of the kernels' block types, and F16/BF16 matrices of
    either format, come back as they are stored, as
    :class:`~bargein.kernels.quant_weight.QuantWeight` views of the mapped file on the CPU
    (``dtype`` and ``device`` do not apply to them); nothing else changes
    (:func:`private_copy_of` makes their pages private memory later, in place).

    Each tensor is read, converted and moved to ``device`` before the next is read, so
    host memory holds one tensor at a time, never a float32 copy of the whole model
    (``rope_freq_factors`` stays float32).

    Layer names use global indices. ``embed.weight`` is included when start == 0, or at the
    last stage of a tied model; ``norm.weight`` and an untied ``lm_head.weight`` when
    end == num_layers. ``rope_freq_factors`` is included when the file has it. A tqdm bar
    on stderr shows progress unless ``progress`` is False.
    """
    check_layer_range(config, layer_range)  # the caller's mistake (ValueError), not the file's
    with _malformed_is_corrupt(source, "weights"):
        if source.kind == "gguf":
            weights = load_gguf_weights(source.path, config, layer_range=layer_range, dtype=dtype,
                                        device=torch.device(device), progress=progress, blocks=blocks)
        else:
            weights = dict(load_hf_weights(source.path, config, layer_range=layer_range, dtype=dtype,
                                           device=torch.device(device), progress=progress, blocks=blocks))
    for name, tensor in weights.items():
        shape = expected_shape(config, name)
        if shape is not None and tuple(tensor.shape) != shape:
            raise CorruptModelError(
                f"{source.path}: tensor for {name} has shape {tuple(tensor.shape)}, expected {shape}"
            )
    return weights


def private_copy_of(weights: dict[str, torch.Tensor | BlockWeight], *,
                    file_pages_first: bool = False) -> PrivateWeights | None:
    """The copy that makes the pages under the file views among ``weights`` (those of
    :func:`load_weights` with ``blocks``) private memory in place, the same bytes at the same
    addresses, on a background thread at the lowest priority (see
    bargein.loader.private_weights; one log line when it ends, :func:`wait_private_copies`
    waits for it), except an MoE's experts: a token reads only those it is routed to, so
    they stay in the file's pages, resident as they are read (a private copy would take all
    of them). Take it before the model is built (the build takes the weights out of the
    dict) and start it once the model's first forward has run (``after_next_forward``):
    started beside the build, on this project's 2-core VMs it took 0.07-0.1 s from the
    bundled model's 0.24 s start (page faults and the moves contend with the build's
    allocations); beside the first forward, which faults the file's pages in, 5-70 ms of
    its 30 ms; after it, nothing measurable. ``file_pages_first``: the file's pages stay where
    they are (or are read again onto) 2 MB pages of the page cache (weights_memory="auto").
    None where there is nothing to copy."""
    return private_copy(weights, keep=lambda name: expert_index(name) is not None,
                        describe_kept="MoE experts (resident as tokens route to them)",
                        file_pages_first=file_pages_first)
