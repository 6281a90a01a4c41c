"""The web chat's "JSON schema" settings box (static/structured.js), in Chromium."""

from __future__ import annotations

import json

import jsonschema

from tests.web.test_webui import Chat, browser, chat, server_url  # noqa: F401  (fixtures)

SCHEMA = {"type": "object", "properties": {"greeting": {"type": "string", "maxLength": 20}},
          "required": ["greeting"], "additionalProperties": False}


def test_schema_box_constrains_the_answer(chat: Chat) -> None:  # noqa: F811
    chat.page.fill("#json-schema", json.dumps(SCHEMA))
    chat.send("Say hello.")
    chat.wait_idle()
    _, body = chat.sent[-1]
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "schema", "schema": SCHEMA}}
    jsonschema.validate(json.loads(chat.assistant().locator(".content").inner_text()), SCHEMA)
    chat.page.fill("#json-schema", "")
    chat.send("Say hello.")
    chat.wait_idle()
    assert "response_format" not in chat.sent[-1][1]
