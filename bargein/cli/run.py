"""``bargein run PROMPT``: one answer streamed to stdout; Ctrl-C stops it and exits 130."""

from __future__ import annotations

import argparse
import asyncio
import sys

from bargein.cli.common import Command
from bargein.cli.errors import EXIT_INTERRUPTED, EXIT_USAGE, CliError
from bargein.cli.generate import add_generation_arguments, backend, generation_settings
from bargein.cli.threads import add_threads_argument, apply_threads


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the message (with --raw: the exact prompt text)")
    add_generation_arguments(p, max_tokens=256)
    add_threads_argument(p)  # a model run here (not with --url)
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--json-schema", metavar="FILE", default=None,
                   help="a JSON Schema file: the answer is JSON that matches it (constrained token by token)")


def run_run(args: argparse.Namespace) -> int:
    """One answer to stdout; Ctrl-C stops it, keeps what was printed, and exits 130."""
    from bargein.cli.backends import AnswerError
    from bargein.cli.interrupt import SigintRouter, run_interruptible

    settings = generation_settings(args, args.json_schema)
    if not args.url:
        try:
            apply_threads(args)
        except ValueError as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
    answering = backend(args)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}]

    def on_delta(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    def answer():
        if args.raw:
            return answering.answer_raw(args.prompt, settings, on_delta)
        return answering.answer(messages, settings, on_delta)

    loop = asyncio.new_event_loop()
    sigint = SigintRouter(loop)
    sigint.install()
    try:
        result, stopped = loop.run_until_complete(run_interruptible(answer, answering.cancel, sigint))
        loop.run_until_complete(answering.close())
    finally:
        sigint.uninstall()
        loop.close()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if isinstance(result, AnswerError):
        raise CliError(str(result))
    if stopped or result is None or result.finish_reason == "cancelled":
        print("[stopped]", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


COMMAND = Command("answer one prompt, streamed to stdout", add_run_arguments, run_run)
