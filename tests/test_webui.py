"""The web chat at ``/``, driven in headless Chromium against a running ``bargein serve``.

The server comes from the ``live_server`` fixture (tests/conftest.py), or from the URL in
``BARGEIN_TEST_URL`` when that is set; without either, and without Chromium at
``/usr/bin/chromium`` (or ``BARGEIN_CHROMIUM``), the tests skip. Browsers are never
downloaded. Screenshots go to ``artifacts/webui/`` (ignored by git) or ``BARGEIN_ARTIFACTS``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

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
ARTIFACTS = Path(
    os.environ.get("BARGEIN_ARTIFACTS", Path(__file__).parent.parent / "artifacts" / "webui")
)
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

    def __init__(self, page, base_url: str) -> None:
        self.page = page
        self.base_url = base_url
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
                return m && m.querySelector('.content').innerText.trim().length >= n;
            }""",
            arg=[index, min_chars],
            timeout=ANSWER_TIMEOUT_MS,
        )

    def assistant(self, index: int = -1):
        answers = self.page.locator('#messages .message[data-role="assistant"]')
        return answers.nth(answers.count() - 1 if index == -1 else index)

    def running_ids(self) -> list[str]:
        body = httpx.get(f"{self.base_url}/v1/requests", timeout=10).json()
        return [r["id"] for r in body["data"]]

    def shot(self, name: str) -> None:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


@pytest.fixture
def chat(browser, server_url: str, request: pytest.FixtureRequest) -> Iterator[Chat]:
    context = browser.new_context(viewport={"width": 1280, "height": 860})  # fresh localStorage
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{server_url}/")
    page.wait_for_function(
        "!['…', 'unavailable'].includes(document.querySelector('#model').textContent)"
    )
    c = Chat(page, server_url)
    c.settings(temperature=0, max_tokens=48)
    yield c
    c.shot(request.node.name)
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


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
    assert "finish: cancelled" in answer.locator(".stats").inner_text()
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


def test_regenerate_replaces_the_last_answer(chat: Chat) -> None:
    chat.send("Name one colour.")
    chat.wait_idle()
    chat.page.click("#regenerate")
    chat.wait_idle()
    assert chat.page.locator("#messages .message").count() == 2
    (first_id, first), (second_id, second) = chat.sent
    assert first_id != second_id
    assert first["messages"] == second["messages"]
    assert chat.assistant().locator(".stats").inner_text()


def test_edit_and_resend_drops_later_messages(chat: Chat) -> None:
    chat.send("Name one fruit.")
    chat.wait_idle()
    chat.send("Name one more.")
    chat.wait_idle()
    chat.page.locator('.message[data-role="user"] .edit').first.click()
    chat.page.fill(".edit-box", "Name one animal.")
    chat.page.click(".save-edit")
    chat.wait_idle()
    roles = [m.get_attribute("data-role") for m in chat.page.locator("#messages .message").all()]
    assert roles == ["user", "assistant"]
    assert chat.sent[-1][1]["messages"] == [{"role": "user", "content": "Name one animal."}]


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


UNSAFE = (
    'Look: <script>window.pwned = 1</script> and <img src=x onerror="window.pwned = 2">\n\n'
    "[bad](javascript:window.pwned=3) and [good](https://example.com/a?b=1&c=2)\n\n"
    "```html\n<b>not bold</b>\n```\n"
)


def sse(*events: dict) -> str:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def test_markdown_from_the_model_cannot_inject_html(chat: Chat) -> None:
    # The server streams what the model writes; a canned stream stands in for a model
    # that writes markup.
    pieces = [UNSAFE[i : i + 7] for i in range(0, len(UNSAFE), 7)]
    chunk = {"id": "x", "object": "chat.completion.chunk", "choices": []}
    body = sse(
        *(
            {**chunk, "choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]}
            for p in pieces
        ),
        {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {
            **chunk,
            "usage": {
                "prompt_tokens": 5,
                "completion_tokens": len(pieces),
                "total_tokens": 5 + len(pieces),
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        },
    )
    chat.page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(
            status=200, headers={"Content-Type": "text/event-stream"}, body=body
        ),
    )
    chat.send('<img src=x onerror="window.pwned = 4">')
    chat.wait_idle()
    messages = chat.page.locator("#messages")
    assert chat.page.evaluate("window.pwned") is None
    assert messages.locator("script, img, [onerror]").count() == 0
    text = messages.inner_text()
    assert "<script>window.pwned = 1</script>" in text and "<b>not bold</b>" in text
    links = messages.locator("a")
    assert links.count() == 1
    assert links.get_attribute("href") == "https://example.com/a?b=1&c=2"
    assert links.get_attribute("rel") == "noopener noreferrer"
    assert messages.locator("pre code").count() == 1
    assert messages.locator(".code-block .copy-code").count() == 1


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
