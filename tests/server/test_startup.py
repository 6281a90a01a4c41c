"""Start-up: what the server computes at start equals the slow definitions it replaces,
and loading leaves torch's thread count as it found it."""

from __future__ import annotations

import contextlib
import gc
import subprocess
import sys
import threading
import weakref

import pytest
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


def _write_byte_level_gguf(path) -> list[str]:
    """A gpt2 (byte-level) vocabulary as llama.cpp may write one: besides pieces in GPT-2's
    byte alphabet, pieces spelled in plain UTF-8 (respelled on load), a duplicate, a control
    token outside the alphabet (not added) and user-defined tokens (added where the
    vocabulary has them as spelled: ``<user>`` is, ``€`` is not)."""
    import gguf
    import numpy as np

    from bargein.loader.tokenizer import bytes_to_unicode

    byte_chars = list(bytes_to_unicode().values())
    tokens = byte_chars + ["Ġh", "Ġhe", "ll", "llo", "Ġhello", "€uro", "<|im_start|>", "<|im_end|>", "<ctrl€>",
                           "Ġhello", "<user>", "€"]
    types = [1] * (len(byte_chars) + 6) + [3, 3, 3, 1, 4, 4]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["Ġ h", "Ġh e", "l l", "ll o", "Ġhe llo"])
    writer.add_bos_token_id(len(byte_chars) + 6)
    writer.add_eos_token_id(len(byte_chars) + 7)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tokens


def test_max_piece_bytes_equals_token_by_token_for_every_kind_of_piece(tmp_path) -> None:
    from tests.model.test_tokenizer import _write_sentencepiece_gguf

    _write_sentencepiece_gguf(tmp_path / "sp.gguf")
    _write_byte_level_gguf(tmp_path / "bl.gguf")
    for name in ("sp.gguf", "bl.gguf"):
        tokenizer = load_tokenizer(resolve_model_ref(tmp_path / name))
        assert tokenizer.max_piece_bytes == slow_max_piece_bytes(tokenizer), name


def test_byte_level_vocabulary_is_what_the_token_by_token_definition_gives(tmp_path) -> None:
    """The start-up's fast paths (one alphabet search over all pieces, no vocabulary dict
    unless user-defined tokens need it) give the vocabulary and added tokens of the
    definition: a piece outside the byte alphabet respelled byte by byte, a later
    duplicate winning, a control token outside the alphabet left out, a user-defined token
    added only where the vocabulary has it."""
    from bargein.loader.tokenizer import bytes_to_unicode

    tokens = _write_byte_level_gguf(tmp_path / "bl.gguf")
    tokenizer = load_tokenizer(resolve_model_ref(tmp_path / "bl.gguf"))
    alphabet, unicode_of = set(bytes_to_unicode().values()), bytes_to_unicode()
    expected = {(t if set(t) <= alphabet else "".join(unicode_of[b] for b in t.encode("utf-8"))): i
                for i, t in enumerate(tokens)}
    got = tokenizer.backend.get_vocab(with_added_tokens=True)
    assert got == expected
    added = {t.content: t.special for t in tokenizer.backend.get_added_tokens_decoder().values()}
    assert added == {"<|im_start|>": True, "<|im_end|>": True, "<user>": False}
    ids = tokenizer.encode("<|im_start|> hello<user>€", add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(i, skip_special_tokens=False) for i in ids) == \
        "<|im_start|> hello<user>€".encode()


def test_serve_imports_no_http_client() -> None:
    """`bargein serve` builds every command's arguments; none of them imports httpx (with
    rich and click, ~0.1 s of its start-up): the client commands import it when they run."""
    code = ("import sys, bargein.cli; bargein.cli.build_parser().parse_args(['serve']); "
            "print(sorted(m for m in ('httpx', 'rich', 'click') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_collection_is_paused_inside_and_restored_after_even_on_failure() -> None:
    from bargein.cli import main
    from bargein.startup import collection_paused

    assert gc.isenabled()
    with pytest.raises(RuntimeError), collection_paused():
        assert not gc.isenabled()
        raise RuntimeError("a failed start")
    assert gc.isenabled()
    gc.disable()
    try:
        with collection_paused():
            pass
        assert not gc.isenabled()  # left as it was found
    finally:
        gc.enable()
    assert main(["serve", "--port", "0", "--model", "/no/such/model.gguf"]) == 2  # a missing model: usage
    assert gc.isenabled()


def test_in_background_returns_the_value_or_raises_the_error_in_the_waiting_thread() -> None:
    from bargein.startup import InBackground

    ran_on: list[threading.Thread] = []

    def work() -> int:
        ran_on.append(threading.current_thread())
        return 42

    assert InBackground(work, "t").result() == 42
    assert ran_on[0] is not threading.current_thread() and ran_on[0].daemon

    def fail() -> int:
        raise ValueError("no model here")

    with pytest.raises(ValueError, match="no model here"):
        InBackground(fail, "t").result()


def test_settle_heap_collects_the_garbage_and_freezes_what_lives() -> None:
    from bargein.startup import collection_paused, settle_heap

    class Node:
        pass

    garbage, alive = Node(), Node()
    garbage.self = garbage  # a cycle: only the collector frees it
    gone = weakref.ref(garbage)
    del garbage
    try:
        with collection_paused():
            settle_heap()
            assert gone() is None
            assert not any(o is alive for o in gc.get_objects())  # frozen: in no generation the collector walks
    finally:
        gc.unfreeze()
    assert any(o is alive for o in gc.get_objects())
