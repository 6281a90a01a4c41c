"""Screenshots of the web chat for the README (docs/webui-1280x800.png, docs/webui-390x844.png).

    python scripts/web_screenshots.py --url http://127.0.0.1:8000   (a running `bargein serve`)

Uses the system Chromium (``/usr/bin/chromium`` or ``$BARGEIN_CHROMIUM``) through
Playwright; nothing is downloaded. The first answer, with a table and code, is a canned
stream (the bundled 135M model seldom writes tables), regenerated once to show versions;
the second is the real model's, stopped with the Stop button.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from playwright.sync_api import sync_playwright

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("BARGEIN_CHROMIUM", "/usr/bin/chromium")
ANSWERS = [
    "Here is a short comparison:\n\n| | Python | JavaScript |\n|---|---|---|\n| typing | dynamic, optional hints "
    "| dynamic, TypeScript adds types |\n| runs in | CPython, PyPy | browsers, Node.js |\n\nA Python example:\n\n"
    "```python\ndef greet(name: str) -> str:\n    return f\"Hello, {name}!\"\n\nprint(greet(\"world\"))\n```\n",
    "In short:\n\n| | Python | JavaScript |\n|---|---|---|\n| typing | dynamic | dynamic |\n| packages | pip "
    "| npm |\n\n1. **Python** reads like pseudocode\n   - great for data and scripts\n2. **JavaScript** runs "
    "everywhere a browser does\n\n```js\nconst greet = (name) => `Hello, ${name}!`;\n```\n",
]


def canned(text: str) -> str:
    chunk = {"id": "demo", "object": "chat.completion.chunk", "choices": []}
    events = [{**chunk, "choices": [{"index": 0, "delta": {"content": text[i:i + 9]}, "finish_reason": None}]}
              for i in range(0, len(text), 9)]
    events.append({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    events.append({**chunk, "usage": {"prompt_tokens": 41, "completion_tokens": len(events) - 1,
                                      "total_tokens": 40 + len(events), "prompt_tokens_details": {"cached_tokens": 0}}})
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--out", default=str(REPO / "docs"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        context = browser.new_context(viewport={"width": 1280, "height": 800}, color_scheme="light")
        page = context.new_page()
        page.goto(f"{args.url}/")
        page.wait_for_function("!['…', 'unavailable'].includes(document.querySelector('#model').textContent)")
        page.fill("#temperature", "0")
        page.fill("#max-tokens", "300")
        answers = iter(ANSWERS)

        def fulfil(route):
            route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=canned(next(answers)))

        page.route("**/v1/chat/completions", fulfil)
        page.fill("#prompt", "Compare Python and JavaScript in a small table, then show a greeting function.")
        page.click("#send")
        page.wait_for_selector("#send:visible")
        page.click("#regenerate")
        page.wait_for_selector("#send:visible")
        page.unroute("**/v1/chat/completions")
        page.fill("#prompt", "Now count from 1 to 100 in words, please.")
        page.click("#send")
        page.wait_for_function("""() => {
            const a = document.querySelectorAll('#messages .message[data-role="assistant"]');
            return a.length === 2 && a[1].querySelector('.content').innerText.length > 60; }""", timeout=120_000)
        page.click("#stop")
        page.wait_for_selector("#send:visible")
        page.screenshot(path=str(out / "webui-1280x800.png"))
        phone = context.new_page()
        phone.set_viewport_size({"width": 390, "height": 844})
        phone.goto(f"{args.url}/")
        phone.wait_for_function("!['…', 'unavailable'].includes(document.querySelector('#model').textContent)")
        phone.screenshot(path=str(out / "webui-390x844.png"))
        browser.close()
    print(f"wrote {out / 'webui-1280x800.png'} and {out / 'webui-390x844.png'}")


if __name__ == "__main__":
    main()
