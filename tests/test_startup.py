"""Start-up: what the server computes at start equals the slow definitions it replaces,
and loading leaves torch's thread count as it found it."""

from __future__ import annotations

import contextlib

import torch

from bargein.engine.device import one_torch_thread
from bargein.loader import load_tokenizer, resolve_model_ref
from tests.tiny_models import TinySpec, tiny_weights, write_gguf


def slow_max_piece_bytes(tokenizer) -> int:
    longest = 1
    for token_id in range(tokenizer.vocab_size):
        with contextlib.suppress(ValueError):
            longest = max(longest, len(tokenizer.token_bytes(token_id, skip_special_tokens=False)))
    return longest


def test_max_piece_bytes_from_the_vocabulary_equals_token_by_token(tmp_path) -> None:
    bundled = load_tokenizer(resolve_model_ref(None))
    tiny = load_tokenizer(resolve_model_ref(write_gguf(tmp_path / "tiny.gguf", TinySpec(), tiny_weights(TinySpec()))))
    for tokenizer in (bundled, tiny):
        assert tokenizer.max_piece_bytes == slow_max_piece_bytes(tokenizer)


def test_one_torch_thread_restores_the_count() -> None:
    before = torch.get_num_threads()
    with one_torch_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
