"""The ``bargein`` command: its parser, the registry of subcommands, and the one place
where a :class:`~bargein.cli.errors.CliError` becomes one ``bargein: error: ...`` line
and its exit status.

    bargein serve [--model REF] [--host 127.0.0.1] [--port 8000] [--api-key KEY] ...
    bargein chat [--model REF | --url URL]      bargein run "prompt" [--model REF | --url URL]
    bargein ps [--url URL]    bargein cancel ID... | --all [--url URL]    bargein bench [--quick]
    bargein serve --ray [auto|ADDRESS|local] --pipeline-stages N    bargein cluster [--url URL]
    bargein serve --ray [auto|ADDRESS|local] --replicas N

Each command module adds its own arguments and imports what it runs on when it runs, so
that ``--help`` and the client commands never import torch (nor httpx for ``serve``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from bargein.cli import bench, chat, cluster, requests, run, serve
from bargein.cli.common import Command
from bargein.cli.errors import EXIT_INTERRUPTED, CliError
from bargein.cli.threads import settle_waiting

COMMANDS: dict[str, Command] = {
    "serve": serve.COMMAND,
    "chat": chat.COMMAND,
    "run": run.COMMAND,
    **requests.COMMANDS,
    "bench": bench.COMMAND,
    "cluster": cluster.COMMAND,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bargein", description="An LLM engine where every generation can be "
                                     "stopped at any moment and continued exactly.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(p)
        p.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    settle_waiting()  # before anything loads the OpenMP runtime (see bargein.cli.threads)
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except CliError as exc:
        print(f"bargein: error: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        print("bargein: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
