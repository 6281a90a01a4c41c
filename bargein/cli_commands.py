"""The client-side commands of ``bargein``: chat, run, ps, cancel and bench.

Each command is an ``(help, add_arguments, run)`` triple in ``COMMANDS``; ``bargein.cli``
registers them next to ``serve``. A user mistake (a bad flag value, a model that is not
there, a server that is down, an unknown request id) ends with one ``bargein: error: ...``
line on stderr and a non-zero status; these commands report their own errors so that
they do not depend on the exception types of the module that runs them.

Exit statuses: 0 success; 1 a failure at run time (server unreachable, unknown request
id, an answer that failed); 2 a usage error (bad flag value, bad model reference);
130 ``bargein run`` stopped by Ctrl-C (after printing what was produced).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Not bargein.cli_client (httpx) here: building the parser for `--help` must stay cheap;
# the commands that talk to a server import the client when they run.
from bargein.cli_common import ClientError, add_precision_argument, default_api_key, default_url

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
BENCHMARKS = ("model", "engine", "startup")


class CommandError(Exception):
    """A user-fixable problem: printed as one line, exits with ``status``."""

    def __init__(self, message: str, status: int = EXIT_FAILURE):
        super().__init__(message)
        self.status = status


def _one_line_errors(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except (CommandError, ClientError) as exc:
            print(f"bargein: error: {exc}", file=sys.stderr)
            return getattr(exc, "status", EXIT_FAILURE)

    wrapped.__doc__ = run.__doc__
    return wrapped


# -- shared arguments ---------------------------------------------------------------------------
def _add_server_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=default_url(),
                   help="the bargein server; a base URL ending in /v1 is fine (default: $BARGEIN_URL or %(default)s)")
    p.add_argument("--api-key", default=default_api_key(), metavar="KEY",
                   help="the server's API key (default: $BARGEIN_API_KEY)")


def _add_generation_arguments(p: argparse.ArgumentParser, max_tokens: int) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--model", default=os.environ.get("BARGEIN_MODEL"), metavar="REF",
                       help="a .gguf file or a Hugging Face folder, run in this process "
                            "(default: $BARGEIN_MODEL or the bundled SmolLM2-135M-Instruct)")
    where.add_argument("--url", default=None,
                       help="ask a bargein server instead, e.g. http://127.0.0.1:8000 (or .../v1)")
    p.add_argument("--api-key", default=default_api_key(), metavar="KEY",
                   help="the server's API key, with --url (default: $BARGEIN_API_KEY)")
    add_precision_argument(p)
    p.add_argument("--kv-tokens", type=int, default=None, metavar="N",
                   help="with a model run here: its KV cache holds N tokens, rounded up to whole blocks "
                        "(default: as many as 512MiB hold)")
    p.add_argument("--system", default=None, metavar="TEXT", help="a system prompt")
    p.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N",
                   help="tokens per answer at most (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.7, metavar="T",
                   help="0 is greedy; up to 2 (default: %(default)s)")


def _settings(args: argparse.Namespace):
    from bargein import InvalidSamplingParams, SamplingParams
    from bargein.cli_chat import GenerationSettings

    try:  # check here, so that a bad value is a usage error and not a failed answer
        SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    except InvalidSamplingParams as exc:
        raise CommandError(f"--{exc.field.replace('_', '-')}: {exc}", EXIT_USAGE) from None
    return GenerationSettings(max_tokens=args.max_tokens, temperature=args.temperature,
                              json_schema=_json_schema(getattr(args, "json_schema", None)))


def _json_schema(path: str | None) -> str | None:
    """The schema file's JSON text, checked: a usage error names what is wrong with it."""
    if path is None:
        return None
    from bargein.engine.constraint import Constraint
    from bargein.engine.grammar import UnsupportedGrammar, check_constraint

    try:
        text = Path(path).expanduser().read_text()
        check_constraint(Constraint.json_schema(text))
    except (OSError, UnsupportedGrammar) as exc:
        raise CommandError(f"--json-schema {path}: {exc}", EXIT_USAGE) from None
    return text


def _backend(args: argparse.Namespace):
    """The backend chat and run talk to: a server with --url, else an engine loaded here."""
    from bargein.cli_chat import LocalBackend, RemoteBackend

    if args.url:
        from bargein.cli_client import BargeinClient

        client = BargeinClient(args.url, args.api_key)
        return RemoteBackend(client, client.model_name())
    return LocalBackend(_load_async_engine(args.model, args.precision, args.kv_tokens))


def _load_async_engine(ref: str | None, precision: str, kv_tokens: int | None = None):
    from bargein import AsyncEngine, CacheConfig, Engine, EngineConfig
    from bargein.loader import LoaderError

    try:
        config = EngineConfig(cache=CacheConfig(kv_tokens=kv_tokens), precision=precision)
    except ValueError as exc:
        raise CommandError(f"--kv-tokens: {exc}", EXIT_USAGE) from None
    print(f"bargein: loading {ref or 'the bundled SmolLM2-135M-Instruct'}", file=sys.stderr, flush=True)
    try:
        engine = Engine.from_pretrained(ref, config, progress=sys.stderr.isatty())
    except (LoaderError, FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    return AsyncEngine(engine).start()


# -- chat ---------------------------------------------------------------------------------------
def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    _add_generation_arguments(p, max_tokens=512)


@_one_line_errors
def run_chat(args: argparse.Namespace) -> int:
    from bargein.cli_chat import ChatREPL

    settings = _settings(args)
    backend = _backend(args)
    loop = asyncio.new_event_loop()
    try:
        return ChatREPL(backend, settings, args.system, loop).run()
    finally:
        loop.run_until_complete(backend.close())
        loop.close()


# -- run ----------------------------------------------------------------------------------------
def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the message (with --raw: the exact prompt text)")
    _add_generation_arguments(p, max_tokens=256)
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--json-schema", metavar="FILE", default=None,
                   help="a JSON Schema file: the answer is JSON that matches it (constrained token by token)")


@_one_line_errors
def run_run(args: argparse.Namespace) -> int:
    """One answer to stdout; Ctrl-C stops it, keeps what was printed, and exits 130."""
    from bargein.cli_chat import AnswerError, SigintRouter, run_interruptible

    settings = _settings(args)
    backend = _backend(args)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}]

    def on_delta(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    def answer():
        if args.raw:
            return backend.answer_raw(args.prompt, settings, on_delta)
        return backend.answer(messages, settings, on_delta)

    loop = asyncio.new_event_loop()
    sigint = SigintRouter(loop)
    sigint.install()
    try:
        result, stopped = loop.run_until_complete(run_interruptible(answer, backend.cancel, sigint))
        loop.run_until_complete(backend.close())
    finally:
        sigint.uninstall()
        loop.close()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if isinstance(result, AnswerError):
        raise CommandError(str(result))
    if stopped or result is None or result.finish_reason == "cancelled":
        print("[stopped]", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


# -- ps -----------------------------------------------------------------------------------------
def add_ps_arguments(p: argparse.ArgumentParser) -> None:
    _add_server_arguments(p)


@_one_line_errors
def run_ps(args: argparse.Namespace) -> int:
    from bargein.cli_client import BargeinClient

    requests = BargeinClient(args.url, args.api_key).list_requests()
    print(format_requests(requests))
    return 0


def format_requests(requests: list[dict[str, Any]]) -> str:
    """The ``bargein ps`` table: one line per request, oldest first."""
    if not requests:
        return "no requests in flight"
    header = ("ID", "STATUS", "PROMPT", "COMPLETION", "AGE", "DEADLINE")
    rows = [(r["id"], r["status"], _prompt(r), str(r["completion_tokens"]), _seconds(r["age_s"]),
             "-" if r.get("deadline_s") is None else f"in {_seconds(r['deadline_s'])}") for r in requests]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                     for row in (header, *rows))


def _prompt(r: dict[str, Any]) -> str:
    """The prompt's length, and while it is still being read, how far: ``512/2000 (25%)``."""
    total, computed = r["prompt_tokens"], r.get("prompt_computed", r["prompt_tokens"])
    if computed >= total:
        return str(total)
    return f"{computed}/{total} ({100 * computed // max(total, 1)}%)"


def _seconds(value: float) -> str:
    if value < 60:
        return f"{value:.1f}s"
    minutes, seconds = divmod(int(value), 60)
    return f"{minutes}m{seconds:02d}s"


# -- cancel -------------------------------------------------------------------------------------
def add_cancel_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ids", nargs="*", metavar="ID", help="request ids, as `bargein ps` lists them")
    p.add_argument("--all", action="store_true", help="cancel every request in flight")
    _add_server_arguments(p)


@_one_line_errors
def run_cancel(args: argparse.Namespace) -> int:
    """Cancels requests by id (or all); exit 1 if any id is unknown, after trying the others."""
    if bool(args.ids) == args.all:
        raise CommandError("give request ids or --all (not both)", EXIT_USAGE)
    from bargein.cli_client import BargeinClient

    client = BargeinClient(args.url, args.api_key)
    if args.all:
        cancelled = client.cancel_all()
        print(f"cancelled {len(cancelled)} request(s)" + (f": {' '.join(cancelled)}" if cancelled else ""))
        return 0
    status = 0
    for request_id in args.ids:
        try:
            result = client.cancel(request_id)
        except ClientError as exc:
            print(f"bargein: error: {exc}", file=sys.stderr)
            status = EXIT_FAILURE
            continue
        print(f"{request_id}: {result.replace('_', ' ')}")
    return status


# -- bench --------------------------------------------------------------------------------------
def bench_dir() -> Path:
    """bench/ of the source tree this package runs from (an installed wheel has none)."""
    return Path(__file__).resolve().parents[1] / "bench"


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a smoke run of each benchmark (about a minute each)")
    p.add_argument("--only", choices=BENCHMARKS, action="append", help="run only this benchmark (repeatable)")
    p.add_argument("--model", default=None, metavar="REF", help="model reference (default: the bundled SmolLM2)")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="torch intra-op threads")
    p.add_argument("--json-dir", default=None, metavar="DIR", help="also write each result as DIR/bench_NAME.json")


@_one_line_errors
def run_bench(args: argparse.Namespace) -> int:
    """Runs bench/bench_model.py, bench_engine.py and bench_startup.py in turn; each prints its own table."""
    folder = bench_dir()
    names = args.only or list(BENCHMARKS)
    paths = {name: folder / f"bench_{name}.py" for name in names}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise CommandError(f"the benchmarks are not here ({', '.join(missing)}); `bargein bench` runs "
                           "from a source checkout of bargein, not from an installed package")
    argv = ["--quick"] if args.quick else []
    if args.model:
        argv += ["--model", args.model]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    for name, path in paths.items():
        extra = ["--json", str(Path(args.json_dir) / f"bench_{name}.json")] if args.json_dir else []
        started = time.perf_counter()
        print(f"bargein bench: {name} ({path})", flush=True)
        try:
            _load_benchmark(name, path).main(argv + extra)
        except SystemExit as exc:  # the benchmark's own argparse refused an argument
            if exc.code not in (0, None):
                raise CommandError(f"benchmark {name} refused its arguments", EXIT_USAGE) from None
        print(f"bargein bench: {name} took {time.perf_counter() - started:.0f} s", flush=True)
    return 0


def _load_benchmark(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"bargein_bench_{name}", path)
    if spec is None or spec.loader is None:
        raise CommandError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "main", None)):
        raise CommandError(f"{path} has no main(argv)")
    return module


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "chat": ("chat in the terminal; Ctrl-C stops an answer and the next message continues it",
             add_chat_arguments, run_chat),
    "run": ("answer one prompt, streamed to stdout", add_run_arguments, run_run),
    "ps": ("list a server's requests", add_ps_arguments, run_ps),
    "cancel": ("cancel a server's requests by id, or all of them", add_cancel_arguments, run_cancel),
    "bench": ("run the benchmarks of bench/ and print their tables", add_bench_arguments, run_bench),
}
