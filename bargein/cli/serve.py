"""``bargein serve``: the OpenAI-compatible server and the web chat, over one engine, a
pipeline of stages or engine replicas on Ray.

Exit statuses: 0 after a clean shutdown; 1 a model that does not load, a busy port, a
set-up that cannot run here (no Ray, a bad layer split); 2 a bad flag or variable, or a
model that is not there.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from typing import Any

from bargein.cli.common import Command, add_precision_argument, add_weights_memory_argument
from bargein.cli.errors import EXIT_FAILURE, EXIT_SETUP, EXIT_USAGE, CliError
from bargein.cli.threads import add_threads_argument, apply_threads

# The step time target's default, from issue 34's sweep (bench/step_budget_sim.py, the
# bundled model's step costs on 2 cores; bench/bench_step_budget.py on the engine): 8
# streams decoding and a 2,000-token prompt every 3 s. With running prompts read oldest
# first, 250 ms reads ~90% of the prompt tokens that no target reads (one real run on a
# shared machine: 73%) at ~250 ms a token for the streams (no target: p99 over 2 s). 100
# ms halves that (~83%; real: 61%), but on a loaded 2-core machine its steps overshoot by
# the chunks every prompt is owed, and the tenants soak's token gaps then missed its bound
# of two targets (p99 241 ms against 200; with 250: 386 against 500), so 250 stays.
DEFAULT_MAX_STEP_MS = 250.0


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    from bargein.server.settings import LIMIT_FLAGS, EnvReader, ServerSettings, SettingsError

    try:
        env_settings = ServerSettings.from_env()
        env = EnvReader(os.environ)
        model = env.str("MODEL", None)
        kv_memory = env.str("KV_MEMORY", "512MiB")
        kv_tokens = env.int("KV_TOKENS", None)
        kv_disk = env.str("KV_DISK", None)
        kv_disk_size = env.str("KV_DISK_SIZE", "20GiB")
        env.size("KV_DISK_SIZE", None)  # a bad value is refused here, naming the variable
        max_model_len = env.int("MAX_MODEL_LEN", None)
        max_num_seqs = env.int("MAX_NUM_SEQS", 64)
        max_batched = env.int("MAX_NUM_BATCHED_TOKENS", 512)
        max_mixed_prefill = env.int("MAX_MIXED_PREFILL_TOKENS", None)
        max_step_ms = env.float("MAX_STEP_MS", DEFAULT_MAX_STEP_MS)
        device = env.str("DEVICE", "auto")
        api_key_file = env.str("API_KEY_FILE", None)
        api_keys_file = env.str("API_KEYS", None)
        dtype = env.str("DTYPE", "auto")
        speculative = env.str("SPECULATIVE", None)
        draft_model = env.str("DRAFT_MODEL", None)
    except SettingsError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    s = env_settings
    p.add_argument("--model", default=model, metavar="REF",
                   help="a .gguf file or a Hugging Face folder (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--host", default=s.host, help="address to listen on (default: %(default)s, loopback only)")
    p.add_argument("--port", type=int, default=s.port, help="port (default: %(default)s; 0 picks a free one)")
    access = p.add_argument_group("access (keys, tenants, hosts)")
    access.add_argument("--api-key", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every path but /health "
                             "and the chat page's files, which asks for the key; visible in ps: prefer "
                             "$BARGEIN_API_KEY or --api-key-file")
    access.add_argument("--api-key-file", default=api_key_file, metavar="FILE",
                        help="as --api-key, the key read from FILE's first line ($BARGEIN_API_KEY_FILE)")
    access.add_argument("--api-keys", default=api_keys_file, metavar="FILE",
                        help="tenants: one 'KEY [NAME]' per line; each tenant sees and cancels only its own "
                             "requests and stored responses, and has its own prefix cache ($BARGEIN_API_KEYS)")
    access.add_argument("--shared-prefix-cache", action="store_true", default=s.shared_prefix_cache,
                        help="let every tenant reuse every other's cached prompt tokens (one user with many "
                             "keys); by default a tenant cannot probe another's prompts through cached_tokens")
    access.add_argument("--max-in-flight-per-tenant", type=int, default=s.max_in_flight_per_tenant, metavar="N",
                        help="hand at most N of one tenant's requests to the engine at once; the next ones wait "
                             "in the tenant's own queue (default: no limit)")
    access.add_argument("--max-queued-per-tenant", type=int, default=s.max_queued_per_tenant, metavar="N",
                        help="with --max-in-flight-per-tenant: at most N of a tenant's requests wait; more get 429 "
                             "naming the limit (default: only --max-queue bounds them)")
    access.add_argument("--operator-tenants", default=None, metavar="NAME,...",
                        help="tenants whose keys read every tenant's series in /metrics (a scraper's key); "
                             "others read their own")
    access.add_argument("--max-tenant-series", type=int, default=s.max_tenant_series, metavar="N",
                        help="tenants with their own /metrics series (by name); the rest share '_other' "
                             "(default: %(default)s)")
    access.add_argument("--allowed-hosts", default=None, metavar="NAME,...",
                        help="Host header names the server answers to, '*' for any (default: localhost, "
                             "127.0.0.1, ::1 and the --host address; others get 403, which stops DNS "
                             "rebinding from a web page)")
    p.set_defaults(env_api_key=s.api_key, env_allowed_hosts=s.allowed_hosts)
    p.add_argument("--request-timeout", type=float, default=s.request_timeout, metavar="S",
                   help="cancel any request after S seconds (reason: deadline)")
    p.add_argument("--max-queue", type=int, default=s.max_queue, metavar="N",
                   help="answer 429 when N requests are already in flight")
    p.add_argument("--kv-memory", default=None, metavar="SIZE",
                   help=f"memory for the KV cache, e.g. 512MiB or 2GB, or auto: what the machine has available "
                        f"beside the weights, the runtime and a 10%% margin (default: {kv_memory})")
    p.add_argument("--kv-tokens", type=int, default=kv_tokens, metavar="N",
                   help="size the KV cache by tokens instead: N token slots over all sequences, rounded up to "
                        "whole blocks of 16 (wins over $BARGEIN_KV_MEMORY; with --kv-memory it is an error)")
    p.set_defaults(kv_memory_default=kv_memory)
    p.add_argument("--kv-disk", default=kv_disk, metavar="DIR",
                   help="keep full KV blocks that leave memory (evicted, or at shutdown) in DIR, so a "
                        "conversation's next turn after a restart reads them back instead of recomputing "
                        "them; files are private (0600), one server and one model per DIR, replicas use "
                        f"DIR/replica-N, pipeline stages DIR/stage-A-B on their nodes (default: {kv_disk or 'off'})")
    p.add_argument("--kv-disk-size", default=None, metavar="SIZE",
                   help=f"most disk the --kv-disk tier takes, least recently used blocks go first, "
                        f"e.g. 20GiB (default: {kv_disk_size})")
    p.set_defaults(kv_disk_size_default=kv_disk_size)
    p.add_argument("--max-model-len", type=int, default=max_model_len, metavar="N",
                   help="context length (default: the model's)")
    p.add_argument("--sliding-window", type=int, default=None, metavar="N",
                   help="the model's sliding window: N positions for its local layers, and for every layer of a "
                        "file that marks none (a Mistral GGUF, whose window llama.cpp's converter drops); 0 for "
                        "none (default: the file's)")
    p.add_argument("--max-num-seqs", type=int, default=max_num_seqs, metavar="N",
                   help="sequences in one batch (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=max_batched, metavar="N",
                   help="tokens in one step; long prompts are computed in chunks of this size (default: %(default)s)")
    p.add_argument("--max-mixed-prefill-tokens", type=int, default=max_mixed_prefill, metavar="N",
                   help="prompt tokens a step may carry beside running streams' decodes; smaller keeps their "
                        "inter-token latency near one decode step where a step's time grows with its tokens "
                        "(a CPU), larger gets new prompts their first token sooner (default: up to "
                        "--max-num-batched-tokens)")
    p.add_argument("--max-step-ms", type=float, default=max_step_ms, metavar="MS",
                   help="a time target for one step: prompt chunks are sized from measured step times, and "
                        "every waiting request gets its first chunk into the next step, so a short request "
                        "behind a long prompt answers within about two targets and a cancel lands within "
                        "about one; 0 bounds steps by tokens alone (default: %(default)s)")
    p.add_argument("--device", default=device, metavar="DEVICE",
                   help="auto (CUDA where available, else the CPU), cpu, cuda or cuda:N (default: %(default)s)")
    p.add_argument("--dtype", default=dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV cache: auto is bfloat16 on CUDA, float32 on the CPU (default: %(default)s)")
    add_precision_argument(p)
    add_weights_memory_argument(p)
    p.add_argument("--speculative", default=speculative, choices=["off", "ngram", "draft"],
                   help="speculative decoding, which never changes an answer: ngram guesses the next tokens "
                        "from the prompt and the answer so far (editing, quoting), draft from --draft-model; "
                        "a request opts out with \"speculative\": false (default: off, or draft with "
                        "--draft-model)")
    p.add_argument("--draft-model", default=draft_model, metavar="REF",
                   help="a small model with the model's tokenizer (.gguf or HF folder) for --speculative draft")
    p.add_argument("--speculative-tokens", type=int, default=None, metavar="N",
                   help="most guesses verified per step; fewer while guesses miss (default: 6)")
    p.add_argument("--max-body", default=str(s.max_body_bytes), metavar="SIZE",
                   help="largest request body, e.g. 4MiB (default: %(default)s bytes)")
    p.add_argument("--default-max-tokens", type=int, default=s.default_max_tokens, metavar="N",
                   help="max tokens for chat and responses requests that give none (default: unset, to the "
                        "end of the context)")
    p.add_argument("--max-tokens-limit", type=int, default=s.max_tokens_limit, metavar="N",
                   help="refuse requests asking for more than N tokens, and cap the defaults at N (default: unset)")
    p.add_argument("--shutdown-timeout", type=float, default=s.shutdown_timeout, metavar="S",
                   help="seconds to answer in-flight requests on Ctrl-C / SIGTERM (default: %(default)s)")
    p.add_argument("--log-level", default=s.log_level, choices=["critical", "error", "warning", "info", "debug"],
                   help="(default: %(default)s)")
    p.add_argument("--debug-endpoints", action="store_true", default=s.debug_endpoints,
                   help="serve /debug/kv (KV block accounting; for tests)")
    p.add_argument("--header-timeout", type=float, default=s.header_timeout, metavar="S",
                   help="408 when a request's headers take longer (default: %(default)s)")
    p.add_argument("--body-timeout", type=float, default=s.body_timeout, metavar="S",
                   help="408 when a request's body takes longer after its headers (default: %(default)s)")
    p.add_argument("--sse-keepalive", type=float, default=s.sse_keepalive_s, metavar="S",
                   help="a stream quiet for S seconds (a long prefill) sends an SSE comment with the prompt's "
                        "progress, so proxies and clients do not time out; 0: never (default: %(default)s)")
    p.add_argument("--reasoning-format", default=s.reasoning_format, choices=["none", "separate"],
                   help="a thinking model's thoughts: 'separate' returns them apart (reasoning_content, "
                        "thinking blocks), 'none' leaves them in the answer's text (default: %(default)s)")
    for name, what in LIMIT_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(s, name), metavar="N",
                       help=f"most {what}; more is a 400 (default: %(default)s)")
    add_threads_argument(p)  # on a pipeline: each stage's threads (and the CPUs it takes on its node)
    cluster = p.add_argument_group("several machines (needs bargein[ray])")
    cluster.add_argument("--ray", nargs="?", const="auto", default=None, metavar="auto|ADDRESS|local",
                         help="split the model into pipeline stages on a Ray cluster: auto (this machine's "
                              "cluster), HOST:6379, or local (start Ray here)")
    cluster.add_argument("--pipeline-stages", type=int, default=None, metavar="N",
                         help="stages, one per node by memory (default: 2)")
    cluster.add_argument("--replicas", type=int, default=None, metavar="N",
                         help="run N whole-model engine replicas on the Ray cluster behind this server "
                              "(conversations stay on the replica that holds their cache) instead of "
                              "pipeline stages")
    cluster.add_argument("--stage-layers", default=None, metavar="0-10,10-20",
                         help="layer range of each stage (default: split by each node's memory)")
    cluster.add_argument("--micro-batches", type=int, default=None, metavar="N",
                         help="plans in flight at once (default: one per stage)")
    cluster.add_argument("--pipeline-transport", choices=("auto", "graph", "calls"), default="auto",
                         help="how plans and hidden states move between stages: a Ray compiled graph (stages "
                              "on this node only), actor calls, or auto: the graph where every stage runs on "
                              "this node with cores to spare (default: %(default)s)")
    cluster.add_argument("--stage-recovery-timeout", type=float, default=30.0, metavar="S",
                         help="how long a lost stage may take to be re-created before its requests fail "
                              "(default: %(default)s)")
    cluster.add_argument("--stage-resource", default=None, metavar="NAME",
                         help="run stages only on nodes offering this Ray resource "
                              "(ray start --resources='{\"NAME\": 1}')")


@dataclass(frozen=True)
class _Ready:
    """A server ready to run: the app, its settings, the bound socket, the serving line."""

    app: Any
    settings: Any
    sock: socket.socket
    announce: Callable[[], None]


def _run_serve(args: argparse.Namespace) -> int:
    from bargein.startup import collection_paused, settle_heap

    with collection_paused():
        ready = _start_serving(args)
        settle_heap()
    from bargein.server.serve import run_server

    run_server(ready.app, ready.settings, ready.sock, on_started=ready.announce)
    return 0


def _start_serving(args: argparse.Namespace) -> _Ready:
    """Everything before the server runs: settings, the socket, the engine, the app; a
    CliError for what cannot start.

    A local model loads while a thread of its own imports the server (FastAPI, pydantic,
    uvicorn: ~0.3 s): reading the weights and most of building the model run outside the
    GIL. The load stays on this thread, where a Ctrl-C interrupts it (on a daemon thread it
    could not be, and the exit met torch mid-operation: "terminate called"); the import
    thread is pure Python. The app is made, and the serving line printed, only once both
    are done. Ray set-ups load in order."""
    from bargein.cli.model import launch_replicas, load_engine, plan_memory
    from bargein.config import CacheConfig, EngineConfig, PipelineConfig, SchedulerConfig
    from bargein.distributed.errors import PipelineSetupError
    from bargein.distributed.split import parse_stage_layers
    from bargein.engine.device import resolve_device
    from bargein.server.settings import LIMIT_FLAGS, ServerSettings, SettingsError, parse_size

    try:
        env = ServerSettings.from_env()  # the settings that have no flag come from the environment only
        settings = ServerSettings(
            tokenizer_threads=env.tokenizer_threads, continuation_memory_entries=env.continuation_memory_entries,
            continuation_memory_tokens=env.continuation_memory_tokens, stream_buffer_tokens=env.stream_buffer_tokens,
            stream_stall_timeout=env.stream_stall_timeout,
            background_max_output_tokens=env.background_max_output_tokens,
            host=args.host, port=args.port, **_access_settings(args), request_timeout=args.request_timeout,
            max_queue=args.max_queue, max_body_bytes=parse_size(args.max_body), debug_endpoints=args.debug_endpoints,
            shutdown_timeout=args.shutdown_timeout, log_level=args.log_level,
            default_max_tokens=args.default_max_tokens, max_tokens_limit=args.max_tokens_limit,
            header_timeout=args.header_timeout, body_timeout=args.body_timeout,
            reasoning_format=args.reasoning_format, sse_keepalive_s=args.sse_keepalive,
            **{name: getattr(args, name) for name in LIMIT_FLAGS})
        if args.max_step_ms is not None and args.max_step_ms < 0:
            raise SettingsError(f"--max-step-ms must be 0 (no time target) or more, got {args.max_step_ms}")
        if args.max_model_len is not None and args.max_model_len < 2:
            raise SettingsError(f"--max-model-len must be at least 2, got {args.max_model_len}")
        if args.kv_memory is not None and args.kv_tokens is not None:
            raise SettingsError("--kv-memory and --kv-tokens both size the KV cache; give one of them")
        pipeline = None if args.ray is None or (args.replicas is not None and args.pipeline_stages is None
                                                 and args.stage_layers is None) else PipelineConfig(
            stages=args.pipeline_stages or 2, ray_address=args.ray, micro_batches=args.micro_batches,
            stage_layers=None if args.stage_layers is None else parse_stage_layers(args.stage_layers),
            recovery_timeout_s=args.stage_recovery_timeout, node_resource=args.stage_resource,
            transport=args.pipeline_transport,  # no --threads: per node (a replica's stages: 1)
            threads_per_stage=(args.threads or 1) if args.replicas is not None else args.threads)
        kv_auto = (args.kv_memory or args.kv_memory_default) == "auto" and args.kv_tokens is None
        config = EngineConfig(
            cache=CacheConfig(memory_bytes=0 if kv_auto else parse_size(args.kv_memory or args.kv_memory_default),
                              kv_tokens=args.kv_tokens, **_kv_disk(args, pipeline is not None)),
            scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                      max_mixed_prefill_tokens=args.max_mixed_prefill_tokens,
                                      max_step_ms=args.max_step_ms or None),
            max_model_len=args.max_model_len, device=args.device, dtype=args.dtype, precision=args.precision,
            pipeline=pipeline, sliding_window=args.sliding_window, weights_memory=args.weights_memory,
            speculative=_speculative(args, pipeline is not None))
        _check_replica_flags(args)
        if kv_auto and (args.replicas is not None or config.pipeline is not None):
            raise SettingsError("--kv-memory auto sizes one process's KV cache; give a size for pipeline stages "
                                "or replicas")
        if config.pipeline is None and args.replicas is None:  # the stages/replicas resolve it on their nodes
            resolve_device(config.device)  # before the port and the model: a missing GPU fails fast
            apply_threads(args)
    except PipelineSetupError as exc:
        raise CliError(str(exc), EXIT_SETUP) from None
    except ValueError as exc:  # SettingsError and the configs' own checks
        raise CliError(str(exc), EXIT_USAGE) from None

    from bargein.server.listen import bind_socket

    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as exc:
        raise CliError(f"cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}",
                       EXIT_FAILURE) from None
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.replicas is not None:
            engine = launch_replicas(args.model, config, args.ray, args.replicas, args.threads)
        elif config.pipeline is not None:
            engine = load_engine(args.model, config, report=True)
        else:
            from bargein.startup import InBackground

            config = plan_memory(args.model, config, kv_auto=kv_auto)

            import_module("bargein.engine.engine")  # before the thread: loading then imports next to nothing
            importing = InBackground(lambda: import_module("bargein.server.serve"), "bargein-import")
            engine = load_engine(args.model, config, report=True)
            importing.result()
    except PipelineSetupError as exc:  # nothing was left started: the runner cleans up after itself
        raise CliError(str(exc), EXIT_SETUP) from None

    from bargein.engine.async_engine import AsyncEngine
    from bargein.server import create_app

    port = sock.getsockname()[1]
    url = ServerSettings(host=settings.host, port=port).base_url

    def announce() -> None:
        print(f"bargein: serving {engine.model_name} at {url} (chat UI at {url}/)", flush=True)

    app = create_app(engine if args.replicas is not None else AsyncEngine(engine), settings)
    return _Ready(app, settings, sock, announce)


def _speculative(args: argparse.Namespace, pipeline: bool) -> Any:
    """SpeculativeConfig from --speculative, --draft-model and --speculative-tokens."""
    from bargein.config import SpeculativeConfig
    from bargein.server.settings import SettingsError

    method = args.speculative or ("draft" if args.draft_model else "off")
    if method != "off" and pipeline:
        raise SettingsError("--speculative runs with the model in one process, not on pipeline stages")
    if args.draft_model and method != "draft":
        raise SettingsError(f"--draft-model is for --speculative draft, not {method}")
    tokens = {} if args.speculative_tokens is None else {"max_draft_tokens": args.speculative_tokens}
    return SpeculativeConfig(method=method, draft_model=args.draft_model, **tokens)


def _access_settings(args: argparse.Namespace) -> dict[str, Any]:
    """ServerSettings' key, tenant and host fields from the flags (a flag wins over its variable)."""
    from bargein.server.auth import allowed_host_names
    from bargein.server.settings import SettingsError
    from bargein.server.tenants import KeyFileError, read_key_file

    given = [name for name, value in (("--api-key", args.api_key), ("--api-key-file", args.api_key_file))
             if value is not None]
    if len(given) > 1:
        raise SettingsError("--api-key and --api-key-file both give the one key: use one of them")
    if args.api_key is not None:
        print("bargein: warning: --api-key shows the key to every user of this machine (ps); "
              "use $BARGEIN_API_KEY or --api-key-file", file=sys.stderr, flush=True)
    try:
        key = args.api_key or args.env_api_key
        if args.api_key_file is not None:
            key = read_key_file(args.api_key_file, named=False)[0].key
        keys = () if args.api_keys is None else read_key_file(args.api_keys, named=True)
    except KeyFileError as exc:
        raise SettingsError(str(exc)) from None
    hosts = (args.env_allowed_hosts or ()) if args.allowed_hosts is None else args.allowed_hosts.split(",")
    return {"api_key": key or None, "api_keys": keys, "shared_prefix_cache": args.shared_prefix_cache,
            "max_in_flight_per_tenant": args.max_in_flight_per_tenant,
            "max_queued_per_tenant": args.max_queued_per_tenant, "max_tenant_series": args.max_tenant_series,
            "operator_tenants": tuple(t.strip() for t in (args.operator_tenants or "").split(",") if t.strip()),
            "allowed_hosts": allowed_host_names(hosts, args.host)}


def _kv_disk(args: argparse.Namespace, pipeline: bool) -> dict[str, Any]:
    """CacheConfig's disk tier fields from --kv-disk/--kv-disk-size (or $BARGEIN_KV_DISK and
    $BARGEIN_KV_DISK_SIZE). The directory is checked here unless the tier lives elsewhere:
    replicas and pipeline stages make theirs (DIR/replica-N, DIR/stage-A-B) on their own nodes."""
    from bargein.server.settings import SettingsError, parse_size

    if args.kv_disk is None:
        if args.kv_disk_size is not None:
            raise SettingsError("--kv-disk-size sizes the disk tier: give --kv-disk DIR too")
        return {}
    size = parse_size(args.kv_disk_size or args.kv_disk_size_default)
    directory = os.path.abspath(os.path.expanduser(args.kv_disk))
    if args.replicas is None and not pipeline:
        _usable_directory(directory)
    return {"kv_disk_dir": directory, "kv_disk_bytes": size}


def _usable_directory(directory: str) -> None:
    """Makes the tier's directory (0700) before the model loads, or says in one line why it
    cannot be used (exit 2), rather than after loading, as a model error or a traceback."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(13, "not writable")
    except OSError as exc:
        raise CliError(f"--kv-disk {directory}: {exc.strerror or exc}", EXIT_USAGE) from None


def _check_replica_flags(args: argparse.Namespace) -> None:
    if args.replicas is None:
        return
    if args.ray is None:
        raise CliError("--replicas needs a Ray cluster: add --ray [auto|ADDRESS|local]", EXIT_SETUP)
    if args.replicas < 1:
        raise CliError(f"--replicas must be at least 1, got {args.replicas}", EXIT_SETUP)
    if args.threads is not None and args.threads < 1:
        raise CliError(f"--threads must be at least 1, got {args.threads}", EXIT_USAGE)


COMMAND = Command("run the OpenAI-compatible server and the web chat", _add_serve_arguments, _run_serve)
