"""The REPL of ``bargein chat``: a terminal chat where Ctrl-C stops an answer and the next line continues it.

Two backends answer the same REPL (:mod:`bargein.cli.backends`): an engine conversation
in this process, or a server's ``/v1/chat/completions``.

Ctrl-C while an answer streams cancels it (the partial answer stays in the history and a
``[stopped]`` marker is printed); a second Ctrl-C, or a backend that does not stop within
``HARD_STOP_AFTER_S``, abandons the answer at once. Ctrl-C or Ctrl-D at the prompt quits.
SIGINT goes through :class:`SigintRouter` (``loop.add_signal_handler``) from the moment a
line is read until the next prompt, so no press lands as a stray ``KeyboardInterrupt``
half-way into a turn; only ``input()`` sees the default ``KeyboardInterrupt``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TextIO

from bargein.cli.backends import AnswerError, AnswerResult, Backend, GenerationSettings
from bargein.cli.interrupt import SigintRouter, run_interruptible
from bargein.cli.progress import with_progress

STATE_VERSION = 1  # the same version as Conversation.save(), whose readers ignore our extra keys

HELP = """\
Commands:
  /reset         forget the conversation (the system prompt stays)
  /rewind        drop the last exchange (your last message and its answer)
  /system TEXT   set the system prompt (no TEXT: show it)
  /save FILE     write the conversation to FILE (JSON)
  /load FILE     continue a conversation written by /save
  /stats         tokens in the conversation, cached prompt tokens, speed of the last answer
  /help          this list
  /quit          leave (so do Ctrl-D and Ctrl-C at the prompt)
Ctrl-C while an answer streams stops it; the partial answer stays, and your next message
continues the conversation from it."""


class ChatREPL:
    def __init__(self, backend: Backend, settings: GenerationSettings, system: str | None,
                 loop: asyncio.AbstractEventLoop, out: TextIO = sys.stdout, status: TextIO | None = None):
        self.backend = backend
        # Where prompt-reading progress goes: stderr on a terminal, nowhere otherwise.
        self.status = status if status is not None else (sys.stderr if sys.stderr.isatty() else None)
        self.settings = settings
        self.system = system
        self.loop = loop
        self.out = out
        self.messages: list[dict[str, str]] = []  # user and assistant turns; the system prompt apart
        self.last: AnswerResult | None = None
        self.sigint = SigintRouter(loop)

    def history(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def say(self, text: str = "", end: str = "\n") -> None:
        self.out.write(text + end)
        self.out.flush()

    def run(self) -> int:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
        self.say(f"bargein chat: {self.backend.model_name} {self.backend.where}. Ctrl-C stops an answer; "
                 "Ctrl-D or Ctrl-C at the prompt quits; /help lists commands.")
        while True:
            try:
                line = input(">>> ").strip()
                self.sigint.install()  # a press before this line is one at the prompt
            except (EOFError, KeyboardInterrupt):
                self.say()
                return 0
            try:
                if line.startswith("/"):
                    if self.command(line) == "quit":
                        return 0
                elif line:
                    self.turn(line)
            finally:
                self.sigint.uninstall()

    # -- a turn ------------------------------------------------------------------------
    def turn(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})
        printed: list[str] = []
        first_text: list[Callable[[], None]] = []  # erases the progress line

        def on_delta(delta: str) -> None:
            for erase in first_text:
                erase()
            printed.append(delta)
            self.say(delta, end="")

        async def answer(erase: Callable[[], None]) -> AnswerResult:
            first_text.append(erase)
            return await self.backend.answer(self.history(), self.settings, on_delta)

        if self.status is None:
            result, stopped = self.interruptible(lambda: self.backend.answer(self.history(), self.settings, on_delta))
        else:
            result, stopped = self.interruptible(
                lambda: with_progress(answer, self.backend.prompt_progress, self.status))
        if isinstance(result, AnswerError):
            self.say(f"{chr(10) if printed else ''}[error: {result}]")
            self.messages.pop()
            return
        if result is None:  # abandoned by a second Ctrl-C: keep what was shown
            result = AnswerResult("".join(printed), "cancelled", len(printed))
        self.last = result
        self.messages.append({"role": "assistant", "content": result.text})
        if stopped or result.finish_reason == "cancelled":
            self.say(" [stopped]")
        elif result.finish_reason == "length":
            self.say(" [max tokens]")
        else:
            self.say()

    def interruptible(self, make: Callable[[], Awaitable[AnswerResult]]) -> tuple[AnswerResult | AnswerError | None, bool]:
        """Runs an answer with Ctrl-C wired to cancel it; returns (result, whether Ctrl-C was pressed).

        The result is None when the answer was abandoned (a second Ctrl-C, or no stop
        within HARD_STOP_AFTER_S), and the AnswerError when it failed.
        """
        return self.loop.run_until_complete(run_interruptible(make, self.backend.cancel, self.sigint))

    # -- commands ----------------------------------------------------------------------
    def command(self, line: str) -> str | None:
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        handler = {
            "/reset": self.cmd_reset, "/rewind": self.cmd_rewind, "/system": self.cmd_system,
            "/save": self.cmd_save, "/load": self.cmd_load, "/stats": self.cmd_stats, "/help": self.cmd_help,
        }.get(name)
        if name in ("/quit", "/exit"):
            return "quit"
        if handler is None:
            self.say(f"unknown command {name}; /help lists the commands")
            return None
        handler(arg)
        return None

    def _sync(self) -> None:
        self.loop.run_until_complete(self.backend.sync(self.history()))

    def cmd_help(self, arg: str) -> None:
        self.say(HELP)

    def cmd_reset(self, arg: str) -> None:
        self.messages.clear()
        self.last = None
        self._sync()
        self.say("[conversation reset]")

    def cmd_rewind(self, arg: str) -> None:
        users = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
        if not users:
            self.say("nothing to rewind")
            return
        del self.messages[users[-1]:]
        self._sync()
        self.say(f"[rewound: {len(users) - 1} exchange(s) left]")

    def cmd_system(self, arg: str) -> None:
        if not arg:
            self.say(f"system prompt: {self.system!r}" if self.system else "no system prompt (the template's default)")
            return
        self.system = arg
        self._sync()
        self.say("[system prompt set]")

    def cmd_save(self, arg: str) -> None:
        if not arg:
            self.say("usage: /save FILE")
            return
        data = {"version": STATE_VERSION, "model": self.backend.model_name, "system": self.system,
                "messages": self.messages, **self.loop.run_until_complete(self.backend.state())}
        try:
            Path(arg).expanduser().write_text(json.dumps(data, ensure_ascii=False) + "\n")
        except OSError as exc:
            self.say(f"cannot write {arg}: {exc.strerror or exc}")
            return
        self.say(f"[saved {len(self.messages)} messages to {arg}]")

    def cmd_load(self, arg: str) -> None:
        if not arg:
            self.say("usage: /load FILE")
            return
        try:
            data = read_chat_file(Path(arg).expanduser())
            self.loop.run_until_complete(self.backend.restore(data))
        except (OSError, ValueError) as exc:
            self.say(f"cannot load {arg}: {getattr(exc, 'strerror', None) or exc}")
            return
        self.messages = data["messages"]
        self.system = data.get("system") or None
        self.last = None
        self.say(f"[loaded {len(self.messages)} messages from {arg}]")

    def cmd_stats(self, arg: str) -> None:
        tokens = self.backend.num_tokens()
        self.say(f"messages: {len(self.messages)}; tokens in the conversation: "
                 f"{tokens if tokens is not None else 'unknown'}")
        last = self.last
        if last is None:
            self.say("no answer yet")
            return
        parts = []
        if last.prompt_tokens is not None:
            parts.append(f"prompt {last.prompt_tokens} tokens")
        if last.cached_tokens is not None:
            parts.append(f"cached {last.cached_tokens} tokens")
        parts.append(f"generated {last.completion_tokens} tokens ({last.finish_reason})")
        if last.tokens_per_s is not None:
            parts.append(f"{last.tokens_per_s:.1f} tokens/s")
        if last.ttft_s is not None:
            parts.append(f"first token after {last.ttft_s:.2f} s")
        self.say("last answer: " + "; ".join(parts))


def read_chat_file(path: Path) -> dict[str, Any]:
    """A file written by /save, checked enough that the REPL can continue it."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
        raise ValueError("not a conversation file written by /save")
    messages = data.get("messages")
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ValueError("it has no chat messages (a file from Conversation.save() holds only tokens)")
    return data

