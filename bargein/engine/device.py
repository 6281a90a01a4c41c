"""Where an engine's model runs and in which precision, resolved once from its config.

``resolve_device`` turns "auto" into CUDA where PyTorch sees a GPU and the CPU
otherwise; ``resolve_dtype`` turns "auto" into bfloat16 on CUDA and float32 on the CPU
(the CPU's exact mode). ``build_model`` puts a model together on that device: the
kernels are chosen here, once (``bargein.kernels.ops.resolve_kernels``), never inside a
module's constructor.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Iterator, MutableMapping

import torch

from bargein.config import EngineConfig, ModelConfig
from bargein.kernels.block_quant import BlockWeight
from bargein.kernels.ops import resolve_kernels
from bargein.kernels.quant_weight import QuantWeight
from bargein.model.block_weights import Weight, fast_weight
from bargein.model.llama import LlamaStage

log = logging.getLogger(__name__)


class DeviceError(ValueError):
    """The configured device cannot be used here; the message says why."""


def resolve_device(name: str) -> torch.device:
    """"auto" -> cuda if available else cpu; "cuda" without a usable GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {name!r} was asked for, but this PyTorch ({torch.__version__}) "
                              "sees no CUDA GPU; use --device cpu (or auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(f"device {name!r} was asked for, but only {torch.cuda.device_count()} "
                              "CUDA device(s) are visible")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto" -> bfloat16 on CUDA, float32 elsewhere; otherwise the named torch dtype."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def build_model(model_config: ModelConfig, weights: MutableMapping[str, Weight], config: EngineConfig,
                *, max_positions: int | None = None, layer_range: tuple[int, int] | None = None,
                private_copy: bool = False) -> LlamaStage:
    """The model (layers ``layer_range``, default all: a pipeline stage holds a range) on
    ``config``'s device and dtype, with its kernels resolved once.

    Weights held in blocks (a GGUF's matrices as QuantWeights, see
    ``load_weights(blocks=True)``) stay in blocks where the native kernels read them (a
    float32 CPU model), in both precisions, never copied (``config.fp32_weights`` applies
    to BlockWeights only, which no loader makes any more); elsewhere (CUDA, or no native
    kernels) each is widened to the model's dtype, and one log line says so and what it costs.
    Tensors not yet where they belong are moved one at a time, and every weight is dropped
    from ``weights`` as the model takes it, so no second copy of the model sits in memory.

    ``private_copy`` (the loaders' models: an engine's, a pipeline stage's, a draft model's):
    where ``config.weights_memory`` is "private" (or "auto", whose file pages on 2 MB pages
    stay), the pages under the file views among ``weights`` are made private memory in place
    once the model's first forward has run
    (:func:`bargein.loader.private_copy_of`, taken here before the build takes the weights
    out of the dict); weights with no file view (shipped ones) have nothing to copy.
    """
    copy = None
    if private_copy and config.weights_memory != "mapped":
        from bargein.loader import private_copy_of  # here: importing the engine loads no loader

        copy = private_copy_of(weights, file_pages_first=config.weights_memory == "auto")
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    kernels = resolve_kernels(device, native=config.native_kernels, precision=config.precision, dtype=dtype)
    reads_blocks = kernels.native is not None and device.type == "cpu" and dtype == torch.float32
    stored = widened = narrowed = halves = 0
    narrowed_to: dict[str, int] = {}  # 16-bit type -> matrices narrowed to it
    for name in list(weights):
        tensor = weights[name]
        # RoPE frequency factors stay float32: they set the angles, not the activations.
        want = torch.float32 if name == "rope_freq_factors" else dtype
        if isinstance(tensor, BlockWeight | QuantWeight):
            if not reads_blocks:
                weights[name] = tensor.dequantize().to(device=device, dtype=want)
                stored += tensor.nbytes
                widened += weights[name].numel() * weights[name].element_size()
        elif tensor.device != device or tensor.dtype != want:
            weights[name] = tensor.to(device=device, dtype=want)
        if kernels.fast and reads_blocks and (held := fast_weight(name, weights[name])) is not weights[name]:
            narrowed, halves = narrowed + tensor.numel() * 4, halves + held.nbytes  # float-source rule
            kind = "/".join(sorted(t.name for t in held.qtypes))
            narrowed_to[kind] = narrowed_to.get(kind, 0) + 1
            weights[name] = held
    if narrowed:
        log.info("fast: the float32 matrices (%.0f MiB) are held as 16-bit rows (%.0f MiB; %s), not "
                 "re-quantized to int8", narrowed / 2**20, halves / 2**20,
                 ", ".join(f"{n} as {kind}" for kind, n in sorted(narrowed_to.items())))
    if widened:
        why = (f"on {device.type} the weights are uploaded as {str(dtype).removeprefix('torch.')}"
               if device.type != "cpu" else "the native kernels are unavailable" if kernels.native is None
               else f"the model's dtype is {str(dtype).removeprefix('torch.')}")
        log.warning("widening the file's quantized matrices (%.0f MiB of blocks) to %.0f MiB of %s: %s",
                    stored / 2**20, widened / 2**20, str(dtype).removeprefix("torch."), why)
    fp32_weights = bool(config.fp32_weights)
    model = LlamaStage(model_config, weights, layer_range, max_positions=max_positions, kernels=kernels,
                       fp32_weights=fp32_weights, consume=True)
    release_free_heap()
    model = model.to(device)
    if copy is not None:  # beside serving, not the start (private_copy_of)
        copy.start_after_first_forward(model)
    return model


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Torch's intra-op threads set to 1 for the block: loading runs thousands of small
    copies and cats, which gain nothing from a second thread but pay an OpenMP barrier each;
    on a busy 2-core machine those barriers made loading SmolLM2 take 2-10 s instead of
    0.3-1.4 s (measured side by side)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere
    nothing). Loading frees many short-lived buffers between long-lived ones (each tensor's
    raw bytes, the parts of fused weights); glibc keeps that memory mapped, and on
    SmolLM2-135M it was ~40 MB that would otherwise sit under the KV cache allocated next."""
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: not glibc
        ctypes.CDLL(None).malloc_trim(0)
