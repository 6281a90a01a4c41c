"""What ``bargein chat`` and ``bargein run`` share: their generation flags, the checked
settings, and the backend that answers (a server with ``--url``, else a model loaded here)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

# Not bargein.cli.client (httpx) here: building the parser for `--help` must stay cheap;
# the commands that talk to a server import the client when they run.
from bargein.cli.common import add_precision_argument, default_api_key
from bargein.cli.errors import EXIT_USAGE, CliError


def add_generation_arguments(p: argparse.ArgumentParser, max_tokens: int) -> None:
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


def generation_settings(args: argparse.Namespace, json_schema: str | None = None):
    """The checked GenerationSettings of the flags: a bad value is a usage error, not a failed answer."""
    from bargein import InvalidSamplingParams, SamplingParams
    from bargein.cli.backends import GenerationSettings

    try:
        SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    except InvalidSamplingParams as exc:
        raise CliError(f"--{exc.field.replace('_', '-')}: {exc}", EXIT_USAGE) from None
    return GenerationSettings(max_tokens=args.max_tokens, temperature=args.temperature,
                              json_schema=read_json_schema(json_schema))


def read_json_schema(path: str | None) -> str | None:
    """The schema file's JSON text, checked: a usage error names what is wrong with it."""
    if path is None:
        return None
    from bargein.engine.constraint import Constraint
    from bargein.engine.grammar import UnsupportedGrammar, check_constraint

    try:
        text = Path(path).expanduser().read_text()
        check_constraint(Constraint.json_schema(text))
    except (OSError, UnsupportedGrammar) as exc:
        raise CliError(f"--json-schema {path}: {exc}", EXIT_USAGE) from None
    return text


def backend(args: argparse.Namespace) -> Any:
    """The backend chat and run talk to: a server with --url, else an engine loaded here."""
    from bargein.cli.backends import LocalBackend, RemoteBackend

    if args.url:
        from bargein.cli.client import BargeinClient

        client = BargeinClient(args.url, args.api_key)
        return RemoteBackend(client, client.model_name())
    return LocalBackend(_local_client(args.model, args.precision, args.kv_tokens))


def _local_client(ref: str | None, precision: str, kv_tokens: int | None = None) -> Any:
    from bargein import AsyncEngine, CacheConfig, EngineConfig
    from bargein.cli.model import load_engine

    try:
        config = EngineConfig(cache=CacheConfig(kv_tokens=kv_tokens), precision=precision)
    except ValueError as exc:
        raise CliError(f"--kv-tokens: {exc}", EXIT_USAGE) from None
    return AsyncEngine(load_engine(ref, config)).start()
