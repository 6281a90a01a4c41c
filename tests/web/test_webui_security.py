"""The chat page locked down (issue 34), in headless Chromium: it works under its strict
Content-Security-Policy with no violation reported, keeps the API key in sessionStorage
unless the user asks to remember it, and renders tampered storage as text.

The server is the tiny engine with an API key (``tests/server/tiny_live_server.py``): it
starts in a second and answers at once; what is tested is the page, not the model.
Browser set-up and the ``Chat`` driver are test_webui's (no Chromium: these skip).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from bargein.server.tenants import TenantKey
from tests.server.tiny_live_server import tiny_live_server
from tests.web.test_webui import Chat, browser, open_chat  # noqa: F401  (browser: a fixture)

pytestmark = pytest.mark.slow
KEY = "page-key-0123456789"
SESSION_KEY = "bargein.apiKey"


@pytest.fixture(scope="module")
def server() -> Iterator[object]:
    with tiny_live_server(api_keys=(TenantKey(KEY, "page"),), allowed_hosts=("127.0.0.1",)) as live:
        yield live


@pytest.fixture
def chat(browser, server, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Chat]:  # noqa: F811
    with open_chat(browser, server.base_url, tmp_path, request.node.name) as c:
        c.violations = []
        c.page.on("console", lambda m: c.violations.append(m.text)
                  if "Content Security Policy" in m.text or "Refused to" in m.text else None)
        yield c
    assert not c.violations, c.violations


def _use_key(chat: Chat) -> None:
    chat.settings(api_key=KEY)
    chat.page.dispatch_event("#api-key", "change")
    chat.page.wait_for_function("() => document.querySelector('#model').textContent === 'tiny'")
    if chat.page.is_visible("#error"):  # the key error from before the key was set
        chat.page.click("#error-close")


def test_the_page_works_under_its_csp(chat: Chat) -> None:
    response = chat.page.goto(f"{chat.base_url}/")
    csp = response.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    chat.wait_for_model()
    _use_key(chat)
    chat.settings(max_tokens=8)
    chat.send("Hello there")
    chat.wait_idle()
    answer = chat.assistant()
    assert "finish:" in answer.locator(".stats").inner_text()
    # markdown with aligned table cells renders without inline styles (the CSP refuses them)
    html = chat.page.evaluate("""async () => {
        const { renderMarkdown } = await import('/markdown.js');
        const box = document.createElement('div');
        box.className = 'content';
        box.innerHTML = renderMarkdown('| a | b |\\n|--:|:-:|\\n| 1 | 2 |\\n\\n```python\\nx = 1\\n```');
        document.querySelector('#messages').append(box);
        return box.innerHTML;
    }""")
    assert 'class="align-right"' in html and 'class="align-center"' in html and "style=" not in html
    assert chat.page.evaluate("getComputedStyle(document.querySelector('td.align-right')).textAlign") == "right"


def _storage(chat: Chat) -> dict:
    return chat.page.evaluate("""() => ({
        session: sessionStorage.getItem('bargein.apiKey'), local: localStorage.getItem('bargein.apiKey'),
        settings: localStorage.getItem('bargein.settings')})""")


def test_the_key_stays_in_the_session_unless_remembered(chat: Chat, browser) -> None:  # noqa: F811
    _use_key(chat)
    stored = _storage(chat)
    assert stored["session"] == KEY and stored["local"] is None and KEY not in (stored["settings"] or "")
    chat.page.reload()  # the same tab keeps its session
    chat.page.wait_for_function("() => document.querySelector('#model').textContent === 'tiny'")
    assert chat.page.input_value("#api-key") == KEY
    second = chat.page.context.new_page()  # another tab: no key, nothing on disk
    second.goto(f"{chat.base_url}/")
    assert second.input_value("#api-key") == ""
    chat.page.check("#remember-key")
    stored = _storage(chat)
    assert stored["local"] == KEY and stored["session"] is None
    second.reload()  # its script fills the field from storage once it runs: wait for that, then check
    second.wait_for_function("key => document.querySelector('#api-key').value === key", arg=KEY)
    assert second.input_value("#api-key") == KEY and second.is_checked("#remember-key")
    second.uncheck("#remember-key")
    # Another tab's storage change reaches this one asynchronously (Chromium syncs local
    # storage between renderers): wait for it, then check.
    chat.page.wait_for_function("() => localStorage.getItem('bargein.apiKey') === null")
    assert _storage(chat)["local"] is None
    second.close()


def test_a_key_an_older_page_kept_in_local_storage_moves_to_the_session(chat: Chat) -> None:
    chat.page.evaluate(f"localStorage.setItem('bargein.settings', JSON.stringify({{apiKey: '{KEY}'}}))")
    chat.page.reload()
    chat.page.wait_for_function("() => document.querySelector('#model').textContent === 'tiny'")
    stored = _storage(chat)
    assert stored["session"] == KEY and stored["local"] is None and KEY not in stored["settings"]


PAYLOAD = "<img src=x onerror=\"window.__pwned=1\">"


def test_tampered_storage_is_rendered_as_text(chat: Chat) -> None:
    _use_key(chat)
    answer = {"role": "assistant", "content": "second", "model": PAYLOAD, "versionIndex": PAYLOAD,
              "versions": [{"content": "first"}, {"content": "second"}], "stats": {"tokens": PAYLOAD},
              "finishReason": PAYLOAD, "stopKind": PAYLOAD}
    pending = {"role": "assistant", "content": "", "pending": True, "progress": {"done": PAYLOAD, "total": PAYLOAD}}
    conversation = {"id": "c-tampered", "title": PAYLOAD, "updated": 1,
                    "messages": [{"role": "user", "content": PAYLOAD}, answer, {"role": "user", "content": "x"},
                                 pending]}
    chat.page.evaluate("""([list, id]) => {
        localStorage.setItem('bargein.conversations', list);
        localStorage.setItem('bargein.current', id);
    }""", [json.dumps([conversation]), json.dumps("c-tampered")])
    chat.page.reload()
    chat.page.wait_for_selector("#messages .message")
    assert chat.page.evaluate("window.__pwned") is None
    assert chat.page.locator("img").count() == 0
    assert chat.page.locator(".version-label").first.inner_text() == "1/2"


def test_the_prompt_progress_bar_fills_without_inline_styles(chat: Chat, server) -> None:
    _use_key(chat)
    chat.settings(max_tokens=4)
    server.step_delay_s = 0.5  # 7 prompt chunks of 64 tokens: 3.5 s of reading at least
    try:
        chat.send("long " * 80)
        bar = chat.page.locator('[data-testid="prompt-progress"] .bar i')
        bar.wait_for(timeout=60_000)
        chat.page.wait_for_function(
            "() => { const i = document.querySelector('[data-testid=\"prompt-progress\"] .bar i');"
            " return i && parseFloat(getComputedStyle(i).width) > 0; }", timeout=60_000)
        assert bar.get_attribute("style").startswith("width:")  # set through the DOM, which the CSP allows
    finally:
        server.step_delay_s = 0.0
    chat.wait_idle()
