"""The KV disk tier (issue 27) through real ``bargein serve`` processes on loopback, over a
tiny random-weight GGUF model that the test writes (a byte-level BPE tokenizer, ChatML).

- A chat turn, a clean stop (SIGTERM: the server's shutdown reaches
  ``AsyncEngine.shutdown`` -> ``Engine.close_kv_disk``, which writes every full block),
  a new server on the same directory: the next turn (history = the first prompt, the
  first answer, a new user message) reads the first turn's blocks back from disk, and its
  greedy answer equals that of a server without the tier that never restarted.
- A corrupt block file is skipped (one warning, deleted): the blocks before it come from
  disk, the rest is recomputed, and the answer is the same.
- A size bound below one turn's blocks holds, on disk and in ``/v1/cache``.
- A second server on a directory that a running one owns: it starts, says the tier is in
  use, and serves without it.

What the design allows the restarted server to reuse: only full blocks are registered
and written, and the first turn's last token (the last answer token) has no K/V yet, so
the disk holds the full blocks of its first ``P + A - 1`` tokens (P prompt tokens, A answer
tokens). The next turn's prompt re-tokenizes the history (a restarted server has no memory
of the first answer's ids; here they come out the same), so its cached tokens are the whole
blocks of those: ``(P + A - 1) // 16 * 16``, not the ``P + A - 1`` a server that never
restarted reuses (its partly filled last block is not on disk).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from bargein.engine.block_keys import chain_hash
from bargein.engine.kv_disk.lock import LOCK_NAME
from tests.conftest import ServerProcess
from tests.tiny_models import SPECIAL_TOKENS, TinySpec, tiny_tokenizer, tiny_weights, write_gguf

pytestmark = pytest.mark.slow
BLOCK = 16  # bargein serve's block size (CacheConfig.block_size)
FIRST = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog, and then it jumps again over "
                                     "the lazy dog. How are you today?"}]
# Greedy, never a control token (its text would be dropped from the answer, and the
# history's tokens would then differ from the first turn's for a reason of its own).
NO_CONTROL = {str(tiny_tokenizer().token_to_id(t)): -100 for t in SPECIAL_TOKENS}
TURN = {"temperature": 0, "max_tokens": 24, "ignore_eos": True, "logit_bias": NO_CONTROL, "return_token_ids": True}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", TinySpec(), tiny_weights(TinySpec()))


def serve(model: Path, *args: str) -> ServerProcess:
    return ServerProcess(("--model", str(model), "--debug-endpoints", "--log-level", "info", *args)).start()


def chat(server: ServerProcess, messages: list[dict]) -> dict:
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": "tiny", "messages": messages, **TURN},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def cache(server: ServerProcess) -> dict:
    return httpx.get(f"{server.base_url}/v1/cache", timeout=10).json()


def metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    (value,) = [line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")]
    return float(value)


def next_turn(first: dict) -> list[dict]:
    """The history a client resends: the first prompt, the first answer, a new message."""
    return FIRST + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "And tomorrow?"}]


@pytest.fixture(scope="module")
def never_restarted(tiny_model: Path) -> tuple[dict, dict]:
    """Both turns on one server without the tier that never restarted: (first, second)."""
    server = serve(tiny_model).wait_ready()
    try:
        first = chat(server, FIRST)
        return first, chat(server, next_turn(first))
    finally:
        server.stop()


def first_turn_then_sigterm(tiny_model: Path, kv: Path) -> tuple[dict, list[int]]:
    """One chat turn on a server with the tier, stopped with SIGTERM: the answer and the
    turn's tokens (prompt + answer). The shutdown wrote every full block (and only those)."""
    before = serve(tiny_model, "--kv-disk", str(kv), "--kv-disk-size", "64MiB").wait_ready()
    try:
        first = chat(before, FIRST)
    finally:
        assert before.stop(signal.SIGTERM) == 0, before.log()
    (choice,) = first["choices"]
    assert len(choice["token_ids"]) == TURN["max_tokens"]
    history = choice["prompt_token_ids"] + choice["token_ids"]
    files = sorted(p for p in kv.iterdir() if p.name != LOCK_NAME)
    assert len(files) == (len(history) - 1) // BLOCK, before.log()
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in files) and kv.stat().st_mode & 0o777 == 0o700
    return first, history


def test_a_conversation_continues_from_disk_after_a_sigterm_restart(tiny_model: Path, tmp_path: Path,
                                                                   never_restarted) -> None:
    kv = tmp_path / "kv"
    first, history = first_turn_then_sigterm(tiny_model, kv)
    computed = len(history) - 1  # the last answer token's K/V is computed with the next turn
    ref_first, ref_second = never_restarted
    assert ref_first["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    after = serve(tiny_model, "--kv-disk", str(kv), "--kv-disk-size", "64MiB").wait_ready()
    try:
        assert cache(after)["kv_disk"]["blocks"] == computed // BLOCK
        again = chat(after, next_turn(first))
        next_ids = again["choices"][0]["prompt_token_ids"]
        # The history re-tokenizes to the first turn's ids (this model's answer is plain
        # text), so every block written hits: 80 prompt + 24 answer tokens, 103 with K/V,
        # 6 whole blocks = 96 cached tokens; the server that never restarted also reused
        # the partly filled last block (103).
        assert next_ids[:len(history)] == history
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == computed // BLOCK * BLOCK > 0
        assert ref_second["usage"]["prompt_tokens_details"]["cached_tokens"] == computed
        assert next_ids == ref_second["choices"][0]["prompt_token_ids"]
        assert again["choices"][0]["token_ids"] == ref_second["choices"][0]["token_ids"]
        assert again["choices"][0]["message"]["content"] == ref_second["choices"][0]["message"]["content"]
        disk = cache(after)["kv_disk"]
        assert disk["hits"] == cached // BLOCK and disk["skipped_files"] == 0
        assert metric(after, "bargein_kv_disk_hits_total") == cached // BLOCK
        assert metric(after, "bargein_kv_disk_blocks") >= computed // BLOCK
        assert after.wait_idle()["ok"]
    finally:
        assert after.stop(signal.SIGTERM) == 0, after.log()


def test_a_corrupt_block_file_costs_a_recompute_never_a_wrong_token(tiny_model: Path, tmp_path: Path,
                                                                    never_restarted) -> None:
    kv = tmp_path / "kv"
    first, history = first_turn_then_sigterm(tiny_model, kv)
    key = None
    for i in range(3):  # block 2's key
        key = chain_hash(key, history[i * BLOCK:(i + 1) * BLOCK])
    (victim,) = kv.glob(f"{key.hex()}.*")
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF  # a flipped byte: the checksum catches it
    victim.write_bytes(bytes(data))
    after = serve(tiny_model, "--kv-disk", str(kv)).wait_ready()
    try:
        again = chat(after, next_turn(first))
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * BLOCK  # blocks 0-1, then recomputed
        assert again["choices"][0]["token_ids"] == never_restarted[1]["choices"][0]["token_ids"]
        assert cache(after)["kv_disk"]["skipped_files"] == 1 and not victim.exists()
        assert after.wait_idle()["ok"]
    finally:
        assert after.stop(signal.SIGTERM) == 0, after.log()
    assert after.log().count(victim.name) == 1  # one warning names it


def test_the_size_bound_holds_and_answers_stay_right(tiny_model: Path, tmp_path: Path, never_restarted) -> None:
    """A tier bounded below one turn's blocks keeps only what fits (least recently used
    first out); the next turn after a restart reuses what is left, if anything, and
    answers the same."""
    # This model's block file: 4,096 bytes of float16 K/V and 232 of header, tokens and checksum.
    kv, bound = tmp_path / "kv", 3 * 4328 + 100  # room for 3 of the turn's 6 blocks
    before = serve(tiny_model, "--kv-disk", str(kv), "--kv-disk-size", str(bound)).wait_ready()
    try:
        first = chat(before, FIRST)
    finally:
        assert before.stop(signal.SIGTERM) == 0, before.log()
    files = [p for p in kv.iterdir() if p.name != LOCK_NAME]
    assert len(files) == 3 and sum(p.stat().st_size for p in files) <= bound
    after = serve(tiny_model, "--kv-disk", str(kv), "--kv-disk-size", str(bound)).wait_ready()
    try:
        again = chat(after, next_turn(first))
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] % BLOCK == 0
        assert again["choices"][0]["token_ids"] == never_restarted[1]["choices"][0]["token_ids"]
        disk = cache(after)["kv_disk"]
        assert disk["bytes"] <= bound and disk["skipped_files"] == 0
    finally:
        assert after.stop(signal.SIGTERM) == 0, after.log()
    assert sum(p.stat().st_size for p in kv.iterdir() if p.name != LOCK_NAME) <= bound


def test_a_second_server_on_the_same_directory_runs_without_the_tier(tiny_model: Path, tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    owner = serve(tiny_model, "--kv-disk", str(kv))
    try:
        owner.wait_ready()
        other = serve(tiny_model, "--kv-disk", str(kv)).wait_ready()
        try:
            assert "in use by another bargein server" in other.log()
            assert chat(other, FIRST)["choices"][0]["token_ids"]  # it serves, without the tier
            assert cache(other)["kv_disk"] is None and cache(owner)["kv_disk"] is not None
            assert httpx.get(f"{other.base_url}/debug/kv", timeout=10).json()["kv_disk"] is None
        finally:
            assert other.stop(signal.SIGTERM) == 0, other.log()
        assert f"(pid {owner.proc.pid})" in other.log()
    finally:
        owner.stop()
    assert os.listdir(kv) == [LOCK_NAME]  # nothing computed: nothing written
