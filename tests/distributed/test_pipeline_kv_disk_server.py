"""A pipeline's KV disk tier through real ``bargein serve --ray`` processes (issue 27 items
3 and 5): each stage keeps its own layers' blocks in ``DIR/stage-<start>-<end>``, and a
``kill -9`` of the server, a second server on the same directory and a tight size bound
never cost a wrong answer or a partial file.

The servers run a 4-layer tiny GGUF as two stages (layers 0-2 and 2-4) on the session's
Ray cluster (``tests/ray_cluster.py``), plus two nodes this module adds for the second
server's stages. Every answer is compared, token for token, with a
single-process engine on the same file. The KV pool holds 4 blocks of 16 tokens and a
chat takes 58 tokens (3 full blocks), so each chat evicts the one before and the stages
write its blocks while the next one runs; each stage's bound is 6 blocks.

1. Server A answers chats 0 and 1 (chat 0's blocks are written by both stages); meanwhile
   server B starts on the same directory: its stages find A's locks, B says which
   directory and whose pid, and serves the same answers without the tier.
2. A is killed with SIGKILL within 0.1 s of chat 2's start (the stages writing chat 1's
   blocks). Every block file left in either stage's directory is whole and one of the
   chats' blocks, and each stage stays within its bound.
3. Server C starts on the directory once A's stage processes are gone (their pids are in
   the lock files): the temporary files the kill left are removed, chat 0 reads back
   exactly the leading blocks that both stages hold, and all answers are right.
4. C gets SIGTERM and, as soon as a stage's writer has a file open (the shutdown writes
   chat 2's blocks, evicting older ones), SIGKILL: again every file is whole and each
   stage is within its bound, on disk.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")

from bargein.config import EngineConfig  # noqa: E402
from bargein.distributed.router import block_hashes  # noqa: E402
from bargein.engine.engine import Engine  # noqa: E402
from bargein.engine.kv_disk.block_file import (  # noqa: E402
    TMP_PREFIX,
    BadBlockFile,
    decode,
    header_fingerprint,
    parse_name,
)
from bargein.engine.kv_disk.lock import LOCK_NAME  # noqa: E402
from bargein.engine.sampling import SamplingParams  # noqa: E402
from tests.conftest import ServerProcess  # noqa: E402
from tests.ray_cluster import MB, OBJECT_STORE_MB  # noqa: E402
from tests.tiny_models import SPECIAL_TOKENS, TinySpec, tiny_tokenizer, tiny_weights, write_gguf  # noqa: E402

SPEC = TinySpec(num_layers=4)
BLOCK = 16
STAGES = ("stage-0-2", "stage-2-4")
CHATS = [f"Chat {i}: the quick {animal} jumps over the dog." for i, animal in enumerate(("fox", "cat", "owl"))]
ANSWER_TOKENS = 16
NO_CONTROL = {str(tiny_tokenizer().token_to_id(t)): -100 for t in SPECIAL_TOKENS}
TURN = {"temperature": 0, "max_tokens": ANSWER_TOKENS, "ignore_eos": True, "logit_bias": NO_CONTROL,
        "return_token_ids": True}
STAGE_BLOCKS = 6  # each stage's share of the bound, in blocks
# A stage's block file: 2 layers x (K, V) x 2 heads x 16 dims x 16 tokens in float16 (4,096
# bytes), and 232 of header, tokens and checksum (the test checks every file's size).
FILE_BYTES = 2 * 2 * SPEC.num_kv_heads * SPEC.head_dim * BLOCK * 2 + 232


@dataclass(frozen=True)
class Setting:
    model: Path
    reference: Engine  # one process, the servers' precision
    address: str  # the session cluster's
    second: str  # a resource only the two nodes added for the second server offer


@pytest.fixture(scope="module")
def setting(ray_cluster, tmp_path_factory) -> Iterator[Setting]:
    """Two nodes of one CPU are added for the module, with a resource of their own: the
    second server's stages go there (``--stage-resource``), since stages are placed on
    the nodes with the most memory, whose CPUs the first server's stages hold."""
    model = write_gguf(tmp_path_factory.mktemp("pipeline-kv-disk-server") / "tiny.gguf", SPEC, tiny_weights(SPEC))
    second = f"kv-disk-second-{uuid.uuid4().hex[:8]}"
    nodes = [ray_cluster.add_node(num_cpus=1, memory=300 * MB, object_store_memory=OBJECT_STORE_MB * MB,
                                  resources={second: 1}) for _ in range(2)]
    ray_cluster.wait_for_nodes()
    try:
        yield Setting(model, Engine.from_pretrained(str(model), EngineConfig(), progress=False),
                      ray_cluster.address, second)
    finally:
        for node in nodes:  # gracefully: Ray forgets them at once
            ray_cluster.remove_node(node, allow_graceful=True)


def serve(setting: Setting, kv: Path, bound: int, *args: str) -> ServerProcess:
    return ServerProcess(("--model", str(setting.model), "--ray", setting.address, "--stage-layers", "0-2,2-4",
                          "--kv-tokens", "64", "--kv-disk", str(kv), "--kv-disk-size", str(bound),
                          "--debug-endpoints", "--log-level", "info", *args)).start()


def chat(server: ServerProcess, i: int) -> dict:
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120,
                   json={"model": "tiny", "messages": [{"role": "user", "content": CHATS[i]}], **TURN})
    assert r.status_code == 200, r.text
    body = r.json()
    return {**body["choices"][0], "cached_tokens": body["usage"]["prompt_tokens_details"]["cached_tokens"]}


def expected(reference: Engine, answer: dict) -> list[int]:
    """The single-process engine's greedy answer to the prompt the server read."""
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True,
                            logit_bias={int(k): v for k, v in NO_CONTROL.items()})
    (out,) = reference.generate([answer["prompt_token_ids"]], params)
    return list(out.token_ids)


def block_keys(tokens: list[int]) -> list[bytes]:
    """The keys the server's pool gives the full blocks of ``tokens`` (the common namespace)."""
    return block_hashes(tokens, BLOCK)


def check_stage_files(kv: Path, known: set[bytes]) -> list[set[bytes]]:
    """Every stage's block files are whole, hold one of the chats' blocks and stay within
    the stage's bound; returns each stage's keys (temporary files are not counted)."""
    held = []
    for stage in STAGES:
        keys, total = set(), 0
        for path in (kv / stage).iterdir():
            parsed = parse_name(path.name)
            if parsed is None:
                continue
            data = path.read_bytes()
            try:
                decode(data, key=parsed[0], fingerprint=header_fingerprint(data) or b"")
            except BadBlockFile as exc:
                raise AssertionError(f"{stage}/{path.name} kept after a kill -9: {exc}") from None
            assert parsed[0] in known, f"{stage}/{path.name} holds no chat's block"
            assert len(data) == FILE_BYTES, path
            keys.add(parsed[0])
            total += len(data)
        assert len(keys) <= STAGE_BLOCKS and total <= STAGE_BLOCKS * FILE_BYTES, (stage, len(keys), total)
        held.append(keys)
    return held


def temporary_files(kv: Path) -> list[Path]:
    return [p for stage in STAGES for p in (kv / stage).glob(f"{TMP_PREFIX}*")]


def wait_for_release(kv: Path, timeout: float = 60.0) -> None:
    """Waits until the processes named in the stages' lock files (a killed server's
    stages, which Ray ends after their head died) are gone."""
    pids = [int(text) for stage in STAGES if (text := (kv / stage / LOCK_NAME).read_text().strip())]
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"the killed server's stages {pids} are still running"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_kill_9_a_second_server_and_the_bound_never_cost_a_wrong_answer_nor_leave_a_partial_file(
        setting: Setting, tmp_path: Path) -> None:
    reference = setting.reference
    kv = tmp_path / "kv"
    bound = STAGE_BLOCKS * 2 * FILE_BYTES + 100  # split between the stages by their files' sizes
    rng = random.Random(27)

    # 1. Server A, and server B on the same directory while A runs.
    a = serve(setting, kv, bound).wait_ready()
    b = serve(setting, kv, bound, "--stage-resource", setting.second)
    answers = {}
    try:
        for i in (0, 1):
            answers[i] = chat(a, i)
            assert answers[i]["token_ids"] == expected(reference, answers[i])
            assert len(answers[i]["prompt_token_ids"]) + ANSWER_TOKENS - 1 in range(3 * BLOCK, 4 * BLOCK)
        b.wait_ready()
        assert chat(b, 0)["token_ids"] == answers[0]["token_ids"]  # served, without the tier
        assert httpx.get(f"{b.base_url}/v1/cache", timeout=10).json()["kv_disk"] is None
        assert httpx.get(f"{a.base_url}/v1/cache", timeout=10).json()["kv_disk"] is not None
        owners = {int((kv / stage / LOCK_NAME).read_text()) for stage in STAGES}
        assert b.stop() == 0
        log = b.log()
        for stage in STAGES:
            assert f"{kv / stage} is in use by another bargein server (pid " in log, log
        assert "the pipeline runs without the disk tier" in log
        assert {int(p) for p in re.findall(r"another bargein server \(pid (\d+)\)", log)} <= owners

        # 2. kill -9 of A while its stages write chat 1's blocks (chat 2 evicts them).
        client = threading.Thread(target=lambda: _chat_until_killed(a, 2))
        client.start()
        time.sleep(rng.uniform(0.0, 0.1))
    finally:
        a.stop(signal.SIGKILL)
        b.stop(signal.SIGKILL)
    client.join(120)
    wait_for_release(kv)  # A's stages (Ray ends them once their head died): nothing writes now
    # Chat 2's blocks stay in the pool while it runs: only chats 0 and 1 can be on disk.
    known = {k for i in (0, 1) for k in block_keys(answers[i]["prompt_token_ids"] + answers[i]["token_ids"])}
    held = check_stage_files(kv, known)
    chain0 = block_keys(answers[0]["prompt_token_ids"] + answers[0]["token_ids"][:-1])
    on_both = next((n for n, key in enumerate(chain0) if not all(key in h for h in held)), len(chain0))

    # 3. Server C: the kill's temporary files go, chat 0 reads back exactly the leading
    # blocks of its prompt that both stages hold.
    c = serve(setting, kv, bound).wait_ready()
    try:
        assert not temporary_files(kv), c.log()
        assert httpx.get(f"{c.base_url}/v1/cache", timeout=10).json()["kv_disk"] is not None, c.log()
        again = [chat(c, i) for i in range(3)]
        prompt_blocks = (len(again[0]["prompt_token_ids"]) - 1) // BLOCK  # the last token is always computed
        assert again[0]["cached_tokens"] == min(on_both, prompt_blocks) * BLOCK  # memory was empty: from disk
        for i, answer in enumerate(again):
            assert answer["token_ids"] == expected(reference, answer), i
        assert again[0]["token_ids"] == answers[0]["token_ids"] and again[1]["token_ids"] == answers[1]["token_ids"]
        known |= set(block_keys(again[2]["prompt_token_ids"] + again[2]["token_ids"]))

        # 4. SIGTERM, then SIGKILL as soon as a stage's writer has a file open.
        c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not (writing := bool(temporary_files(kv))) and c.running and time.monotonic() < deadline:
            time.sleep(0.0005)
        time.sleep(rng.uniform(0.0, 0.01))
    finally:
        c.stop(signal.SIGKILL)
    wait_for_release(kv)
    check_stage_files(kv, known)
    assert on_both > 0, "chat 0's blocks were not on both stages: nothing was read back, the test checked nothing"
    print(f"chat 0: {on_both} blocks on both stages after the kill mid-answer; the kill at shutdown "
          f"{'caught a stage writing' if writing else 'came after the writes'}")


def _chat_until_killed(server: ServerProcess, i: int) -> None:
    with contextlib.suppress(httpx.HTTPError, AssertionError):  # killed mid-answer
        chat(server, i)
