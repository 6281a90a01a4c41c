"""SSE keep-alives while a request waits for its blocks from the disk tier (issue 27 item 4,
``server/keepalive.py``).

A first engine answers a prompt and writes its full blocks at shutdown. A second engine
on the same directory (a restart) serves the same prompt, streamed, with keep-alives
every 0.1 s, while the tier's reads are slowed to 0.1 s a block (12 blocks: the restore
takes over a second, long after the first keep-alive is due). The request is held in
the queue while its blocks are read (``Scheduler.held``), so the stream says nothing but
keep-alives until the read is done: comments come first, each ``: keep-alive`` or ``:
keep-alive prompt 0/<prompt tokens>`` (nothing computed while held; once the blocks are
in, perhaps ``48/49``: all of them at once, no chunk computed), then the events,
which carry exactly the tokens of a server without the tier that never restarted (ids,
timestamps and the grouping of tokens into events aside, which depends on how fast the
client reads), and the usage counts every restored block as cached.
In one process, through the app (``inprocess_app``): no socket, no extra process.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

from bargein.engine.kv_disk import tier as tier_module
from bargein.engine.sampling import SamplingParams
from tests.server.inprocess_app import inprocess_app
from tests.tiny_engine import tiny_engine

BLOCK = 4
PROMPT = [(i * 37) % 200 + 3 for i in range(49)]  # 12 full blocks with K/V, and the token sampled from
READ_DELAY_S = 0.1  # per block read back
INTERVAL_S = 0.1
BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True}}
COMMENT = re.compile(r": keep-alive(?: prompt (\d+)/(\d+))?")


async def stream(directory: Path | None, keepalive_s: float) -> list[str]:
    """The SSE events (blank lines cut) of BODY on a fresh tiny engine (with the tier in
    ``directory``, if given)."""
    core = tiny_engine(num_blocks=64, block_size=BLOCK, kv_disk_dir=None if directory is None else str(directory))
    async with inprocess_app(core, timeout=60, sse_keepalive_s=keepalive_s) as (_, client):
        r = await client.post("/v1/completions", json=BODY)
        assert r.status_code == 200, r.text
    assert r.text.endswith("\n\n")
    return r.text[:-2].split("\n\n")


def comparable(event: str) -> dict | str:
    """A data event without what differs between the two runs (its id, its creation time,
    the cached tokens)."""
    assert event.startswith("data: "), event
    text = event[len("data: "):]
    if text == "[DONE]":
        return text
    payload = json.loads(text)
    payload.pop("id"), payload.pop("created")
    if payload.get("usage"):  # the restored blocks count as cached: checked on their own
        payload["usage"]["prompt_tokens_details"].pop("cached_tokens")
    return payload


def answer_of(data: list[str]) -> dict:
    """What the data events say, whatever the grouping of tokens into events: a slow
    consumer gets two tokens in one event where a fast one got two events, so the
    events are compared by the token ids they carry in order, the finish reasons, the
    fields every event repeats, and the events without choices (usage, [DONE])."""
    answer: dict = {"token_ids": [], "finish_reasons": [], "fields": set(), "other": []}
    for event in data:
        payload = comparable(event)
        if isinstance(payload, dict) and payload.get("choices"):
            (choice,) = payload.pop("choices")
            answer["token_ids"] += choice.get("token_ids") or []
            answer["finish_reasons"] += [choice["finish_reason"]] if choice.get("finish_reason") else []
            answer["fields"].add(json.dumps(payload, sort_keys=True))
        else:
            answer["other"].append(payload)
    return answer


def text_of(event: str) -> str:
    """The text an event carries ("" for a comment, the opening event, usage, [DONE])."""
    if not event.startswith("data: {"):
        return ""
    choices = json.loads(event[len("data: "):])["choices"]
    return choices[0]["text"] if choices else ""


def test_a_slow_restore_from_disk_streams_keepalives_then_the_exact_tokens(tmp_path: Path, monkeypatch) -> None:
    kv = tmp_path / "kv"
    first = tiny_engine(num_blocks=64, block_size=BLOCK, kv_disk_dir=str(kv))
    (out,) = first.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    assert first.close_kv_disk()
    written = (len(PROMPT) + len(out.token_ids) - 1) // BLOCK
    assert written == 12

    reference = asyncio.run(stream(None, 0))  # no tier, no keep-alives, never restarted

    read_block = tier_module.read_block

    def slow_read_block(*args, **kwargs):
        time.sleep(READ_DELAY_S)  # a slow disk (the reader thread's, never the step's)
        return read_block(*args, **kwargs)

    monkeypatch.setattr(tier_module, "read_block", slow_read_block)
    started = time.monotonic()
    events = asyncio.run(stream(kv, INTERVAL_S))
    assert time.monotonic() - started >= written * READ_DELAY_S

    comments = [e for e in events if e.startswith(":")]
    data = [e for e in events if not e.startswith(":")]
    assert not any(e.startswith(":") for e in reference)
    assert answer_of(data) == answer_of(reference)  # the same tokens, in order
    assert len(answer_of(data)["token_ids"]) == 6
    usage, ref_usage = (json.loads(chunks[-2][len("data: "):])["usage"] for chunks in (data, reference))
    assert usage["prompt_tokens_details"]["cached_tokens"] == written * BLOCK  # every block came from disk
    assert ref_usage["prompt_tokens_details"]["cached_tokens"] == 0 and usage["completion_tokens"] == 6
    # The restore took over a second against a 0.1 s interval: keep-alives came before the
    # first token (after the stream's opening event, whose text is empty).
    first_token = next(i for i, e in enumerate(events) if text_of(e))
    held = [e for e in events[:first_token] if e.startswith(":")]
    assert len(held) >= 3 and held == comments[:len(held)]
    progress = []
    for event in held:
        match = COMMENT.fullmatch(event)
        assert match, event
        if match.group(1) is not None:
            progress.append((int(match.group(1)), int(match.group(2))))
    # Held: 0 computed; once the blocks are in, all 48 at once (never a prompt chunk
    # computed in between), then perhaps a keep-alive before the first token.
    assert progress and progress[0] == (0, len(PROMPT)) and progress == sorted(progress), progress
    assert set(progress) <= {(0, len(PROMPT)), (written * BLOCK, len(PROMPT))}, progress

