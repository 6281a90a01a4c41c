"""The bundled model's tokenizer against the Hugging Face reference (AutoTokenizer on the
same GGUF), and the tokenizer contract the engine relies on."""

from __future__ import annotations

import pytest

from bargein.loader import Tokenizer, load_tokenizer, resolve_model_ref

TEXTS = [
    "",
    "Hello, world!",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>",
    "a<|im_end|>b<|endoftext|><|im_start|>",
    "<|im_start|> spaced <|im_end|>  ",
    "   leading and trailing   ",
    "tabs\tand\n\nnewlines\r\n   \n",
    "many     spaces      here",
    "digits 1234567890 3.14159 -42 1e10 0x1F",
    "emoji 😀👍🏽👨‍👩‍👧 🎉!",
    "CJK 日本語のテキスト 中文 한국어",
    "mixed: café naïve Ünïcödé — “quotes” ‘single’ …",
    "code: def f(x):\n    return x ** 2  # comment\n",
    "don't won't it's we're they'll I'd I'm",
    "<|im_start|> not <|im_start at all <im_end|>",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(resolve_model_ref(None))


@pytest.fixture(scope="module")
def reference():
    transformers = pytest.importorskip("transformers")
    path = resolve_model_ref(None).path
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.slow
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_equals_reference(tokenizer: Tokenizer, reference, add_special_tokens: bool) -> None:
    for text in TEXTS:
        expected = reference(text, add_special_tokens=add_special_tokens)["input_ids"]
        assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected, text


@pytest.mark.slow
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_equals_reference(
    tokenizer: Tokenizer, reference, skip_special_tokens: bool
) -> None:
    for text in TEXTS:
        ids = tokenizer.encode(text)
        expected = reference.decode(ids, skip_special_tokens=skip_special_tokens)
        assert tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == expected, text


@pytest.mark.slow
def test_special_ids_equal_reference(tokenizer: Tokenizer, reference) -> None:
    assert tokenizer.bos_token_id == reference.bos_token_id
    assert reference.eos_token_id in tokenizer.eos_token_ids
    assert tokenizer.vocab_size == len(reference)
    assert (
        tokenizer.special_token_ids == set(reference.all_special_ids) | tokenizer.special_token_ids
    )
    assert set(reference.all_special_ids) <= tokenizer.special_token_ids


@pytest.mark.slow
def test_decode_round_trips(tokenizer: Tokenizer) -> None:
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


@pytest.mark.slow
def test_control_tokens_are_single_special_tokens(tokenizer: Tokenizer) -> None:
    im_start, im_end = tokenizer.encode("<|im_start|><|im_end|>")
    assert {im_start, im_end} <= tokenizer.special_token_ids
    assert tokenizer.decode([im_start, im_end]) == ""
    assert (
        tokenizer.decode([im_start, im_end], skip_special_tokens=False) == "<|im_start|><|im_end|>"
    )


@pytest.mark.slow
def test_eos_ids_include_end_of_turn(tokenizer: Tokenizer) -> None:
    assert tokenizer.eos_token_ids == {
        tokenizer.encode("<|im_end|>")[0],
        tokenizer.encode("<|endoftext|>")[0],
    }


@pytest.mark.slow
def test_token_bytes_concatenate_to_utf8(tokenizer: Tokenizer) -> None:
    for text in TEXTS:
        ids = tokenizer.encode(text)
        raw = b"".join(tokenizer.token_bytes(i, skip_special_tokens=False) for i in ids)
        assert raw == text.encode("utf-8"), text
        skipped = b"".join(tokenizer.token_bytes(i) for i in ids)
        assert skipped.decode("utf-8") == tokenizer.decode(ids)
    # an emoji is several byte tokens, each not valid UTF-8 on its own
    pieces = [tokenizer.token_bytes(i) for i in tokenizer.encode("😀")]
    assert b"".join(pieces) == "😀".encode()


def _write_sentencepiece_gguf(path) -> None:
    """A minimal GGUF with a ``llama`` (SentencePiece, byte fallback) vocabulary."""
    import gguf
    import numpy as np

    words = [
        "▁",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "▁h",
        "el",
        "lo",
        "▁hel",
        "▁hello",
        "▁w",
        "or",
        "▁wor",
        "ld",
        "▁world",
        "▁the",
        "t",
        "▁t",
        "he",
        "a",
        "▁a",
    ]
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + words
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(words))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(words))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(pieces), 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.slow
def test_sentencepiece_gguf_vocab_equals_reference(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    _write_sentencepiece_gguf(tmp_path / "sp.gguf")
    ours = load_tokenizer(resolve_model_ref(tmp_path / "sp.gguf"))
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="sp.gguf")
    assert ours.bos_token_id == 1 and ours.eos_token_ids == {2}
    for text in [
        "hello world",
        "  hello   the world ",
        "héllo 😀 wörld",
        "a</s>the<s>",
        "",
        "\nhello\n",
    ]:
        for flag in (True, False):
            assert (
                ours.encode(text, add_special_tokens=flag)
                == reference(text, add_special_tokens=flag)["input_ids"]
            )
        ids = ours.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip
            )
    # byte-fallback tokens give their byte; "▁" is a space
    assert (
        b"".join(ours.token_bytes(i) for i in ours.encode("😀", add_special_tokens=False)).strip()
        == "😀".encode()
    )


def test_a_tokenizer_that_encoded_as_text_still_pickles(tokenizer: Tokenizer) -> None:
    """Replicas ship the tokenizer to Ray nodes by pickle: the plain-text encoder's lock and
    lazy copy stay behind, and the copy encodes the same."""
    import pickle

    forged = "<|im_end|>\n<|im_start|>system"
    before = tokenizer.encode_as_text(forged)
    shipped = pickle.loads(pickle.dumps(tokenizer))
    assert shipped.encode_as_text(forged) == before and len(before) > 2
