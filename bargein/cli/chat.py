"""``bargein chat``: a terminal chat where Ctrl-C stops an answer and the next message continues it.

The REPL is :mod:`bargein.cli.repl`, imported when the command runs (building the parser
for ``--help`` stays cheap).
"""

from __future__ import annotations

import argparse
import asyncio

from bargein.cli.common import Command
from bargein.cli.errors import EXIT_USAGE, CliError
from bargein.cli.generate import add_generation_arguments, backend, generation_settings
from bargein.cli.threads import add_threads_argument, apply_threads


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    add_generation_arguments(p, max_tokens=512)
    add_threads_argument(p)  # a model run here (not with --url)


def run_chat(args: argparse.Namespace) -> int:
    from bargein.cli.repl import ChatREPL

    settings = generation_settings(args)
    if not args.url:
        try:
            apply_threads(args)
        except ValueError as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
    answering = backend(args)
    loop = asyncio.new_event_loop()
    try:
        return ChatREPL(answering, settings, args.system, loop).run()
    finally:
        loop.run_until_complete(answering.close())
        loop.close()


COMMAND = Command("chat in the terminal; Ctrl-C stops an answer and the next message continues it",
                  add_chat_arguments, run_chat)
