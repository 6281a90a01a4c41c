"""The ``bargein`` command's one model loader, for ``serve``, ``chat`` and ``run``.

A model reference that points at nothing (a missing path, a missing default package) is a
usage error like any other bad argument: exit 2 under every command. A model that is
there but does not load (a corrupt file, an unusable device) is a failure at run time:
exit 1.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from bargein.cli.errors import EXIT_FAILURE, EXIT_USAGE, CliError

BUNDLED = "the bundled SmolLM2-135M-Instruct"


def model_error(exc: Exception) -> CliError:
    """The one classification of a model that cannot be used: missing is 2, the rest 1."""
    from bargein.loader import ModelNotFoundError

    missing = isinstance(exc, (ModelNotFoundError, FileNotFoundError, IsADirectoryError))
    return CliError(str(exc), EXIT_USAGE if missing else EXIT_FAILURE)


def _load_errors() -> tuple[type[Exception], ...]:
    from bargein.engine.device import DeviceError
    from bargein.loader import LoaderError

    return (LoaderError, DeviceError, FileNotFoundError, IsADirectoryError, PermissionError)


def load_engine(ref: str | None, config: Any, *, report: bool = False) -> Any:
    """The engine of ``ref`` (None: the bundled model) built for ``config``, or a CliError.

    ``report``: also print how long the load took (``bargein serve``'s log)."""
    from bargein.build import build_engine

    print(f"bargein: loading {ref or BUNDLED}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    try:
        # A progress bar only on a terminal: in a log file each redraw would be another line.
        engine = build_engine(ref, config, progress=sys.stderr.isatty())
    except _load_errors() as exc:
        raise model_error(exc) from None
    if report:
        print(f"bargein: loaded {engine.model_name} in {time.perf_counter() - started:.1f} s", file=sys.stderr,
              flush=True)
    return engine


def plan_memory(ref: str | None, config: Any, *, kv_auto: bool) -> Any:
    """Prints the memory plan before loading (weights mapped and private, KV cache, expected
    RSS) and returns ``config`` with the KV cache sized by it under ``--kv-memory auto``; a
    model that cannot fit is one error line and exit 1, not an out-of-memory kill."""
    from dataclasses import replace

    from bargein.loader import load_config, resolve_model_ref
    from bargein.loader.memory_plan import plan_memory as plan

    try:
        source = resolve_model_ref(ref)
        memory = plan(source, load_config(source), config, kv_auto=kv_auto)
    except _load_errors() as exc:  # MemoryPlanError is a LoaderError
        raise model_error(exc) from None
    print(f"bargein: {memory.describe()}", file=sys.stderr, flush=True)
    return replace(config, cache=replace(config.cache, memory_bytes=memory.kv_bytes)) if kv_auto else config


def launch_replicas(ref: str | None, config: Any, address: str, num_replicas: int,
                    threads: int | None = None) -> Any:
    """N engine replicas on the Ray cluster (each a pipeline when ``config.pipeline`` is
    set); a node without the model file gets the weights shipped from here.

    ``threads`` (``--threads``): each whole-model replica's compute threads, and the CPUs it
    takes on its node (Ray then puts no more replicas on a node than its CPUs hold); default:
    per node, what the node offers shared among the replicas placed there
    (``bargein.distributed.replicas.slots``). A pipeline replica's stages take theirs from
    ``config.pipeline.threads_per_stage``."""
    from bargein.build import build_replicas
    from bargein.distributed.replicas import ReplicaOptions
    from bargein.loader import resolve_model_ref

    try:
        source = resolve_model_ref(ref)  # fails fast here for a bad reference
    except _load_errors() as exc:
        raise model_error(exc) from None
    stages = f" as pipelines of {config.pipeline.stages} stages" if config.pipeline else ""
    print(f"bargein: starting {num_replicas} replicas of {source.name}{stages} on Ray", file=sys.stderr, flush=True)
    if config.pipeline is None:
        what = (f"{threads} compute threads per replica (--threads)" if threads else
                "compute threads per replica: what its node offers, shared among the replicas there "
                "(default; --threads N to set)")
        print(f"bargein: {what}", file=sys.stderr, flush=True)
    options = ReplicaOptions(threads=threads, num_cpus=threads or 1)
    started = time.perf_counter()
    replicas = build_replicas(str(source.path) if ref is None or not str(ref).startswith("~") else str(ref),
                              config, address, num_replicas, options)
    print(f"bargein: {num_replicas} replicas ready in {time.perf_counter() - started:.1f} s", file=sys.stderr,
          flush=True)
    return replicas
