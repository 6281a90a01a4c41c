"""``Conversation.save`` files carry the model's fingerprint (its files' digest), the disk
tier's fingerprint and a format version; ``Conversation.load`` refuses another model's
file with a clear error, and still reads a version-1 file (checked by model name).
Tiny random-weight model, CPU."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bargein.engine.async_engine import AsyncEngine
from bargein.engine.conversation import Conversation, ConversationFileMismatch
from bargein.engine.kv_disk.fingerprint import files_digest
from tests.engine.test_kv_disk_engine import disk_engine
from tests.tiny_engine import prompt


def saved_conversation(tmp_path: Path) -> tuple[Path, list[int], str]:
    """A conversation of one prompt saved by an engine with the tier: (file, tokens, kv digest)."""
    path, tokens = tmp_path / "conversation.json", prompt(9, 60)

    async def run() -> str:
        ae = AsyncEngine(disk_engine(tmp_path / "kv", identity="tiny-seed-0")).start()
        conv = Conversation.open(ae, tokens)
        await conv.save(path)
        kv = ae.engine.disk.tier.fingerprint.digest.hex()
        await conv.close()
        await ae.shutdown()
        return kv

    return path, tokens, asyncio.run(run())


def load(path: Path | dict, identity: str, tier: Path | None = None) -> list[int]:
    async def run() -> list[int]:
        ae = AsyncEngine(disk_engine(tier, identity=identity)).start()
        try:
            conv = Conversation.load(ae, path if isinstance(path, Path) else _write(path))
            return await conv.tokens()
        finally:
            await ae.shutdown()

    return asyncio.run(run())


def _write(data: dict) -> Path:
    path = Path(data.pop("_path"))
    path.write_text(json.dumps(data))
    return path


def test_a_saved_file_carries_the_fingerprints_and_another_models_is_refused(tmp_path: Path) -> None:
    path, tokens, kv = saved_conversation(tmp_path)
    data = json.loads(path.read_text())
    assert data == {"version": 2, "model": "tiny", "model_fingerprint": files_digest((("id", 0, "tiny-seed-0"),)),
                    "kv_fingerprint": kv, "token_ids": tokens}
    # The same model without a tier (another kv fingerprint) or with one: loaded.
    assert load(path, "tiny-seed-0") == tokens
    assert load(path, "tiny-seed-0", tmp_path / "kv") == tokens
    with pytest.raises(ConversationFileMismatch, match="saved with another model .*'tiny', fingerprint "
                                                       f"{data['model_fingerprint'][:16]}"):
        load(path, "tiny-seed-1")  # same name, other weights


def test_older_and_unreadable_files(tmp_path: Path) -> None:
    tokens = prompt(5, 61)
    version1 = {"_path": str(tmp_path / "v1.json"), "version": 1, "model": "tiny", "token_ids": tokens}
    assert load(version1, "tiny-seed-0") == tokens  # no fingerprint: checked by name
    with pytest.raises(ConversationFileMismatch, match="saved with model 'other', not 'tiny'"):
        load({**version1, "_path": str(tmp_path / "v1b.json"), "model": "other"}, "tiny-seed-0")
    with pytest.raises(ValueError, match="format version 99; this bargein reads 1, 2"):
        load({**version1, "_path": str(tmp_path / "v99.json"), "version": 99}, "tiny-seed-0")
    (tmp_path / "junk.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a usable bargein conversation file"):
        load(tmp_path / "junk.json", "tiny-seed-0")
