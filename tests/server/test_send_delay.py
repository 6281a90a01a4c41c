"""The server's own cost per output (issue 29): ``bargein_output_send_delay_seconds``.

Every output that carries tokens is observed once, after its stream events were handed
to the connection, from the time its delta was made on the engine thread; a delta that
coalesces later ones keeps its own (the oldest) time.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from bargein.engine.outputs import RequestDelta
from tests.server.inprocess_app import inprocess_app
from tests.tiny_engine import tiny_engine

NAME = "bargein_output_send_delay_seconds"


def scraped(text: str, suffix: str) -> float:
    found = re.search(rf"^{NAME}_{suffix} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_merged_delta_keeps_its_oldest_emission_time():
    first = RequestDelta("r", new_token_ids=[1])
    later = RequestDelta("r", new_token_ids=[2], emitted_at=first.emitted_at + 5.0)
    first.merge(later)
    assert first.new_token_ids == [1, 2]
    assert first.emitted_at == later.emitted_at - 5.0
    assert RequestDelta("s").emitted_at <= time.monotonic()


@pytest.mark.anyio
async def test_each_streamed_output_with_tokens_is_observed_once():
    async with inprocess_app(tiny_engine(num_blocks=64)) as (_app, client):
        before = (await client.get("/metrics")).text
        r = await client.post("/v1/completions", json={
            "model": "m", "prompt": "hello", "max_tokens": 12, "stream": True, "ignore_eos": True,
            "temperature": 0})
        after = (await client.get("/metrics")).text
    assert r.status_code == 200
    chunks = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    with_text = sum(1 for c in chunks for choice in c["choices"] if choice.get("text"))
    count = scraped(after, "count") - scraped(before, "count")
    total = scraped(after, "sum") - scraped(before, "sum")
    # one per output with tokens: at least one per chunk with text, at most one per token
    # (a byte that completes no character yet streams no text; coalesced tokens share one)
    assert 1 <= with_text <= count <= 12, (count, with_text)
    assert 0.0 <= total / count < 30.0  # seconds: a sane delay, whatever the load
