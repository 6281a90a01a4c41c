"""IncrementalDetokenizer: UTF-8-safe streaming, stop strings, nothing after a stop."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bargein.engine.detokenizer import IncrementalDetokenizer
from bargein.loader import Tokenizer, load_tokenizer, resolve_model_ref
from tests.tiny_models import TinySpec, tiny_weights, write_gguf


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The tiny byte-level tokenizer: every byte is a token, so characters split easily."""
    spec = TinySpec(num_layers=1)
    path = write_gguf(tmp_path_factory.mktemp("detok") / "tiny.gguf", spec, tiny_weights(spec))
    return load_tokenizer(resolve_model_ref(path))


def byte_ids(tok: Tokenizer, text: str) -> list[int]:
    """One token per byte (what a model may well sample for rare characters)."""
    ids = []
    for b in text.encode("utf-8"):
        matches = [i for i in range(tok.vocab_size) if tok.token_bytes(i) == bytes([b])]
        ids.append(matches[0])
    return ids


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(i) for i in ids] + [detok.flush()]


def test_split_characters_never_show_replacement_chars(tok: Tokenizer) -> None:
    text = "a😀b日本語🎉 ok"
    ids = byte_ids(tok, text)
    assert len(ids) == len(text.encode())
    detok = IncrementalDetokenizer(tok)
    chunks = stream(detok, ids)
    assert all("\ufffd" not in c for c in chunks)
    assert chunks[1:5] == ["", "", "", "😀"]  # the emoji's four byte tokens release it once
    assert "".join(chunks) == detok.text == tok.decode(ids) == text


@settings(max_examples=40, deadline=None)
@given(text=st.text(max_size=40))
def test_stream_equals_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    chunks = stream(detok, ids)
    assert "".join(chunks) == detok.text == tok.decode(ids)
    if "\ufffd" not in text:
        assert all("\ufffd" not in c for c in chunks)


def test_invalid_bytes_at_the_end_become_replacement_chars_like_decode(tok: Tokenizer) -> None:
    ids = byte_ids(tok, "ok😀")[:-2]  # the emoji cut in half
    detok = IncrementalDetokenizer(tok)
    chunks = stream(detok, ids)
    assert chunks[:-1] == ["o", "k", "", ""]
    assert detok.text == tok.decode(ids) == "ok\ufffd"


def test_stop_string_spanning_tokens(tok: Tokenizer) -> None:
    ids = byte_ids(tok, "Hello STOP after")
    detok = IncrementalDetokenizer(tok, stop=["STOP"])
    chunks = stream(detok, ids)
    assert detok.stop_matched == "STOP"
    assert detok.text == "".join(chunks) == "Hello "
    assert "S" not in "".join(chunks)


def test_nothing_after_a_stop_is_released(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=["\n\n"])
    released = [detok.push(i) for i in tok.encode("one\n\ntwo three")]
    released += [detok.push(i) for i in tok.encode("more text")] + [detok.flush()]
    assert "".join(released) == detok.text == "one"
    assert detok.finished


def test_possible_stop_prefix_is_held_back(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=["</answer>"])
    assert "".join(detok.push(i) for i in byte_ids(tok, "x</ans")) == "x"
    assert "".join(detok.push(i) for i in byte_ids(tok, "Z")) == "</ansZ"  # not a stop after all
    assert "".join(detok.push(i) for i in byte_ids(tok, "</")) == ""
    assert detok.flush() == "</"  # finish without a stop: the held text is released
    assert detok.text == "x</ansZ</" and detok.stop_matched is None


def test_earliest_stop_wins(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=["cd", "bcx", "abcz"])
    stream(detok, byte_ids(tok, "abcde"))
    assert (detok.text, detok.stop_matched) == ("ab", "cd")


def test_overlapping_stop_prefixes(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=["abab"])
    stream(detok, byte_ids(tok, "xabaabab!"))
    assert (detok.text, detok.stop_matched) == ("xaba", "abab")


def test_multibyte_stop_string(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=["日本"])
    chunks = stream(detok, byte_ids(tok, "中日本語"))
    assert all("\ufffd" not in c for c in chunks)
    assert (detok.text, detok.stop_matched) == ("中", "日本")


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    ids = tok.encode("hi<|im_end|>there")
    skipped = IncrementalDetokenizer(tok)
    stream(skipped, ids)
    assert skipped.text == tok.decode(ids) == "hithere"
    kept = IncrementalDetokenizer(tok, stop=["<|im_end|>"], skip_special_tokens=False)
    stream(kept, ids)
    assert (kept.text, kept.stop_matched) == ("hi", "<|im_end|>")


def test_empty_stop_string_is_refused(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tok, stop=["x", ""])


@pytest.mark.slow
def test_bundled_tokenizer_stream_equals_decode() -> None:
    tok = load_tokenizer(resolve_model_ref(None))
    text = "Sure! 😀 日本語 — café\n\n```py\nprint('hi')\n```"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    chunks = stream(detok, ids)
    assert all("\ufffd" not in c for c in chunks)
    assert detok.text == tok.decode(ids) == text
