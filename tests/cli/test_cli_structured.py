"""``bargein run --json-schema FILE``: local and through a server, and a bad schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.cli.test_cli_server import bargein

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "country": {"enum": ["France", "Spain"]}},
          "required": ["city", "country"], "additionalProperties": False}


@pytest.mark.slow
@pytest.mark.parametrize("remote", [False, True])
def test_run_answers_json_that_matches(tmp_path, live_server, remote):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    where = ["--url", live_server.base_url] if remote else []
    result = bargein("run", "What is the capital of France?", "--json-schema", str(path), "--max-tokens", "40",
                     "--temperature", "0", *where)
    assert result.returncode == 0, result.stderr
    jsonschema.validate(json.loads(result.stdout), SCHEMA)


def test_run_refuses_an_unsupported_schema(tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps({"type": "array", "uniqueItems": True}))
    result = bargein("run", "hi", "--json-schema", str(path))
    assert result.returncode == 2 and "uniqueItems" in result.stderr and "Traceback" not in result.stderr
