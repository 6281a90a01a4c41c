"""Frozen configuration, one dataclass per concern.

Values derived from others are properties, never fields written back at run time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROPE_SCALINGS = ("llama3", "linear", "yarn", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """A frequency scaling of RoPE, by ``kind`` (see bargein.model.rope for each formula).

    llama3: ``factor``, ``low_freq_factor``, ``high_freq_factor`` and the original context.
    linear: positions divided by ``factor``. yarn: ``factor``, ``beta_fast``/``beta_slow``
    and the original context. longrope: per-frequency ``short_factor``/``long_factor``
    (the long ones where the served context exceeds the original one). ``attention_factor``
    multiplies cos and sin (yarn, longrope); None: the family's formula from ``factor``.
    """

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    kind: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"RoPE scaling {self.kind!r} is not supported (supported: {', '.join(ROPE_SCALINGS)})")


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts feed-forward layers (Qwen2/3-MoE, Mixtral).

    Each token's router logits (one per expert) are softmaxed over all experts; the
    ``experts_per_token`` largest probabilities choose the experts, and their weights are
    those probabilities, divided by their sum where ``norm_topk_prob`` (Qwen3-MoE, and
    Mixtral, whose softmax over the chosen logits is the same). The layer's output is the
    weighted sum of the chosen experts' SwiGLU MLPs (``expert_intermediate_size`` wide),
    plus, where ``shared_expert_intermediate_size`` (Qwen2-MoE), a shared SwiGLU MLP
    scaled by ``sigmoid(x . shared_gate)``. ``dense_layers``: layers with a dense MLP instead.
    """

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts per token ({self.experts_per_token}) must be within 1..{self.num_experts}")
        if self.expert_intermediate_size < 1:
            raise ValueError(f"expert_intermediate_size must be positive, got {self.expert_intermediate_size}")

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer`` (a global index) is a mixture of experts (else a dense MLP)."""
        return layer not in self.dense_layers


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder of the Llama family and its relatives, as read from a checkpoint.

    The defaults describe a Llama; each other family sets the few fields where it differs
    (``family`` names its tensors; the model reads only the feature fields):

    - ``qk_norm``: an RMS norm over each head of Q and K before RoPE (Qwen3, Gemma 3);
    - ``sandwich_norms``: norms after attention and after the MLP as well (Gemma 2/3);
    - ``activation``: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma);
    - ``embed_scale``: embeddings multiplied by sqrt(hidden) (Gemma);
    - ``attn_softcap``/``final_softcap``: ``cap * tanh(x / cap)`` of attention scores and of
      the logits (Gemma 2); ``query_scale``: the attention's score scale (None: head_dim^-0.5);
    - ``sliding_window`` with ``local_layers``: those layers attend to the last
      ``sliding_window`` positions only (Mistral: every layer; Gemma: interleaved);
      ``local_rope_theta``: their RoPE base, unscaled (Gemma 3); None: the global one;
    - ``rotary_dim``: RoPE on that many leading dimensions of each head (Phi-4-mini);
      None: all of them;
    - ``moe``: mixture-of-experts MLPs (see :class:`MoEConfig`); None: dense MLPs.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on wq, wk, wv
    name: str = "model"
    family: str = "llama"
    qk_norm: bool = False
    sandwich_norms: bool = False
    activation: str = "silu"
    embed_scale: bool = False
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_scale: float | None = None
    sliding_window: int | None = None
    local_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None
    rotary_dim: int | None = None
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation must be silu or gelu_tanh; got {self.activation!r}")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and within the head ({self.head_dim})")
        if self.local_layers and not self.sliding_window:
            raise ValueError("local layers need a sliding window")

    @property
    def every_layer_window(self) -> int | None:
        """The sliding window when every layer attends within it (Mistral), so that a
        sequence's blocks before it are never read again; None where some layer is global."""
        return self.sliding_window if len(self.local_layers) == self.num_layers else None

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (a global index), or None where it attends to everything."""
        return self.sliding_window if layer in self.local_layers else None

    @property
    def scale(self) -> float:
        """The attention scores' scale."""
        return self.query_scale if self.query_scale is not None else self.head_dim ** -0.5


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: ``num_blocks`` blocks of ``block_size`` token slots.

    Sized by one of: ``num_blocks``; ``kv_tokens`` (that many token slots, rounded up to
    whole blocks); else ``memory_bytes`` (as many blocks as fit). A count wins over the
    byte budget, which then has no effect; ``num_blocks`` and ``kv_tokens`` together are
    refused.

    ``kv_disk_dir``: a directory for the disk tier under the pool (None: no tier): full
    blocks leaving memory are written there and read back on a later prefix miss, also
    after a restart; ``kv_disk_bytes`` bounds it (least recently used blocks go first).
    """

    block_size: int = 16
    memory_bytes: int = 512 * 1024**2
    num_blocks: int | None = None
    kv_tokens: int | None = None
    enable_prefix_caching: bool = True
    kv_disk_dir: str | None = None
    kv_disk_bytes: int = 20 * 1024**3

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        if self.kv_tokens is not None and self.kv_tokens <= 0:
            raise ValueError(f"kv_tokens must be positive, got {self.kv_tokens}")
        if self.num_blocks is not None and self.kv_tokens is not None:
            raise ValueError("give num_blocks or kv_tokens, not both: each sets the KV cache's size")
        if self.kv_disk_bytes <= 0:
            raise ValueError(f"kv_disk_bytes must be positive, got {self.kv_disk_bytes}")

    @property
    def counted_blocks(self) -> int | None:
        """The pool's size in blocks where a count sets it (``num_blocks``, or ``kv_tokens``
        rounded up to whole blocks); None where ``memory_bytes`` does."""
        if self.kv_tokens is not None:
            return -(-self.kv_tokens // self.block_size)
        return self.num_blocks


@dataclass(frozen=True)
class SchedulerConfig:
    """How much work one step may take."""

    max_num_seqs: int = 64  # sequences in one forward
    max_num_batched_tokens: int = 512  # tokens in one forward (prefill chunks + decodes)
    # Prompt tokens (chunks of more than one token) a step may carry beside decodes; None:
    # up to max_num_batched_tokens. Where a forward's time grows with its tokens (a CPU),
    # a big prompt chunk makes every running stream wait several decode steps' time.
    max_mixed_prefill_tokens: int | None = None
    # A time target for one step, in ms; None: steps are bounded by tokens alone. With a
    # target, prompt chunks are sized from measured step times (engine/step_time.py) and
    # steps are fair: decodes, then a first chunk of every waiting request, then the next
    # chunks of running prompts (engine/step_budget.py). A cancel then waits at most about
    # one target (C1). The server's default is chosen in cli/serve.py.
    max_step_ms: float | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.max_mixed_prefill_tokens is not None and self.max_mixed_prefill_tokens <= 0:
            raise ValueError("max_mixed_prefill_tokens must be positive")
        if self.max_step_ms is not None and not self.max_step_ms > 0:
            raise ValueError(f"max_step_ms must be a positive number of milliseconds, got {self.max_step_ms}")


SPECULATIVE_METHODS = ("off", "ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/speculative/): cheap guesses verified in one forward.

    ``method``: "off"; "ngram" (prompt lookup: the answer's last tokens matched against the
    prompt and the answer so far); "draft" (a small model of the same vocabulary at
    ``draft_model``, with its own paged K/V). Whatever the method, a request's tokens are
    exactly those it gets without speculation (greedy and seeded sampled alike).
    ``max_draft_tokens``: the most guesses verified per step (k adapts below it to the
    request's acceptance rate and a guess's cost). ``guess_cost``: a guess row's time in
    one-row decode steps; None: measured from the engine's steps (0.35 until it has). ``ngram_min``/``ngram_max``: the suffix lengths prompt lookup
    matches, longest first. ``max_batch``: speculation backs off (plain decodes) when a step
    carries more decode rows than this, where a wider batch already uses the weights' reads
    that speculation would (bench/bench_speculative.py measures the crossover).
    ``draft_kv_tokens``: the draft model's own KV cache, in token slots.
    """

    method: str = "off"
    max_draft_tokens: int = 6  # 7 rows: one pass of the int8 matmul's few-rows path (6 + 1 would take two)
    ngram_min: int = 2
    ngram_max: int = 4
    max_batch: int = 4
    guess_cost: float | None = None
    draft_model: str | None = None
    draft_kv_tokens: int = 16384

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}; "
                             f"got {self.method!r}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs a draft model (--draft-model PATH)")
        if self.max_draft_tokens < 1 or self.max_batch < 1 or self.draft_kv_tokens < 1:
            raise ValueError("max_draft_tokens, max_batch and draft_kv_tokens must be at least 1")
        if self.guess_cost is not None and not self.guess_cost >= 0:
            raise ValueError(f"guess_cost must be 0 or more, got {self.guess_cost}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}")

    @property
    def enabled(self) -> bool:
        return self.method != "off"


PIPELINE_TRANSPORTS = ("auto", "graph", "calls")


@dataclass(frozen=True)
class PipelineConfig:
    """A model split into pipeline stages on a Ray cluster (``bargein[ray]``).

    ``ray_address``: "auto" (the cluster this machine belongs to), "local" (start a Ray
    instance in this process), or an address ("HOST:6379", "ray://HOST:10001").
    ``stage_layers``: the layer range of each stage, by hand; None splits the layers by
    each stage's node memory (Ray's ``memory`` resource). ``micro_batches``: plans in
    flight at once (1 runs the stages one after the other). ``ship_weights``: stages
    that get their tensors from the head even if their node has the model file.

    A lost stage (issue 13): the head notices a stage that died or stopped answering
    within ``heartbeat_timeout_s`` of a heartbeat (sent every ``heartbeat_interval_s``
    while a plan is out, on its own thread in the stage, so it never queues behind
    plans) or once a plan takes longer than ``step_timeout_s``. It re-creates the stage
    on a node with room; if none can host it within ``recovery_timeout_s``, the
    requests end with an error and the pipeline stays degraded until a node can.
    ``node_resource``: stages run only on nodes that offer this custom Ray resource
    (``ray start --resources='{"bargein": 1}'``); None: any node with a CPU.
    ``node_ids``: the Ray node of each stage, given (replicas that are pipelines: the
    replica set plans every replica's stages at once); None: by memory, as above.
    ``threads_per_stage``: each stage's compute threads (and Ray CPUs); None: what its
    node offers, shared among the stages placed there (``distributed/stage_threads.py``).
    ``transport``: how plans and hidden states move (``bargein.distributed.transport``):
    "auto" is a Ray compiled graph where every stage runs on the head's node and it has
    cores to spare, actor calls elsewhere; "graph" (one node only) and "calls" force one.
    """

    stages: int = 2
    ray_address: str = "auto"
    stage_layers: tuple[tuple[int, int], ...] | None = None
    micro_batches: int | None = None  # None: one per stage
    threads_per_stage: int | None = 1  # None: per node, what it offers (distributed/stage_threads.py)
    ship_weights: tuple[int, ...] = ()
    step_timeout_s: float = 60.0
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 3.0
    recovery_timeout_s: float = 30.0
    node_resource: str | None = None
    node_ids: tuple[str, ...] | None = None  # stage i on Ray node node_ids[i] (a replica set's plan)
    transport: str = "auto"

    def __post_init__(self) -> None:
        if self.transport not in PIPELINE_TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(PIPELINE_TRANSPORTS)}; got {self.transport!r}")
        if self.node_ids is not None and len(self.node_ids) != self.stages:
            raise ValueError(f"{len(self.node_ids)} nodes were given for {self.stages} stages")
        for name in ("step_timeout_s", "heartbeat_interval_s", "heartbeat_timeout_s", "recovery_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be a positive number of seconds")
        if self.stages < 1:
            raise ValueError("a pipeline needs at least one stage")
        if self.stage_layers is not None and len(self.stage_layers) != self.stages:
            raise ValueError(f"{len(self.stage_layers)} layer ranges were given for {self.stages} stages")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise ValueError("micro_batches must be at least 1")
        if self.threads_per_stage is not None and self.threads_per_stage < 1:
            raise ValueError("threads_per_stage must be at least 1")

    @property
    def max_in_flight(self) -> int:
        return self.micro_batches or self.stages


DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
PRECISIONS = ("exact", "fast")
WEIGHTS_MEMORY = ("auto", "private", "mapped")  # bargein.loader.private_weights
# Decode-only steps of these batch sizes (padded up to the next one) replay CUDA graphs.
CUDA_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from besides the weights.

    ``device``: "auto" (CUDA where ``torch.cuda.is_available()``, else the CPU), "cpu",
    "cuda" or "cuda:N". ``dtype`` of weights and K/V: "auto" is bfloat16 on CUDA and
    float32 on the CPU. Both are resolved once, by ``bargein.engine.device``.
    """

    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # Our C kernels (bargein/kernels), built on first use where a C compiler is found;
    # float32 CPU only. False, or BARGEIN_NATIVE_KERNELS=0, keeps to PyTorch's own.
    native_kernels: bool = True
    # "exact": float32 from the stored weights, float32 K/V, the reference's numbers to float
    # rounding. "fast" (float32 on the CPU with native kernels; else it runs as exact, with a
    # warning): int8 activations on the 4-/8-bit weight blocks, float16 K/V, every token's
    # result independent of the batch and thread count. See bargein.kernels.ops. The
    # default, since its perplexity is within 1% of exact's (+0.3%, tests/test_perplexity.py).
    precision: str = "fast"
    # Weights a GGUF holds in Q4_1/Q8_0 blocks are read from those blocks by every forward.
    # True also keeps a float32 copy of each (oneDNN-packed), which forwards of more than a
    # few rows read instead in ``exact``: faster batches and prefill, at 4-6x the weights'
    # memory. None: True in ``exact``, False in ``fast`` (which never reads a float32 copy).
    fp32_weights: bool | None = None
    # Where the weights the kernels read in place live: "private", this process's own memory,
    # made in place by a background thread while the model already serves from the file, on
    # 2 MB pages where they come fast, else on 4 KB pages for khugepaged to merge (one stream
    # decodes up to ~1.2x faster from it than from 4 KB file pages); "mapped", the file's
    # pages in the page cache as they are, shared with other processes on the file; "auto",
    # the file's pages where the page cache holds them on 2 MB pages (the same thread reads
    # them again from the file onto such pages where the kernel gives them, faster still
    # and shared), else "private"; a file on tmpfs or ramfs stays mapped (its pages are
    # memory already), gathered onto 2 MB pages in place. See bargein.loader.private_weights.
    # An MoE's experts stay mapped either way: a token reads only those it is routed to.
    weights_memory: str = "auto"
    # CUDA only: replay decode-only steps from CUDA graphs captured per batch size.
    cuda_graphs: bool = True
    cuda_graph_batch_sizes: tuple[int, ...] = CUDA_GRAPH_BATCH_SIZES
    # Several machines: the model split into stages on a Ray cluster (None: this process).
    pipeline: PipelineConfig | None = None
    # The model's sliding window, over what its file says (bargein.loader.families.
    # with_sliding_window): 0 none, N > 0 N positions; None: the file's.
    sliding_window: int | None = None
    # Speculative decoding (off by default; answers are the same either way).
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.sliding_window is not None and self.sliding_window < 0:
            raise ValueError(f"sliding_window must be 0 (none) or a number of positions; got {self.sliding_window}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {self.precision!r}")
        if self.weights_memory not in WEIGHTS_MEMORY:
            raise ValueError(f"weights_memory must be one of {', '.join(WEIGHTS_MEMORY)}; got {self.weights_memory!r}")
        base, _, index = self.device.partition(":")
        if base not in DEVICES or (index and (base != "cuda" or not index.isdigit())):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        if not self.cuda_graph_batch_sizes or any(b <= 0 for b in self.cuda_graph_batch_sizes):
            raise ValueError("cuda_graph_batch_sizes must be positive batch sizes")

