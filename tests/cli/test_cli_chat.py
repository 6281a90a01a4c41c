"""``bargein chat``: the REPL through a pseudo-terminal, and its local backend on a tiny model.

The pexpect test runs the real command on the bundled model: a streamed answer stopped
with Ctrl-C mid-way, a follow-up that reuses every token already computed (the cached
prompt tokens that /stats reports), /rewind, /save and /load, and Ctrl-D. The tiny-model
tests check the backend's token bookkeeping exactly: each turn prompts only the text
beyond what the conversation holds, and history edits rewind just what no longer matches.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time

import pexpect
import pytest

from bargein import AsyncEngine
from bargein.cli.backends import GenerationSettings, LocalBackend
from bargein.cli.repl import read_chat_file
from tests.conftest import REPO
from tests.tiny_engine import ByteTokenizer, tiny_engine

STARTUP_TIMEOUT_S = 240
ANSWER_TIMEOUT_S = 120
# Ctrl-C takes effect at the next step boundary; one step of the bundled model takes well
# under a second even on a loaded CPU, so this bound only catches a stop that is ignored.
STOP_TIMEOUT_S = 15
PROMPT = ">>> "


def spawn_cli(*args: str, timeout: float = STARTUP_TIMEOUT_S) -> pexpect.spawn:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BARGEIN_")}
    child = pexpect.spawn(sys.executable, ["-m", "bargein.cli", *args], cwd=str(REPO), env=env,
                          encoding="utf-8", timeout=timeout, dimensions=(40, 200))
    child.expect("bargein chat: ")
    child.expect_exact(PROMPT)
    return child


def send_and_stop(child: pexpect.spawn, message: str, min_words: int = 3) -> float:
    """Sends a message, waits until the answer has streamed a few words, presses Ctrl-C.

    Returns the seconds from Ctrl-C to the "[stopped]" marker.
    """
    child.sendline(message)
    child.expect_exact(message + "\r\n")  # the terminal's echo; the answer comes after it
    child.expect(r"\w+" + r"\W+\w+" * (min_words - 1), timeout=ANSWER_TIMEOUT_S)
    pressed = time.monotonic()
    child.sendintr()
    child.expect_exact("[stopped]", timeout=STOP_TIMEOUT_S)
    elapsed = time.monotonic() - pressed
    child.expect_exact(PROMPT)
    return elapsed


def send_and_finish(child: pexpect.spawn, message: str) -> None:
    """Sends a message and waits for its whole answer (the next prompt). For turns whose
    answer may be a few words: a Ctrl-C pressed after the answer ended would land on the
    prompt and quit the chat (seen once in make test, a title of eleven words)."""
    child.sendline(message)
    child.expect_exact(message + "\r\n")
    child.expect_exact(PROMPT, timeout=ANSWER_TIMEOUT_S)


def command(child: pexpect.spawn, line: str) -> str:
    """Runs a /command; returns what it printed."""
    child.sendline(line)
    child.expect_exact(line + "\r\n")
    child.expect_exact(PROMPT)
    return child.before


def stats(child: pexpect.spawn) -> dict[str, int | str]:
    text = command(child, "/stats")
    found: dict[str, int | str] = {
        "messages": int(re.search(r"messages: (\d+)", text).group(1)),
        "tokens": int(re.search(r"tokens in the conversation: (\d+)", text).group(1)),
    }
    if match := re.search(r"prompt (\d+) tokens; cached (\d+) tokens; generated (\d+) tokens \((\w+)\)", text):
        found.update(prompt=int(match.group(1)), cached=int(match.group(2)), generated=int(match.group(3)),
                     finish=match.group(4))
    return found


@pytest.mark.slow
def test_chat_stop_continue_rewind_save_load(tmp_path):
    child = spawn_cli("chat", "--temperature", "0", "--max-tokens", "400")
    try:
        # A long answer, stopped mid-way: the partial answer stays in the conversation.
        assert send_and_stop(child, "Write a very long story about a dragon.", min_words=6) < STOP_TIMEOUT_S
        first = stats(child)
        assert first["messages"] == 2 and first["finish"] == "cancelled"
        assert 0 < first["generated"] < 400
        assert first["tokens"] == first["prompt"] + first["generated"]

        # The follow-up continues from the cached prompt plus the partial answer: nothing
        # already computed is computed again (C7), the new turn's tokens only.
        send_and_finish(child, "Give the story a title.")
        second = stats(child)
        assert second["messages"] == 4
        assert second["cached"] >= first["tokens"] - 1, (first, second)
        assert second["prompt"] > first["tokens"]

        # /rewind drops the last exchange: back to the first answer (plus its closing tokens).
        assert "rewound" in command(child, "/rewind")
        rewound = stats(child)
        assert rewound["messages"] == 2
        assert first["tokens"] <= rewound["tokens"] < second["tokens"]

        # /save, /reset, /load: the same conversation again, token for token.
        saved = tmp_path / "chat.json"
        assert "saved 2 messages" in command(child, f"/save {saved}")
        data = json.loads(saved.read_text())
        assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
        assert len(data["token_ids"]) == rewound["tokens"]
        command(child, "/reset")
        assert stats(child)["messages"] == 0
        assert "loaded 2 messages" in command(child, f"/load {saved}")
        loaded = stats(child)
        assert (loaded["messages"], loaded["tokens"]) == (2, rewound["tokens"])

        # The loaded conversation answers, and its prefix comes from the cache.
        send_and_finish(child, "Who is the hero?")
        after_load = stats(child)
        assert after_load["messages"] == 4 and after_load["cached"] > 0

        assert "/rewind" in command(child, "/help")
        assert "unknown command" in command(child, "/nope")
        assert "cannot load" in command(child, f"/load {tmp_path / 'missing.json'}")

        child.sendeof()  # Ctrl-D at the prompt quits cleanly
        child.expect(pexpect.EOF, timeout=30)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before
    assert "Traceback" not in child.before


# -- the local backend on a tiny model ----------------------------------------------------------
class TemplateByteTokenizer(ByteTokenizer):
    """Bytes plus a ChatML-like template whose turn end is the special token 257."""

    def apply_chat_template(self, messages, *, add_generation_prompt=True, **_):
        text = "".join(f"[{m['role']}]{m['content']}<257>\n" for m in messages)
        return text + ("[assistant]" if add_generation_prompt else "")

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        tokens = []
        for i, part in enumerate(text.split("<257>")):
            tokens += ([257] if i else []) + list(part.encode())
        return tokens


def run_backend(test):
    async def go():
        engine = tiny_engine()
        engine.tokenizer = TemplateByteTokenizer()
        ae = AsyncEngine(engine).start()
        backend = LocalBackend(ae)
        try:
            await test(backend, engine.tokenizer)
        finally:
            await backend.close()
    asyncio.run(go())


SHORT = GenerationSettings(max_tokens=6, temperature=0)


def test_each_turn_prompts_only_the_new_text():
    async def test(backend, tok):
        history = [{"role": "user", "content": "hello"}]
        first = await backend.answer(history, SHORT, lambda _: None)
        held = (await backend.conv.tokens())
        assert held == tok.encode("[user]hello<257>\n[assistant]") + held[-first.completion_tokens:]

        history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "more"}]
        second = await backend.answer(history, SHORT, lambda _: None)
        tokens = (await backend.conv.tokens())
        assert tokens[:len(held)] == held  # nothing before was re-tokenized or rewound
        assert tokens[len(held):len(tokens) - second.completion_tokens] == tok.encode("<257>\n[user]more<257>\n[assistant]")
        assert second.cached_tokens >= len(held) - 1

    run_backend(test)


def test_history_edits_rewind_what_no_longer_matches():
    async def test(backend, tok):
        history = [{"role": "user", "content": "hello"}]
        first = await backend.answer(history, SHORT, lambda _: None)
        after_first = (await backend.conv.tokens())
        history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "again"}]
        await backend.answer(history, SHORT, lambda _: None)

        await backend.sync(history[:2])  # /rewind: back to the first exchange and its turn end
        assert (await backend.conv.tokens()) == after_first + tok.encode("<257>\n")

        await backend.sync([{"role": "system", "content": "be brief"}, *history[:2]])  # /system
        assert (await backend.conv.tokens()) == tok.encode("[")  # "[system]..." shares only its "[" with "[user]..."
        await backend.sync([])  # /reset
        assert (await backend.conv.tokens()) == []

    run_backend(test)


def test_save_and_load_round_trip(tmp_path):
    async def test(backend, tok):
        await backend.answer([{"role": "user", "content": "hi"}], SHORT, lambda _: None)
        tokens = (await backend.conv.tokens())
        state = await backend.state()
        assert state["token_ids"] == tokens
        await backend.restore({"model": "tiny", **state})
        assert (await backend.conv.tokens()) == tokens
        # This engine's weights have no identity (no fingerprint): the model's name decides.
        with pytest.raises(ValueError, match="saved with model 'another'"):
            await backend.restore({**state, "model": "another"})

    run_backend(test)


def test_chat_file_checks(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"version": 1, "model": "m", "token_ids": [1, 2]}))
    with pytest.raises(ValueError, match="no chat messages"):
        read_chat_file(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        read_chat_file(path)
    path.write_text(json.dumps({"version": 1, "messages": [{"role": "user", "content": "x"}]}))
    assert read_chat_file(path)["messages"] == [{"role": "user", "content": "x"}]
