"""``bargein ps`` and ``bargein cancel``: a server's requests, listed and cancelled by id.

Exit statuses: 0 success; 1 a server that cannot be reached or an unknown request id
(``cancel`` tries the other ids first); 2 neither ids nor ``--all``, or both.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from bargein.cli.common import Command, add_server_arguments
from bargein.cli.errors import EXIT_FAILURE, EXIT_USAGE, ClientError, CliError


# -- ps -----------------------------------------------------------------------------------------
def add_ps_arguments(p: argparse.ArgumentParser) -> None:
    add_server_arguments(p)


def run_ps(args: argparse.Namespace) -> int:
    from bargein.cli.client import BargeinClient

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
    add_server_arguments(p)


def run_cancel(args: argparse.Namespace) -> int:
    """Cancels requests by id (or all); exit 1 if any id is unknown, after trying the others."""
    if bool(args.ids) == args.all:
        raise CliError("give request ids or --all (not both)", EXIT_USAGE)
    from bargein.cli.client import BargeinClient

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



COMMANDS = {
    "ps": Command("list a server's requests", add_ps_arguments, run_ps),
    "cancel": Command("cancel a server's requests by id, or all of them", add_cancel_arguments, run_cancel),
}
