"""What the commands share without importing an HTTP library or torch: defaults, URLs, flags.

``bargein ps --help`` builds every command's arguments, so this module (and not
``bargein.cli.client``, which imports httpx) is what argument parsing needs; the client
itself is imported only when a command talks to a server.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_URL = "http://127.0.0.1:8000"


def default_url() -> str:
    return os.environ.get("BARGEIN_URL") or DEFAULT_URL


def default_api_key() -> str | None:
    return os.environ.get("BARGEIN_API_KEY") or None


def add_precision_argument(p: argparse.ArgumentParser) -> None:
    """``--precision exact|fast`` (default: the engine's)."""
    from bargein.config import PRECISIONS, EngineConfig

    p.add_argument("--precision", default=EngineConfig.precision, choices=PRECISIONS,
                   help="exact: float32 with float32 K/V, the reference's numbers; fast: int8 activations on the "
                        "4-/8-bit weights and float16 K/V, every token's result independent of the batch "
                        "(CPU with a C compiler; otherwise exact) (default: %(default)s)")


def add_weights_memory_argument(p: argparse.ArgumentParser) -> None:
    """``--weights-memory auto|private|mapped`` (default: the engine's)."""
    from bargein.config import WEIGHTS_MEMORY, EngineConfig

    p.add_argument("--weights-memory", default=EngineConfig.weights_memory, choices=WEIGHTS_MEMORY,
                   help="auto: the weights the kernels read in place stay the file's pages where the page cache "
                        "holds them on 2 MB pages (read again from the file onto such pages in the background "
                        "where the system gives them), else as private; "
                        "private: they become this process's own memory, copied "
                        "by a background thread while the model already serves from the file, on 2 MB pages where "
                        "the system gives them quickly (one stream decodes up to ~1.2x faster); mapped: they stay the file's "
                        "pages, shared in the page cache with every process serving the same file; an MoE's "
                        "experts stay mapped either way, resident as tokens route to them (default: %(default)s)")


def server_root(url: str) -> str:
    """The server's root URL from what a user may paste: trailing slashes and a trailing
    ``/v1`` (the base URL OpenAI clients want) are dropped, since the client adds ``/v1/...``."""
    root = url.strip().rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")].rstrip("/")
    return root


def add_server_arguments(p: argparse.ArgumentParser, url_help: str = "the bargein server; a base URL ending in /v1 is "
                         "fine (default: $BARGEIN_URL or %(default)s)") -> None:
    """``--url`` and ``--api-key`` of the commands that only talk to a server."""
    p.add_argument("--url", default=default_url(), help=url_help)
    p.add_argument("--api-key", default=default_api_key(), metavar="KEY",
                   help="the server's API key (default: $BARGEIN_API_KEY)")


@dataclass(frozen=True)
class Command:
    """One ``bargein`` subcommand: its help line, what adds its arguments, what runs it
    (returning the exit status or raising :class:`~bargein.cli.errors.CliError`)."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
