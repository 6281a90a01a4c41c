"""A prefill cancelled past half its prompt keeps what it computed, through real ``bargein
serve`` processes (issue 27; the llama.cpp#22160 loop: a client times out mid-prefill and
retries): a retry after a restart reads the computed part back from disk, a retry on the
same server reuses it from memory, and both answers equal those of a server that
computed everything.

What the design keeps of the block that is not full: only full blocks (all 16 tokens
computed and final) are registered and written to disk, so after a restart the retry
reuses exactly the computed tokens rounded down to whole blocks, ``c // 16 * 16`` (c:
the tokens computed when the cancel landed), which the shutdown wrote as ``c // 16``
files. In memory the partly filled last block is kept too (token-granular reuse), so a
retry on the same server reuses every computed token.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from bargein.engine.kv_disk.block_file import SUFFIX
from tests.conftest import ServerProcess
from tests.tiny_models import SPECIAL_TOKENS, TinySpec, tiny_tokenizer, tiny_weights, write_gguf

pytestmark = pytest.mark.slow
BLOCK = 16
SPEC = TinySpec(max_position_embeddings=4096)
NO_CONTROL = {str(tiny_tokenizer().token_to_id(t)): -100 for t in SPECIAL_TOKENS}
TURN = {"temperature": 0, "max_tokens": 8, "ignore_eos": True, "logit_bias": NO_CONTROL, "return_token_ids": True}
# 4 prompt tokens a step and no step-time target (which would size chunks by time): a
# ~2,000-token prompt is read in ~500 steps, so a cancel sent once half is read lands long
# before the end even where the poll and the cancel wait on a loaded machine (with 16 a
# step, the tiny model's second half took ~150 ms, which a busy CI machine's HTTP
# round trips outlasted).
ARGS = ("--max-num-batched-tokens", "4", "--max-step-ms", "0", "--kv-tokens", "4096", "--log-level", "warning",
        "--debug-endpoints")


def long_prompt(seed: int) -> list[dict]:
    words = " ".join(f"w{(seed * 7919 + i * 104729) % 100003}" for i in range(400))
    return [{"role": "user", "content": words}]


def chat(server: ServerProcess, messages: list[dict]) -> dict:
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": "tiny", "messages": messages, **TURN},
                   timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    return {**body["choices"][0], "cached_tokens": body["usage"]["prompt_tokens_details"]["cached_tokens"]}


def cancel_past_half(server: ServerProcess, messages: list[dict]) -> tuple[int, int]:
    """Sends the chat, cancels it once at least half its prompt is computed; returns
    (prompt tokens computed when the cancel was sent, prompt tokens)."""
    answer: list[dict] = []
    client = threading.Thread(target=lambda: answer.append(chat(server, messages)))
    client.start()
    deadline = time.monotonic() + 120
    with httpx.Client(base_url=server.base_url, timeout=10) as http:  # one connection: cheap polls
        while True:
            assert time.monotonic() < deadline, server.log()
            listed = http.get("/v1/requests").json()["data"]
            if listed and listed[0]["prompt_computed"] * 2 >= listed[0]["prompt_tokens"]:
                break
            time.sleep(0.01)
        (info,) = listed
        r = http.post(f"/v1/requests/{info['id']}/cancel")
    assert r.json()["status"] == "cancelled", "the prefill ended before the cancel: make the prompt longer"
    client.join(60)
    assert answer[0]["finish_reason"] == "cancelled" and answer[0]["token_ids"] == []
    assert info["prompt_computed"] < info["prompt_tokens"]
    return info["prompt_computed"], info["prompt_tokens"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", SPEC, tiny_weights(SPEC))


@pytest.fixture(scope="module")
def reference(model: Path) -> list[dict]:
    """Both prompts' answers from a server without the tier that computed everything (in
    steps of 512 tokens: exact precision gives the same K/V however a prompt is chunked)."""
    server = ServerProcess(("--model", str(model), "--kv-tokens", "4096")).start().wait_ready()
    try:
        return [chat(server, long_prompt(seed)) for seed in (1, 2)]
    finally:
        server.stop()


def test_a_prefill_cancelled_past_half_continues_after_a_restart_and_in_memory(model: Path, tmp_path: Path,
                                                                               reference: list[dict]) -> None:
    kv = tmp_path / "kv"
    tier = ("--model", str(model), *ARGS, "--kv-disk", str(kv))
    before = ServerProcess(tier).start().wait_ready()
    try:
        half, prompt_tokens = cancel_past_half(before, long_prompt(1))
    finally:
        assert before.stop(signal.SIGTERM) == 0, before.log()
    assert prompt_tokens == len(reference[0]["prompt_token_ids"])
    written = len(list(kv.glob(f"*{SUFFIX}")))  # the shutdown wrote every full computed block
    assert written >= half // BLOCK and written * BLOCK < prompt_tokens

    after = ServerProcess(tier).start().wait_ready()
    try:
        retry = chat(after, long_prompt(1))
        # Every full block the cancelled prefill computed, read back: at least the computed half.
        assert retry["cached_tokens"] == written * BLOCK >= half // BLOCK * BLOCK >= prompt_tokens // 2 - BLOCK
        assert retry["token_ids"] == reference[0]["token_ids"]
        assert httpx.get(f"{after.base_url}/v1/cache", timeout=10).json()["kv_disk"]["hits"] == written

        # On the same server, no restart: the computed tokens are reused, the partly filled
        # last block's too.
        half2, prompt2 = cancel_past_half(after, long_prompt(2))
        again = chat(after, long_prompt(2))
        assert prompt2 - 1 >= again["cached_tokens"] >= half2 >= prompt2 // 2
        assert again["token_ids"] == reference[1]["token_ids"]
        assert after.wait_idle()["ok"]
    finally:
        assert after.stop(signal.SIGTERM) == 0, after.log()
