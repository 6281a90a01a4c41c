"""Memory stated before a model is loaded: its weights, its KV cache, the resident set to expect.

Weights read in place from a memory-mapped GGUF (the block types the kernels read) are
file-backed pages with ``weights_memory="mapped"``: the kernel can drop and re-read them,
so they never cause an out-of-memory kill, though a machine without room for them pages
(slowly). With ``"private"`` they become private memory, copied in place beside serving
(bargein.loader.private_weights), and are counted there, as with ``"auto"`` (the default),
which keeps the file's pages where the page cache holds them on 2 MB pages and else copies
them (so a plan counts the copy), but keeps a file on tmpfs or ramfs mapped (its pages are
memory already: counted as mapped); an MoE's experts stay mapped either way (a token reads
only those it is routed to). Everything else is private memory: weights widened or copied
at load, the KV cache, and the process itself (PyTorch, the tokenizer, buffers;
:data:`RUNTIME_BYTES`, an estimate). A plan whose private memory exceeds what the system
has available cannot run and is refused here, with one message, instead of being killed
half-way through loading.

``--kv-memory auto`` sizes the KV cache from what is left: the available memory minus
the weights (mapped ones too: they should stay resident), the runtime and a margin. A file
on tmpfs or ramfs is the exception: its pages are memory already, outside what the system
counts as available, so its mapped weights are not taken from it a second time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bargein.config import EngineConfig, ModelConfig
from bargein.kernels.ggml_types import GGMLQuantizationType
from bargein.kernels.half_rows import ROUTING_WEIGHTS
from bargein.kernels.quant_weight import QUANT_TYPES
from bargein.loader.errors import LoaderError
from bargein.loader.gguf_file import open_gguf
from bargein.loader.hf_folder import stored_dtypes
from bargein.loader.huge_page_cache import memory_file_system
from bargein.loader.names import expected_shape, expert_index, gguf_location, wanted_tensors
from bargein.loader.parameters import describe_parameters
from bargein.loader.source import ModelSource

MiB = 1 << 20
# The process's own memory besides weights, KV and the fused forward's step buffers: torch
# (~220 MB resident after import, measured), the server's modules, the tokenizer and the
# per-operation paths' buffers.
RUNTIME_BYTES = 400 * MiB


def step_buffer_bytes(model_config: ModelConfig, rows: int) -> int:
    """The fused fast forward's workspace for a forward of ``rows`` tokens, which each model
    keeps once its largest step has needed it (kernels/fast_forward.c's lay_out: the normed
    rows, q/k/v, the queries, the attention's output, the projection, gate and up, their
    product, the RoPE rows and a local layer's own; each from a 16-float boundary)."""
    c = model_config
    q_width, d = c.num_heads * c.head_dim, c.head_dim
    local = 2 if c.local_rope_theta is not None else 0
    per_row = [c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * d, q_width, q_width, c.hidden_size,
               2 * c.intermediate_size, c.intermediate_size, d, d, *([d] * local)]
    return 4 * sum((max(rows, 1) * n + 15) // 16 * 16 for n in per_row)
# Left free under --kv-memory auto, for the rest of the machine and for growth.
MARGIN_FRACTION = 0.10
MIN_KV_TOKENS = 256  # an auto KV cache smaller than this could not hold a real conversation


class MemoryPlanError(LoaderError):
    """The model cannot run in the memory this machine has; the message says why."""


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes a model will take, stated before loading. ``expected_rss`` is their sum."""

    mapped_weight_bytes: int  # read in place from the mapped file: file-backed, shared
    private_weight_bytes: int  # widened or copied into the process's own memory
    kv_bytes: int
    kv_tokens: int
    runtime_bytes: int
    step_bytes: int  # the fused forward's buffers for a full step (0 where it does not run)
    available_bytes: int | None  # the system's available memory when planned; None if unknown
    parameters: str = ""  # the model's parameter counts, total and (an MoE's) active per token
    # The file's memory file system (tmpfs, ramfs) where it is on one: the mapped weights are
    # its pages, held in memory already and not part of ``available_bytes``.
    memory_file_system: str | None = None

    @property
    def private_bytes(self) -> int:
        return self.private_weight_bytes + self.kv_bytes + self.runtime_bytes + self.step_bytes

    @property
    def expected_rss(self) -> int:
        return self.mapped_weight_bytes + self.private_bytes

    @property
    def needs_available_bytes(self) -> int:
        """What the plan takes from the system's available memory: all it holds, but for
        mapped pages of a file on tmpfs or ramfs, which are memory already."""
        return self.private_bytes + (0 if self.memory_file_system else self.mapped_weight_bytes)

    def describe(self) -> str:
        """The one log line ``serve`` writes before loading."""
        held = f" (the file's pages on {self.memory_file_system})" if self.memory_file_system else ""
        line = (f"memory plan: weights {self.mapped_weight_bytes / MiB:,.0f} MiB mapped{held} + "
                f"{self.private_weight_bytes / MiB:,.0f} MiB private, KV cache {self.kv_bytes / MiB:,.0f} MiB "
                f"({self.kv_tokens:,} tokens), "
                + (f"step buffers {self.step_bytes / MiB:,.0f} MiB, " if self.step_bytes else "")
                + f"runtime ~{self.runtime_bytes / MiB:,.0f} MiB: "
                f"expected RSS ~{self.expected_rss / MiB:,.0f} MiB")
        if self.parameters:
            line = f"{self.parameters}; {line}"
        if self.available_bytes is not None:
            line += f" of {self.available_bytes / MiB:,.0f} MiB available"
            if self.needs_available_bytes > self.available_bytes:
                line += " (the mapped weights will not all stay resident: expect paging)"
        return line


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo (bytes), None where the system does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def plan_memory(source: ModelSource, model_config: ModelConfig, config: EngineConfig, *,
                kv_auto: bool = False, available: int | None = None) -> MemoryPlan:
    """The memory ``config`` will take for the model at ``source``, from its tensor table
    (nothing read). ``kv_auto``: the KV cache gets what is left of ``available`` (default:
    the system's available memory). Raises MemoryPlanError
    where the private memory cannot fit, or ``kv_auto`` leaves no room for a KV cache."""
    available = available if available is not None else available_memory()
    on_cpu = not config.device.startswith("cuda") and config.dtype in ("auto", "float32")
    reads_blocks = on_cpu and config.native_kernels
    fast = config.precision == "fast" and reads_blocks
    mapped, private, experts = _weight_bytes(source, model_config, reads_blocks, fast)
    in_place = mapped  # what --weights-memory mapped would leave in the file's pages
    in_memory = memory_file_system(str(source.path))
    copies = config.weights_memory == "private" or (config.weights_memory == "auto" and in_memory is None)
    if copies:  # the blocks read in place may be made private, but an MoE's experts
        mapped, private = experts, private + mapped - experts
    # Pages of a file on tmpfs are memory already, outside `available`: not taken from it again.
    mapped_from_available = 0 if in_memory else mapped
    per_token = 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim * (2 if fast else 4)
    step = step_buffer_bytes(model_config, config.scheduler.max_num_batched_tokens) if fast else 0
    runtime = RUNTIME_BYTES + step
    block = config.cache.block_size
    if kv_auto:
        if available is None:
            raise MemoryPlanError("--kv-memory auto needs the system's available memory, which it does not report "
                                  "here; give a size (e.g. --kv-memory 1GiB)")
        left = int(available * (1 - MARGIN_FRACTION)) - mapped_from_available - private - runtime
        max_len = config.max_model_len or model_config.max_position_embeddings
        tokens = min(max(left, 0) // per_token, max_len * config.scheduler.max_num_seqs) // block * block
        if tokens < MIN_KV_TOKENS:
            raise MemoryPlanError(
                f"{source.path}: the model needs ~{(mapped_from_available + private + runtime) / MiB:,.0f} MiB "
                f"(weights {(mapped_from_available + private) / MiB:,.0f} MiB, runtime ~{runtime / MiB:,.0f} MiB) and "
                f"this machine has {available / MiB:,.0f} MiB available: no room is left for a KV cache "
                f"of {MIN_KV_TOKENS} tokens")
    elif config.cache.counted_blocks is not None:
        tokens = config.cache.counted_blocks * block
    else:
        tokens = config.cache.memory_bytes // (per_token * block) * block
    plan = MemoryPlan(mapped, private, tokens * per_token, tokens, RUNTIME_BYTES, step, available,
                      describe_parameters(model_config) if model_config.moe is not None else "", in_memory)
    if available is not None and plan.private_bytes > available:
        # Copied blocks that could stay in the file's pages: say so where that would fit.
        mapped_fits = mapped < in_place and plan.private_bytes - (in_place - mapped) <= available
        raise MemoryPlanError(
            f"{source.path}: this needs ~{plan.private_bytes / MiB:,.0f} MiB of private memory (weights "
            f"{private / MiB:,.0f} MiB, KV cache {plan.kv_bytes / MiB:,.0f} MiB, runtime "
            f"~{runtime / MiB:,.0f} MiB) and this machine has {available / MiB:,.0f} MiB available; "
            + (f"--weights-memory mapped keeps {(in_place - mapped) / MiB:,.0f} MiB of weights in the file's pages "
               "instead "
               "(slower where they do not all stay resident), or " if mapped_fits else "")
            + "use a smaller KV cache (--kv-memory / --kv-tokens) or a smaller file")
    return plan


def _weight_bytes(source: ModelSource, model_config: ModelConfig, reads_blocks: bool,
                  fast: bool) -> tuple[int, int, int]:
    """(mapped, private, experts) bytes of every weight the model holds, where the kernels
    read in place all that can be read so (``experts``: the MoE experts' share of ``mapped``)."""
    wanted = wanted_tensors(model_config, 0, model_config.num_layers)
    mapped = private = experts = 0
    if source.kind != "gguf":  # the float-source rule (bargein.kernels.half_rows) on the headers' dtypes
        stored = stored_dtypes(source.path, model_config)
        for canon in wanted:
            dtype, shape = stored.get(canon, ("F32", expected_shape(model_config, canon) or ()))
            numel = 1
            for d in expected_shape(model_config, canon) or shape:
                numel *= d
            matrix = len(shape) == 2 and not canon.endswith(ROUTING_WEIGHTS)
            if reads_blocks and matrix and dtype in ("F16", "BF16"):
                mapped += 2 * numel  # 16-bit rows over the mapped file
                experts += 2 * numel if expert_index(canon) is not None else 0
            elif fast and matrix:
                private += 2 * numel  # float32 narrowed to 16-bit rows
            else:
                private += 4 * numel
        return mapped, private, experts
    tensors = open_gguf(source.path).tensors
    # dict.fromkeys: an MoE layer's experts are one stacked tensor, named by each expert's entry
    canon_of = {gguf_location(tensors, c, gguf)[0]: c for c, (gguf, _) in wanted.items()}
    names = list(canon_of) + (["rope_freqs.weight"] if "rope_freqs.weight" in tensors else [])
    for name in names:
        info = tensors.get(name)
        if info is None:
            continue  # the loader reports it
        numel = 1
        for d in info.shape.tolist():
            numel *= int(d)
        try:
            qtype = GGMLQuantizationType(info.tensor_type)
        except ValueError:
            continue  # an unknown type: the loader refuses it by name
        if reads_blocks and qtype in QUANT_TYPES and len(info.torch_shape) in (2, 3):  # 3: stacked experts
            mapped += info.n_bytes
            experts += info.n_bytes if expert_index(canon_of.get(name, "")) is not None else 0
        elif fast and qtype == GGMLQuantizationType.F32 and len(info.torch_shape) in (2, 3) \
                and not canon_of.get(name, "").endswith(ROUTING_WEIGHTS):
            private += 2 * numel  # float32 narrowed to 16-bit rows (bargein.kernels.half_rows)
        else:
            private += 4 * numel
    return mapped, private, experts
