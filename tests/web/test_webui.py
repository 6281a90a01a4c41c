"""The web chat at ``/``, driven in headless Chromium against a running ``bargein serve``.

The server comes from the ``live_server`` fixture (tests/conftest.py), or from the URL in
``BARGEIN_TEST_URL`` when that is set; without either, and without Chromium at
``/usr/bin/chromium`` (or ``BARGEIN_CHROMIUM``), the tests skip. Browsers are never
downloaded. Each test leaves a screenshot of the page in its pytest tmp dir (and in
``BARGEIN_ARTIFACTS`` too when that is set).

Tests that need a key, a deadline or a slowly read prompt use ``guarded_server`` (an API
key, a 3 s deadline, 16 prompt tokens a step); the shutdown test starts and stops its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import GUARDED_KEY, ServerProcess, wait_until

playwright_sync = pytest.importorskip("playwright.sync_api")

pytestmark = pytest.mark.slow

CHROMIUM = os.environ.get("BARGEIN_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = os.environ.get("BARGEIN_ARTIFACTS")
# A prompt that keeps a small model talking long enough to be stopped mid-answer.
LONG_PROMPT = "Count from 1 to 300, writing every number as a word, separated by commas."
ANSWER_TIMEOUT_MS = 120_000


@pytest.fixture
def server_url(request: pytest.FixtureRequest) -> str:
    url = os.environ.get("BARGEIN_TEST_URL")
    if url:
        return url.rstrip("/")
    try:
        return request.getfixturevalue("live_server").base_url.rstrip("/")
    except pytest.FixtureLookupError:
        pytest.skip("no live_server fixture and BARGEIN_TEST_URL is not set")


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        pytest.skip(f"Chromium not found at {CHROMIUM}")
    with playwright_sync.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Chat:
    """The chat page, with the chat requests it sent (body and X-Request-Id) recorded."""

    def __init__(self, page, base_url: str, shots: Path, headers: dict | None = None) -> None:
        self.page = page
        self.base_url = base_url
        self.shots = shots
        self.headers = headers or {}
        self.sent: list[tuple[str, dict]] = []
        page.on("request", self._record)

    def _record(self, req) -> None:
        if req.method == "POST" and req.url.endswith("/v1/chat/completions"):
            self.sent.append(
                (req.headers.get("x-request-id", ""), json.loads(req.post_data or "{}"))
            )

    def settings(self, **values: object) -> None:
        for selector, value in values.items():
            self.page.fill(f"#{selector.replace('_', '-')}", str(value))

    def send(self, text: str) -> str:
        """Send `text`; return the X-Request-Id the page chose for the answer."""
        self.page.fill("#prompt", text)
        with self.page.expect_request(
            lambda r: r.method == "POST" and r.url.endswith("/v1/chat/completions")
        ) as info:
            self.page.click("#send")
        return info.value.headers.get("x-request-id", "")

    def wait_idle(self) -> None:
        self.page.wait_for_selector("#send:visible", timeout=ANSWER_TIMEOUT_MS)

    def wait_for_text(self, index: int, min_chars: int) -> None:
        """Wait until assistant answer `index` shows at least `min_chars` characters."""
        self.page.wait_for_function(
            """([i, n]) => {
                const m = document.querySelectorAll('#messages .message[data-role="assistant"]')[i];
                return m && !m.classList.contains('pending')  // not the progress or queued line
                    && m.querySelector('.content').innerText.trim().length >= n;
            }""",
            arg=[index, min_chars],
            timeout=ANSWER_TIMEOUT_MS,
        )

    def assistant(self, index: int = -1):
        answers = self.page.locator('#messages .message[data-role="assistant"]')
        return answers.nth(answers.count() - 1 if index == -1 else index)

    def running_ids(self) -> list[str]:
        body = httpx.get(f"{self.base_url}/v1/requests", headers=self.headers, timeout=10).json()
        return [r["id"] for r in body["data"]]

    def wait_for_model(self) -> None:
        self.page.wait_for_function("() => document.querySelector('#model').textContent !== '…'")

    def shot(self, name: str) -> None:
        dirs = [self.shots] + ([Path(ARTIFACTS)] if ARTIFACTS else [])
        for folder in dirs:
            folder.mkdir(parents=True, exist_ok=True)
            self.page.screenshot(path=str(folder / f"{name}.png"), full_page=True)


@contextlib.contextmanager
def open_chat(browser, url: str, shots: Path, name: str, headers: dict | None = None) -> Iterator[Chat]:
    """A fresh browser context (empty localStorage) on the page at ``url``."""
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{url}/")
    c = Chat(page, url, shots, headers)
    c.wait_for_model()
    c.settings(temperature=0, max_tokens=48)
    try:
        yield c
        c.shot(name)
    finally:
        context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


@pytest.fixture
def chat(browser, server_url: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Chat]:
    with open_chat(browser, server_url, tmp_path, request.node.name) as c:
        c.page.wait_for_function("() => document.querySelector('#model').textContent !== 'unavailable'")
        yield c


@pytest.fixture
def guarded_chat(browser, guarded_server, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Chat]:
    """The page on the guarded server, with the right key set in Settings."""
    with open_chat(browser, guarded_server.base_url, tmp_path, request.node.name, guarded_server.headers) as c:
        c.settings(api_key=GUARDED_KEY)
        c.page.dispatch_event("#api-key", "change")
        c.page.wait_for_function("() => document.querySelector('#model').textContent.includes('SmolLM2')")
        if c.page.is_visible("#error"):  # the key error from before the key was set
            c.page.click("#error-close")
        yield c


def cached_tokens(stats_text: str) -> int:
    match = re.search(r"cached (\d+)", stats_text)
    assert match, f"no cached count in {stats_text!r}"
    return int(match.group(1))


def test_send_streams_an_answer_with_stats(chat: Chat) -> None:
    chat.send("Say hello in one short sentence.")
    chat.wait_idle()
    answer = chat.assistant()
    assert answer.locator(".content").inner_text().strip()
    stats = answer.locator(".stats").inner_text()
    assert "TTFT" in stats and "tokens" in stats and "finish:" in stats
    assert cached_tokens(stats) >= 0
    request_id, body = chat.sent[-1]
    assert request_id.startswith("chatcmpl-web-")
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["messages"][-1] == {"role": "user", "content": "Say hello in one short sentence."}
    assert body["model"] == chat.page.inner_text("#model")


def test_stop_keeps_partial_answer_and_next_turn_hits_the_cache(chat: Chat) -> None:
    chat.settings(max_tokens=400)
    stopped_id = chat.send(LONG_PROMPT)
    chat.wait_for_text(0, 20)
    chat.page.click("#stop")
    chat.wait_idle()
    answer = chat.assistant(0)
    partial = answer.locator(".content").inner_text().strip()
    assert partial
    assert answer.get_attribute("data-finish") == "cancelled"
    assert "stopped" in answer.get_attribute("class")
    assert (answer.get_attribute("data-stop"), answer.locator(".stop-badge").inner_text()) == (
        "user",
        "STOPPED BY YOU",
    )
    assert "finish: cancelled (user)" in answer.locator(".stats").inner_text()
    assert stopped_id not in chat.running_ids()

    chat.settings(max_tokens=16)
    chat.send("Thanks, that is enough.")
    chat.wait_idle()
    history = chat.sent[-1][1]["messages"]
    assert history[-2]["role"] == "assistant"
    assert history[-2]["content"].strip().startswith(partial[:10])
    assert cached_tokens(chat.assistant(1).locator(".stats").inner_text()) > 0


def test_stop_right_after_send(chat: Chat) -> None:
    chat.settings(max_tokens=400)
    chat.page.fill("#prompt", LONG_PROMPT)
    chat.page.click("#send")
    chat.page.click("#stop")
    chat.wait_idle()
    assert chat.assistant().get_attribute("data-finish") == "cancelled"
    assert chat.page.is_hidden("#error")


def test_regenerate_keeps_earlier_versions(chat: Chat) -> None:
    chat.settings(temperature=1.0, max_tokens=12)
    chat.send("Name one colour.")
    chat.wait_idle()
    first_text = chat.assistant().locator(".content").inner_text()
    chat.page.click("#regenerate")
    chat.wait_idle()
    assert chat.page.locator("#messages .message").count() == 2
    (first_id, first), (second_id, second) = chat.sent
    assert first_id != second_id
    assert first["messages"] == second["messages"]
    answer = chat.assistant()
    second_text = answer.locator(".content").inner_text()
    assert answer.locator(".version-label").inner_text() == "2/2"
    answer.locator(".prev-version").click()
    assert answer.locator(".version-label").inner_text() == "1/2"
    assert answer.locator(".content").inner_text() == first_text
    assert answer.locator(".stats").inner_text()
    chat.page.reload()  # versions are stored with the conversation
    chat.wait_for_model()
    answer = chat.assistant()
    assert answer.locator(".version-label").inner_text() == "1/2"
    answer.locator(".next-version").click()
    assert answer.locator(".content").inner_text() == second_text
    # The shown version is the one that goes back to the server as history.
    chat.send("Thanks.")
    chat.wait_idle()
    # The page shows the answer rendered as markdown ("- Purple" and "1. Purple" are list
    # items "Purple", whose marker is not in the text): compare words only, list markers
    # dropped.
    words = lambda text: re.sub(r"\W+", "", re.sub(r"(?m)^\s*(?:[-*+]|\d+[.)])\s+", "", text))[:8]  # noqa: E731
    assert words(chat.sent[-1][1]["messages"][1]["content"]) == words(second_text)


def test_editing_an_earlier_message_warns_and_keeps_a_copy(chat: Chat) -> None:
    chat.settings(max_tokens=8)
    chat.send("Name one fruit.")
    chat.wait_idle()
    chat.send("Name one more.")
    chat.wait_idle()
    chat.page.locator('.message[data-role="user"] .edit').first.click()
    assert "3 later messages" in chat.page.inner_text('[data-testid="edit-warning"]')
    chat.page.fill(".edit-box", "Name one animal.")
    chat.page.click(".save-edit")
    chat.wait_idle()
    roles = [m.get_attribute("data-role") for m in chat.page.locator("#messages .message").all()]
    assert roles == ["user", "assistant"]
    assert chat.sent[-1][1]["messages"] == [{"role": "user", "content": "Name one animal."}]
    titles = chat.page.locator("#conversations .open").all_inner_texts()
    assert titles == ["Name one fruit.", "Name one fruit. (before edit)"]
    chat.page.locator("#conversations .open").nth(1).click()
    assert chat.page.locator("#messages .message").count() == 4


def test_requests_panel_lists_and_cancels(chat: Chat) -> None:
    chat.settings(max_tokens=400)
    request_id = chat.send(LONG_PROMPT)
    row = chat.page.locator(f'#requests .request-row[data-id="{request_id}"]')
    row.wait_for(timeout=ANSWER_TIMEOUT_MS)
    chat.wait_for_text(0, 1)
    row.locator(".cancel").click()
    chat.wait_idle()
    assert chat.assistant().get_attribute("data-finish") == "cancelled"
    row.wait_for(state="detached", timeout=10_000)
    assert request_id not in chat.running_ids()


def test_server_error_is_shown(chat: Chat) -> None:
    chat.settings(max_tokens=-5)
    server = httpx.post(
        f"{chat.base_url}/v1/chat/completions",
        timeout=30,
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5, "stream": True},
    )
    assert server.status_code == 400
    chat.page.fill("#prompt", "hi")
    chat.page.click("#send")
    chat.page.wait_for_selector("#error:visible")
    assert server.json()["error"]["message"] in chat.page.inner_text("#error")
    # The failed answer is not kept; the question is, so Retry / Regenerate can ask again.
    assert [
        m.get_attribute("data-role") for m in chat.page.locator("#messages .message").all()
    ] == ["user"]


def test_lost_connection_is_reported(chat: Chat) -> None:
    chat.page.route("**/v1/chat/completions", lambda route: route.abort("connectionrefused"))
    chat.page.fill("#prompt", "hi")
    chat.page.click("#send")
    chat.page.wait_for_selector("#error:visible")
    assert "Lost connection to the server" in chat.page.inner_text("#error")
    assert chat.page.is_visible("#error-retry")


def canned_stream(text: str, finish: str | None = "stop", cancel_reason: str | None = None) -> str:
    """A chat completion stream of ``text`` in small pieces; ``finish=None`` breaks off (no [DONE])."""
    chunk = {"id": "x", "object": "chat.completion.chunk", "choices": []}
    pieces = [text[i : i + 7] for i in range(0, len(text), 7)]
    events = [
        {**chunk, "choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]}
        for p in pieces
    ]
    if finish is None:
        return "".join(f"data: {json.dumps(e)}\n\n" for e in events)
    end = {"index": 0, "delta": {}, "finish_reason": finish}
    if cancel_reason:
        end["cancel_reason"] = cancel_reason
    usage = {"prompt_tokens": 5, "completion_tokens": len(pieces), "total_tokens": 5 + len(pieces)}
    return sse(*events, {**chunk, "choices": [end]}, {**chunk, "usage": usage})


def serve_canned(chat: Chat, body: str) -> None:
    chat.page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(
            status=200, headers={"Content-Type": "text/event-stream"}, body=body
        ),
    )


UNSAFE = (
    'Look: <script>window.pwned = 1</script> and <img src=x onerror="window.pwned = 2">\n\n'
    "[bad](javascript:window.pwned=3) and [good](https://example.com/a?b=1&c=2)\n\n"
    "[shout](JAVASCRIPT:window.pwned=5) [data](data:text/html,<script>window.pwned=6</script>)\n\n"
    '<a href="javascript:window.pwned=7">raw link</a> <iframe src="javascript:window.pwned=8"></iframe>\n\n'
    '<svg onload="window.pwned=9"></svg> ![pic](https://example.com/x.png" onerror="window.pwned=10)\n\n'
    "```html\n<b>not bold</b>\n```\n"
)


def sse(*events: dict) -> str:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def test_markdown_from_the_model_cannot_inject_html(chat: Chat) -> None:
    # The server streams what the model writes; a canned stream stands in for a model
    # that writes markup.
    serve_canned(chat, canned_stream(UNSAFE))
    chat.send('<img src=x onerror="window.pwned = 4">')
    chat.wait_idle()
    messages = chat.page.locator("#messages")
    assert chat.page.evaluate("window.pwned") is None
    assert messages.locator("script, img, iframe, svg, [onerror], [onload]").count() == 0
    text = messages.inner_text()
    assert "<script>window.pwned = 1</script>" in text and "<b>not bold</b>" in text
    assert '<a href="javascript:window.pwned=7">raw link</a>' in text
    # The good link stays; the image became a plain link (linkified text); no other URL is one.
    hrefs = [a.get_attribute("href") for a in messages.locator("a").all()]
    assert hrefs == ["https://example.com/a?b=1&c=2", "https://example.com/x.png"]
    assert {a.get_attribute("rel") for a in messages.locator("a").all()} == {"noopener noreferrer"}
    assert messages.locator("pre code").count() == 1
    assert messages.locator(".code-block .copy-code").count() == 1


MARKDOWN = """## Results

| name | score |
| --- | ---: |
| alpha | 1 |
| beta | **2** |

1. first
   - nested a
   - nested b
2. second

```python
def greet(name):
    return f"hi {name}"
```
"""


def test_markdown_tables_nested_lists_and_highlighted_code(chat: Chat) -> None:
    serve_canned(chat, canned_stream(MARKDOWN))
    chat.send("Show me markdown.")
    chat.wait_idle()
    content = chat.assistant().locator(".content")
    assert content.locator("table th").all_inner_texts() == ["name", "score"]
    assert content.locator("table tbody tr").count() == 2
    assert content.locator("table tbody strong").inner_text() == "2"
    assert content.locator("ol > li").count() == 2
    assert content.locator("ol > li").first.locator("ul > li").all_inner_texts() == ["nested a", "nested b"]
    code = content.locator("pre code.language-python")
    assert code.inner_text() == 'def greet(name):\n    return f"hi {name}"'
    assert code.locator(".hljs-keyword").first.inner_text() == "def"
    assert content.locator(".code-lang").inner_text() == "python"
    # highlight.js's colours apply (the vendored theme is loaded, nothing from a CDN).
    colour = code.locator(".hljs-keyword").first.evaluate("e => getComputedStyle(e).color")
    assert colour != code.evaluate("e => getComputedStyle(e).color")


def test_conversations_and_settings_persist(chat: Chat) -> None:
    chat.settings(system_prompt="You are terse.", temperature=0.3, top_p=0.8, max_tokens=12)
    chat.send("Hi!")
    chat.wait_idle()
    assert chat.sent[-1][1]["messages"][0] == {"role": "system", "content": "You are terse."}
    assert (
        chat.sent[-1][1]["temperature"],
        chat.sent[-1][1]["top_p"],
        chat.sent[-1][1]["max_tokens"],
    ) == (0.3, 0.8, 12)
    chat.page.click("#new-chat")
    assert chat.page.locator("#messages .message").count() == 0
    first = chat.page.locator("#conversations .conversation").nth(1)
    first.hover()
    first.locator(".rename").click()
    chat.page.fill(".rename-box", "Greetings")
    chat.page.press(".rename-box", "Enter")
    chat.page.reload()
    assert chat.page.locator("#conversations .open").all_inner_texts() == ["New chat", "Greetings"]
    assert chat.page.input_value("#system-prompt") == "You are terse."
    assert chat.page.input_value("#max-tokens") == "12"
    chat.page.locator("#conversations .open", has_text="Greetings").click()
    assert chat.page.locator("#messages .message").count() == 2
    row = chat.page.locator("#conversations .conversation").nth(1)
    row.hover()
    row.locator(".delete").click()
    row.locator(".delete").click()  # the second click confirms
    assert chat.page.locator("#conversations .open").all_inner_texts() == ["New chat"]


def test_reload_mid_answer_keeps_the_turn_as_stopped(chat: Chat) -> None:
    chat.settings(max_tokens=400)
    request_id = chat.send(LONG_PROMPT)
    chat.wait_for_text(0, 30)
    shown = chat.assistant().locator(".content").inner_text().strip()
    chat.page.reload()
    chat.wait_for_model()
    answer = chat.assistant()
    kept = answer.locator(".content").inner_text().strip()
    assert len(kept) >= len(shown) and kept.startswith(shown[:20])
    assert chat.page.locator('.message[data-role="user"] .content').inner_text() == LONG_PROMPT
    assert (answer.get_attribute("data-stop"), answer.get_attribute("data-finish")) == ("closed", "cancelled")
    assert "reloaded or closed" in answer.locator(".stop-note").inner_text()
    assert answer.locator(".who").inner_text() == chat.page.inner_text("#model")  # not "Assistant"
    wait_until(lambda: request_id not in chat.running_ids(), timeout=30)  # the server stopped it
    chat.settings(max_tokens=8)
    chat.send("Go on.")
    chat.wait_idle()
    history = chat.sent[-1][1]["messages"]
    assert [m["role"] for m in history] == ["user", "assistant", "user"]
    assert history[1]["content"].strip().startswith(kept[:20])


def test_stop_looks_token_limit_and_connection_lost(chat: Chat) -> None:
    chat.settings(max_tokens=3)
    chat.send("Write a long poem about the sea.")
    chat.wait_idle()
    answer = chat.assistant()
    assert (answer.get_attribute("data-stop"), answer.locator(".stop-badge").inner_text()) == (
        "length",
        "TOKEN LIMIT",
    )
    assert "Raise Max tokens in Settings" in answer.locator(".stop-note").inner_text()
    serve_canned(chat, canned_stream("The first half of an answer, then", finish=None))
    chat.send("And another?")
    chat.wait_idle()
    answer = chat.assistant()
    assert answer.locator(".content").inner_text().startswith("The first half")
    assert (answer.get_attribute("data-stop"), answer.locator(".stop-badge").inner_text()) == (
        "lost",
        "CONNECTION LOST",
    )
    assert "connection to the server broke" in answer.locator(".stop-note").inner_text()
    assert "connection lost" in answer.locator(".stats").inner_text()


def test_stop_look_deadline(guarded_chat: Chat) -> None:
    guarded_chat.settings(max_tokens=2000)
    guarded_chat.send(LONG_PROMPT)
    guarded_chat.wait_idle()
    answer = guarded_chat.assistant()
    assert answer.get_attribute("data-finish") == "cancelled"
    assert (answer.get_attribute("data-stop"), answer.locator(".stop-badge").inner_text()) == (
        "deadline",
        "DEADLINE REACHED",
    )
    assert "--request-timeout" in answer.locator(".stop-note").inner_text()


def test_stop_look_server_shutdown(browser, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    server = ServerProcess(("--shutdown-timeout", "10")).start().wait_ready()
    try:
        with open_chat(browser, server.base_url, tmp_path, request.node.name) as chat:
            chat.settings(max_tokens=2000)
            chat.send(LONG_PROMPT)
            chat.wait_for_text(0, 10)
            server.proc.send_signal(signal.SIGTERM)
            chat.wait_idle()
            answer = chat.assistant()
            assert answer.get_attribute("data-finish") == "cancelled"
            assert (answer.get_attribute("data-stop"), answer.locator(".stop-badge").inner_text()) == (
                "shutdown",
                "SERVER SHUT DOWN",
            )
            assert "Start it again" in answer.locator(".stop-note").inner_text()
    finally:
        server.stop()


def test_prompt_progress_bar_while_a_long_prompt_is_read(guarded_chat: Chat) -> None:
    guarded_chat.settings(max_tokens=4)
    # A prompt of its own (a fresh first line), so that no earlier test left it in the prefix cache.
    long_prompt = f"Notes {uuid.uuid4().hex}. " + " ".join(f"Note {i}: the sky was grey." for i in range(60))
    guarded_chat.send(long_prompt)
    bar = guarded_chat.page.locator('[data-testid="prompt-progress"]')
    bar.wait_for(timeout=ANSWER_TIMEOUT_MS)
    label = bar.locator(".label").inner_text()
    done, total = (int(x.replace(",", "")) for x in re.findall(r"([\d,]+) / ([\d,]+)", label)[0])
    assert 0 < done < total and total > 300, label
    guarded_chat.shot("prompt-progress")
    guarded_chat.wait_idle()
    assert guarded_chat.page.locator('[data-testid="prompt-progress"]').count() == 0
    # The pasted message is folded, with a way to read it all.
    question = guarded_chat.page.locator('.message[data-role="user"]')
    assert "collapsed" in question.get_attribute("class")
    question.locator(".toggle-more").click()
    assert "collapsed" not in question.get_attribute("class")
    assert question.locator(".toggle-more").inner_text() == "Show less"


def test_a_late_rejection_of_a_replaced_key_shows_nothing(browser, guarded_server, tmp_path: Path, request) -> None:
    """The model list asked with a wrong key answers 401 only after the key was fixed and the
    list came back with it: that stale answer shows no error and keeps the model named."""
    held = []

    def hold_wrong(route) -> None:
        if route.request.headers.get("authorization") == "Bearer wrong":
            held.append(route)
        else:
            route.continue_()

    with open_chat(browser, guarded_server.base_url, tmp_path, request.node.name) as chat:
        chat.page.click("#error-close")  # the first visit's "needs an API key"
        chat.page.route("**/v1/models", hold_wrong)
        chat.settings(api_key="wrong")
        chat.page.focus("#max-tokens")  # the key's change event: a model list asked with it, held
        for _ in range(100):
            if held:
                break
            chat.page.wait_for_timeout(20)
        assert held, "the page never asked for the model list with the wrong key"
        chat.settings(api_key=GUARDED_KEY)
        chat.page.focus("#max-tokens")
        model = chat.page.locator("#model")
        chat.page.wait_for_function("() => !document.querySelector('#model').textContent.startsWith('API key')")
        named = model.inner_text()
        with chat.page.expect_response(lambda r: r.url.endswith("/v1/models") and r.status == 401):
            held[0].continue_()
        chat.page.wait_for_timeout(300)  # the page's handling of that late answer
        assert chat.page.is_hidden("#error"), chat.page.inner_text("#error")
        assert model.inner_text() == named


def test_key_errors_ask_for_the_key(browser, guarded_server, tmp_path: Path, request) -> None:
    with open_chat(browser, guarded_server.base_url, tmp_path, request.node.name) as chat:
        assert chat.page.inner_text("#model") == "API key needed"
        error = chat.page.inner_text("#error")
        assert "needs an API key" in error and "cannot be reached" not in error
        assert "connection ok" in chat.page.get_attribute("#connection", "class")
        chat.page.wait_for_function(
            "() => document.querySelector('#requests .empty').textContent.includes('API key')"
        )
        chat.page.fill("#prompt", "hi")
        chat.page.click("#send")
        chat.page.wait_for_selector("#error.auth:visible")
        assert "needs an API key" in chat.page.inner_text("#error")
        assert chat.page.evaluate("document.activeElement.id") == "api-key"
        chat.settings(api_key="wrong")
        chat.page.click("#error-retry")
        chat.page.wait_for_function(
            "() => document.querySelector('#error .error-text').textContent.includes('rejected')"
        )
        # Both rejected calls (the model list and the answer) have come back before the key
        # changes: a late 401 of the old key would otherwise show over the retry.
        chat.page.wait_for_function("() => document.querySelector('#model').textContent === 'API key rejected'")
        chat.wait_idle()
        chat.shot("key-rejected")
        chat.settings(api_key=GUARDED_KEY, max_tokens=4)
        chat.page.click("#error-retry")
        chat.wait_idle()
        assert chat.page.is_hidden("#error"), chat.page.inner_text("#error")
        # An answer came (its text may be cut short by the server's 3 s deadline on a busy machine);
        # its ending is rendered just after the send button comes back.
        chat.page.wait_for_function(
            "() => [...document.querySelectorAll('#messages .message[data-role=\"assistant\"]')].pop()?.dataset.finish",
            timeout=ANSWER_TIMEOUT_MS)
        assert chat.assistant().get_attribute("data-finish") in ("stop", "length", "cancelled")
