"""Loading a model into this process: ``Engine.from_pretrained``'s work.

Each tensor goes to the device as it is read (no whole-model copy in host memory); on the
CPU a GGUF's Q4_1/Q8_0 weights stay in their stored blocks. A pipeline of stages on Ray is
built by :func:`bargein.build.build_engine`, a layer above the engine.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from bargein.config import EngineConfig
from bargein.engine.admission import EngineError
from bargein.engine.block_window import max_positions
from bargein.engine.device import (
    build_model,
    one_torch_thread,
    release_free_heap,
    resolve_device,
    resolve_dtype,
)
from bargein.startup import collection_paused

if TYPE_CHECKING:
    from bargein.engine.engine import Engine


def load_in_process(engine_class: type[Engine], ref: str | None, config: EngineConfig | None, *,
                    progress: bool = True) -> Any:
    """An ``engine_class`` over the model at ``ref`` (None: the bundled SmolLM2), run here."""
    # The collector paused, as serve's start-up does: loading builds a few hundred thousand
    # objects that live on (the vocabulary and merges, the imported modules), and each few
    # hundred of them started a collection walking the young ones, now and then all of
    # torch's (~7% of the bundled model's load, callgrind).
    with collection_paused():
        return _load(engine_class, ref, config, progress)


def _load(engine_class: type[Engine], ref: str | None, config: EngineConfig | None, progress: bool) -> Any:
    from bargein.loader import (
        close_model_files,
        load_config,
        load_tokenizer,
        load_weights,
        resolve_model_ref,
    )

    config = config or EngineConfig()
    if config.pipeline is not None:
        raise EngineError("a pipeline of stages is built by bargein.build_engine(ref, config), "
                          "not Engine.from_pretrained")
    source = resolve_model_ref(ref)
    model_config = load_config(source, sliding_window=config.sliding_window)
    device = resolve_device(config.device)
    max_len = max_positions(config, model_config)  # no position past the pool's longest sequence
    # The tokenizer is built on a thread of its own while the weights load: building it is
    # Python and the tokenizers library holding the GIL (0.5 s of a 262k vocabulary), the
    # weights' loading mostly reads the file's metadata and maps it; their private copy (or
    # the file's pages read again onto 2 MB pages: weights_memory, build_model's
    # private_copy) starts after the model's first forward, on a thread of its own.
    with one_torch_thread(), ThreadPoolExecutor(1, thread_name_prefix="bargein-tokenizer") as pool:
        tokenizer_started = pool.submit(load_tokenizer, source)
        # Each tensor goes to the device as it is read: no whole-model copy in host memory.
        # On the CPU a GGUF's Q4_1/Q8_0 weights stay in their stored blocks (build_model
        # dequantizes them where nothing reads blocks).
        weights = load_weights(source, model_config, dtype=resolve_dtype(config.dtype, device), device=device,
                               progress=progress, blocks=device.type == "cpu")
        model = build_model(model_config, weights, config, max_positions=max_len, private_copy=True)
        tokenizer = tokenizer_started.result()
        close_model_files()
        release_free_heap()  # what parsing the file and building the tokenizer left behind
        return engine_class(model, tokenizer, config, model_name=source.name, model_identity=source.path)
