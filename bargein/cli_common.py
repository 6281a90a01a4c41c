"""What the client commands share without importing an HTTP library: defaults, URLs, errors.

``bargein ps --help`` builds every command's arguments, so this module (and not
``bargein.cli_client``, which imports httpx) is what argument parsing needs; the client
itself is imported only when a command talks to a server.
"""

from __future__ import annotations

import argparse
import os

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


def server_root(url: str) -> str:
    """The server's root URL from what a user may paste: trailing slashes and a trailing
    ``/v1`` (the base URL OpenAI clients want) are dropped, since the client adds ``/v1/...``."""
    root = url.strip().rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")].rstrip("/")
    return root


class ClientError(Exception):
    """A failure talking to the server, as one line a user can act on."""
