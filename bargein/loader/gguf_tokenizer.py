"""Tokenizers from a GGUF file's vocabulary, as transformers builds them for the same file.

``gpt2`` is byte-level BPE with the file's merges, ``llama`` SentencePiece-style BPE with
byte fallback and merges recovered from the scores (or the file's merges). Tokens the file
marks as control become special tokens, so ``<|im_start|>`` stays one token.

Start-up builds this once per load from a 49k vocabulary and 49k merges: the arrays are
decoded whole (:meth:`~bargein.loader.gguf_parse.StringArray.decoded`), the merges split
into pairs in a few calls over their joined bytes (:func:`merge_pairs`) and the marked
tokens found with numpy, rather than by a Python step per item.
"""

from __future__ import annotations

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from bargein.loader.byte_alphabet import bytes_to_unicode, in_byte_alphabet
from bargein.loader.errors import CorruptModelError, UnsupportedModelError
from bargein.loader.gguf_file import GGUFFile
from bargein.loader.gguf_parse import StringArray
from bargein.loader.tokenizer import Tokenizer, bos_eos_processor

# GGUF token types (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4
# Pre-tokenizer splits for GGUF ``tokenizer.ggml.pre`` values whose merges were learned on
# them (as transformers chooses them); other values use the GPT-2 regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}


def tokenizer_from_gguf(f: GGUFFile) -> Tokenizer:
    kind = f.get("tokenizer.ggml.model")
    tokens = f.strings("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise CorruptModelError(
            f"{f.path}: no tokenizer in the metadata (tokenizer.ggml.model/tokens)"
        )
    types = f.array("tokenizer.ggml.token_type")
    if kind == "gpt2":
        backend = _gguf_byte_level(f, tokens)
        add_bos_default = False
    elif kind == "llama":
        backend = _gguf_sentencepiece(f, tokens)
        add_bos_default = True
    else:
        raise UnsupportedModelError(
            f"{f.path}: tokenizer model {kind!r} is not supported (gpt2, llama)"
        )
    _add_marked_tokens(backend, tokens, types, byte_level=kind == "gpt2")

    def token(key: str) -> str | None:
        index = f.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(f.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(f.get("tokenizer.ggml.add_eos_token", False))
    backend.post_processor = bos_eos_processor(
        backend, bos if add_bos else None, eos if add_eos else None
    )
    return Tokenizer(
        backend=backend,
        byte_level=kind == "gpt2",
        bos_token=bos,
        eos_token=eos,
        chat_template=f.get("tokenizer.chat_template"),
    )


def _gguf_byte_level(f: GGUFFile, tokens: list[str]) -> HFTokenizer:
    unicode_of = bytes_to_unicode()
    # a token outside the byte alphabet is respelled byte by byte (as transformers does);
    # usually none is, which one search over all of them finds quickly
    if in_byte_alphabet("".join(tokens)):
        vocab = dict(zip(tokens, range(len(tokens)), strict=True))
    else:
        vocab = {
            (t if in_byte_alphabet(t) else "".join(unicode_of[b] for b in t.encode("utf-8"))): i
            for i, t in enumerate(tokens)
        }
    merges_text = f.string_array("tokenizer.ggml.merges")
    if merges_text is None:
        raise CorruptModelError(f"{f.path}: a gpt2 tokenizer needs tokenizer.ggml.merges")
    merges = merge_pairs(merges_text)
    backend = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = _PRE_SPLITS.get(f.get("tokenizer.ggml.pre", ""))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _gguf_sentencepiece(f: GGUFFile, tokens: list[str]) -> HFTokenizer:
    scores = f.floats("tokenizer.ggml.scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges_text = f.string_array("tokenizer.ggml.merges")
    if merges_text is not None:
        merges = merge_pairs(merges_text)
    elif scores is not None:
        merges = _merges_from_scores(vocab, dict(zip(tokens, scores, strict=False)))
    else:
        raise CorruptModelError(
            f"{f.path}: a llama tokenizer needs tokenizer.ggml.scores or merges"
        )
    unk = f.get("tokenizer.ggml.unknown_token_id")
    backend = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            fuse_unk=True,
            byte_fallback=True,
            unk_token=tokens[int(unk)] if unk is not None else None,
        )
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first", split=False
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges implied by a vocabulary: every split of a token into two
    tokens, best-scored merged token first (the order transformers derives them in)."""
    found: list[tuple[str, str, float]] = []
    for merged, score in scores.items():
        local = [
            (merged[:k], merged[k:], score)
            for k in range(1, len(merged))
            if merged[:k] in vocab and merged[k:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def merge_pairs(merges: StringArray) -> list[tuple[str, ...]]:
    """Each merge ``"left right"`` decoded (invalid UTF-8 replaced) and split at its first
    space: ``tuple(m.split(" ", 1))`` of each (a merge without a space stays a 1-tuple,
    which the BPE model refuses).

    Where every merge holds exactly one space (every vocabulary seen), the whole array is
    decoded and split in a few calls over its NUL-joined bytes
    (:meth:`StringArray.joined_bytes`) instead of a decode and a split per merge.
    """
    joined = merges.joined_bytes() if len(merges) else None
    text = merges.joined_text(joined) if joined is not None and _one_space_each(joined) else None
    if text is not None:
        parts = text.replace(" ", "\0").split("\0")  # left, right, left, right, ...
        return list(zip(parts[0::2], parts[1::2], strict=True))
    return [tuple(m.split(" ", 1)) for m in merges.decoded(errors="replace")]


def _one_space_each(joined: bytes) -> bool:
    """Whether every item of ``joined`` (each after a NUL) holds exactly one space: its
    spaces and NULs, in order, alternate from the leading NUL. A byte-level check (in
    UTF-8 neither byte is part of another character), a pass of numpy where putting the
    pairs back together and comparing took 10 ms of a 49k-merge load."""
    marks = np.frombuffer(joined, dtype=np.uint8)
    marks = marks[(marks == 0) | (marks == 32)]
    return len(marks) % 2 == 0 and not marks[0::2].any() and bool((marks[1::2] == 32).all())


def _add_marked_tokens(
    backend: HFTokenizer, tokens: list[str], types: np.ndarray | None, *, byte_level: bool
) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens
    (``types``: the file's token types; None or empty: all normal).

    In a byte-level vocabulary a "control" token spelled outside the byte alphabet is a
    llama.cpp mislabel; it is not added (transformers skips it too).
    """
    if types is None or len(types) == 0:
        return
    types = types[:len(tokens)]  # a longer list of types: the tokens' own (as zip pairs them)
    control = [
        AddedToken(t, normalized=False, special=True)
        for t in (tokens[i] for i in np.flatnonzero(types == _CONTROL).tolist())
        if not byte_level or in_byte_alphabet(t)
    ]
    if control:
        backend.add_special_tokens(control)
    user_defined = [tokens[i] for i in np.flatnonzero(types == _USER_DEFINED).tolist()]
    if not user_defined:  # most vocabularies: no need for the whole vocabulary as a dict
        return
    vocab = backend.get_vocab()
    user = [AddedToken(t, normalized=False, special=False) for t in user_defined if t in vocab]
    if user:
        backend.add_tokens(user)
