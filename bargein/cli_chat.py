"""``bargein chat``: a terminal chat where Ctrl-C stops an answer and the next line continues it.

Two backends answer the same REPL:

- :class:`LocalBackend` drives an engine :class:`~bargein.engine.conversation.Conversation`.
  Each turn renders the whole history with the model's chat template and prompts the
  conversation with only the text beyond what its tokens already hold, so the K/V of
  earlier turns, a partial answer included, is reused and never recomputed. After a stop
  the template's closing tokens (``<|im_end|>\\n``) are simply part of the next suffix.
- :class:`RemoteBackend` streams ``/v1/chat/completions`` from a server with the full
  history and an ``X-Request-Id`` of its own, which it cancels on Ctrl-C.

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
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

from bargein.cli_client import BargeinClient, ClientError, StreamEvent
from bargein.cli_progress import with_progress
from bargein.engine.continuation import KnownText, continue_text

HARD_STOP_AFTER_S = 3.0
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


@dataclass(frozen=True)
class GenerationSettings:
    max_tokens: int | None = 512
    temperature: float = 0.7
    json_schema: str | None = None  # a JSON Schema (text) the answer must match


@dataclass(frozen=True)
class AnswerResult:
    """One answer: its text, why it ended, and what it cost."""

    text: str
    finish_reason: str  # "stop" | "length" | "cancelled"
    completion_tokens: int
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    ttft_s: float | None = None
    decode_s: float | None = None  # first token to last

    @property
    def tokens_per_s(self) -> float | None:
        if not self.decode_s or self.completion_tokens < 2:
            return None
        return (self.completion_tokens - 1) / self.decode_s


class AnswerError(Exception):
    """An answer could not be produced (bad request, context full, server error); one line."""


OnDelta = Callable[[str], None]


class Backend(Protocol):
    model_name: str
    where: str

    async def answer(self, messages: list[dict[str, str]], settings: GenerationSettings,
                     on_delta: OnDelta) -> AnswerResult: ...
    async def answer_raw(self, prompt: str, settings: GenerationSettings, on_delta: OnDelta) -> AnswerResult: ...
    def cancel(self) -> None: ...
    async def sync(self, messages: list[dict[str, str]]) -> None: ...
    def num_tokens(self) -> int | None: ...
    async def state(self) -> dict[str, Any]: ...
    async def prompt_progress(self) -> tuple[int, int] | None: ...
    async def restore(self, data: dict[str, Any]) -> None: ...
    async def close(self) -> None: ...


class _Timer:
    """Time to first token and decode time of one answer."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None

    def token(self) -> None:
        now = time.monotonic()
        self.first = self.first or now
        self.last = now

    @property
    def ttft_s(self) -> float | None:
        return None if self.first is None else self.first - self.started

    @property
    def decode_s(self) -> float | None:
        return None if self.first is None or self.last is None else self.last - self.first


# -- local: the engine's conversation API ----------------------------------------------------
class LocalBackend:
    """One engine Conversation that follows the REPL's history token-exactly."""

    def __init__(self, async_engine: Any):
        self.ae = async_engine
        self.tokenizer = async_engine.engine.tokenizer
        self.model_name = async_engine.engine.model_name
        self.where = "locally"
        from bargein.engine.conversation import (
            Conversation,  # the engine (torch) loads only for local chat
        )

        self.conv = Conversation.open(async_engine)
        self._stop = False
        self._num_tokens = 0  # as of the last turn, for the status line

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        from bargein.loader import LoaderError

        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        except LoaderError as exc:
            raise AnswerError(f"the chat template failed: {exc} (use `bargein run --raw` for a model without one)") from None

    async def _align(self, text: str) -> str:
        """Rewinds the conversation to its longest prefix that ``text`` starts with; returns the rest.

        Usually nothing is rewound: the tokens are the history so far, and the rest is the
        new turn. After /rewind, /reset or /system the tokens that no longer match go.
        The match is the one continuation function, with the conversation as the known text.
        """
        tokens = tuple(await self.conv.tokens())
        self._num_tokens = len(tokens)

        def decode(ids: Sequence[int]) -> str:
            return self.tokenizer.decode(list(ids), skip_special_tokens=False)

        known = KnownText("", (), tokens, decode(tokens))
        cont = continue_text(text, [known], encode=lambda _: [], decode=decode)
        if cont.reused < len(tokens):
            await self.conv.rewind(len(tokens) - cont.reused)
            self._num_tokens = cont.reused
        return cont.rest_text

    async def answer(self, messages: list[dict[str, str]], settings: GenerationSettings,
                     on_delta: OnDelta) -> AnswerResult:
        suffix = await self._align(self._render(messages, add_generation_prompt=True))
        await self.conv.prompt(self.tokenizer.encode(suffix, add_special_tokens=False))
        return await self._generate(settings, on_delta)

    async def answer_raw(self, prompt: str, settings: GenerationSettings, on_delta: OnDelta) -> AnswerResult:
        await self.conv.prompt(self.tokenizer.encode(prompt))  # with the BOS the model expects, if any
        return await self._generate(settings, on_delta)

    async def _generate(self, settings: GenerationSettings, on_delta: OnDelta) -> AnswerResult:
        from bargein import EngineError, SamplingParams

        self._stop = False
        from bargein.engine.constraint import Constraint

        constraint = Constraint.json_schema(settings.json_schema) if settings.json_schema else None
        params = SamplingParams(max_tokens=settings.max_tokens, temperature=settings.temperature,
                                constraint=constraint)
        timer, last = _Timer(), None
        try:
            async for out in self.conv.generate(params):
                if self._stop:  # a Ctrl-C that came before the request existed
                    self.conv.cancel()
                if out.new_token_ids:
                    timer.token()
                if out.delta_text:
                    on_delta(out.delta_text)
                last = out
        except EngineError as exc:
            raise AnswerError(str(exc)) from None
        self._num_tokens = len(await self.conv.tokens())
        if last is None or last.finish_reason is None or last.finish_reason.value == "error":
            raise AnswerError(last.error if last is not None and last.error else "the engine failed the request")
        return AnswerResult(last.text, last.finish_reason.value, last.usage.completion_tokens,
                            last.usage.prompt_tokens, last.usage.cached_tokens, timer.ttft_s, timer.decode_s)

    def cancel(self) -> None:
        self._stop = True
        self.conv.cancel()

    async def sync(self, messages: list[dict[str, str]]) -> None:
        await self._align(self._render(messages, add_generation_prompt=False))

    def num_tokens(self) -> int | None:
        return self._num_tokens

    async def prompt_progress(self) -> tuple[int, int] | None:
        """(computed, total) prompt tokens of this conversation's request in flight, if any."""
        for info in await self.ae.call(self.ae.engine.list_requests):
            if info.session_id == self.conv.id:
                return info.prompt_computed, info.prompt_tokens
        return None

    async def state(self) -> dict[str, Any]:
        saved = await self.conv.save()
        return {"token_ids": list(saved.token_ids)}

    async def restore(self, data: dict[str, Any]) -> None:
        """Continues from a saved file's tokens (their K/V is reused if still cached)."""
        from bargein.engine.conversation import Conversation, ConversationState

        if "token_ids" in data:
            state = ConversationState(tuple(int(t) for t in data["token_ids"]), str(data.get("model", "")))
            conv = Conversation.load(self.ae, state)  # ValueError if another model saved it
        else:  # saved against a server: the tokens are computed with the next message
            conv = Conversation.open(self.ae)
        old, self.conv = self.conv, conv
        await old.close()
        self._num_tokens = len(await conv.tokens())

    async def close(self) -> None:
        await self.conv.close()
        await self.ae.shutdown(timeout=5.0)


# -- remote: a bargein server ------------------------------------------------------------------
def _response_format(settings: GenerationSettings) -> dict[str, Any]:
    if settings.json_schema is None:
        return {}
    schema = json.loads(settings.json_schema)
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}}


class RemoteBackend:
    """The history sent in full to ``/v1/chat/completions``; the server's prefix cache reuses K/V."""

    def __init__(self, client: BargeinClient, model_name: str):
        self.client = client
        self.model_name = model_name
        self.where = f"at {client.base_url}"
        self._request_id: str | None = None
        self._last_total: int | None = None
        self._pending_cancel: asyncio.Task | None = None

    async def answer(self, messages: list[dict[str, str]], settings: GenerationSettings,
                     on_delta: OnDelta) -> AnswerResult:
        rid = self._new_id()
        events = self.client.stream_chat(messages, request_id=rid, max_tokens=settings.max_tokens,
                                         temperature=settings.temperature, **_response_format(settings))
        return await self._consume(events, on_delta)

    async def answer_raw(self, prompt: str, settings: GenerationSettings, on_delta: OnDelta) -> AnswerResult:
        rid = self._new_id()
        events = self.client.stream_completion(prompt, request_id=rid, max_tokens=settings.max_tokens,
                                               temperature=settings.temperature, **_response_format(settings))
        return await self._consume(events, on_delta)

    def _new_id(self) -> str:
        self._request_id = f"cli-{uuid.uuid4().hex[:16]}"
        return self._request_id

    async def _consume(self, events: AsyncIterator[StreamEvent], on_delta: OnDelta) -> AnswerResult:
        timer, parts, finish, usage = _Timer(), [], None, {}
        try:
            async for event in events:
                if event.delta:
                    timer.token()
                    parts.append(event.delta)
                    on_delta(event.delta)
                finish = event.finish_reason or finish
                usage = event.usage or usage
        except ClientError as exc:
            raise AnswerError(str(exc)) from None
        finally:
            self._request_id = None
        if finish is None:
            raise AnswerError("the server ended the answer without a finish reason")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if usage:
            self._last_total = usage.get("total_tokens")
        completion = usage.get("completion_tokens", len(parts))
        return AnswerResult("".join(parts), finish, completion, usage.get("prompt_tokens"), cached,
                            timer.ttft_s, timer.decode_s)

    def cancel(self) -> None:
        if self._request_id is not None:
            self._pending_cancel = asyncio.ensure_future(self.client.acancel(self._request_id))

    async def sync(self, messages: list[dict[str, str]]) -> None:
        """Nothing to do: the server holds no state between answers."""

    def num_tokens(self) -> int | None:
        return self._last_total

    async def prompt_progress(self) -> tuple[int, int] | None:
        rid = self._request_id
        return None if rid is None else await self.client.aprompt_progress(rid)

    async def state(self) -> dict[str, Any]:
        return {}

    async def restore(self, data: dict[str, Any]) -> None:
        self._last_total = None

    async def close(self) -> None:
        if self._pending_cancel is not None:
            await self._pending_cancel


# -- the REPL -----------------------------------------------------------------------------------
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


class SigintRouter:
    """SIGINT on the event loop, handed to whatever runs now; presses with no taker are dropped.

    Installed while the loop owns the terminal (a turn, a command, ``bargein run``); while
    it is installed Ctrl-C never raises ``KeyboardInterrupt``.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.handler: Callable[[], None] | None = None

    def install(self) -> None:
        self.loop.add_signal_handler(signal.SIGINT, self._fire)

    def uninstall(self) -> None:
        self.handler = None
        self.loop.remove_signal_handler(signal.SIGINT)

    def _fire(self) -> None:
        if self.handler is not None:
            self.handler()


async def run_interruptible(make: Callable[[], Awaitable[AnswerResult]], cancel: Callable[[], None],
                            sigint: SigintRouter) -> tuple[AnswerResult | AnswerError | None, bool]:
    """Awaits ``make()`` with Ctrl-C calling ``cancel`` (and, if need be, abandoning the answer)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    presses = 0
    hard_stop: asyncio.TimerHandle | None = None

    def on_sigint() -> None:
        nonlocal presses, hard_stop
        presses += 1
        if presses == 1:
            cancel()
            hard_stop = loop.call_later(HARD_STOP_AFTER_S, task.cancel)
        else:
            task.cancel()

    sigint.handler = on_sigint
    try:
        return await make(), presses > 0
    except AnswerError as exc:
        return exc, presses > 0
    except asyncio.CancelledError:
        if not presses:
            raise
        task.uncancel()
        return None, True
    finally:
        sigint.handler = None
        if hard_stop is not None:
            hard_stop.cancel()


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
