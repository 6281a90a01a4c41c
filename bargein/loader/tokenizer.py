"""Tokenizers built on Hugging Face ``tokenizers``: from tokenizer.json or from a GGUF vocabulary.

The GGUF builders follow what transformers does for the same file (the test oracle), so
token ids match it: ``gpt2`` is byte-level BPE with the file's merges, ``llama`` is
SentencePiece-style BPE with byte fallback and merges recovered from the scores. Tokens
the file marks as control become special tokens, so ``<|im_start|>`` stays one token.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from bargein.loader.byte_alphabet import (
    BYTE_OF_CHAR,
    bytes_to_unicode,
    in_byte_alphabet,
    is_byte_piece,
)
from bargein.loader.chat_template import render_chat_template
from bargein.loader.encoding import (
    PlainTextEncoder,
    UnencodableTextError,  # noqa: F401  (its import path before encoding.py)
    encode_one,
)
from bargein.loader.errors import CorruptModelError, UnsupportedModelError
from bargein.loader.gguf_file import GGUFFile, open_gguf
from bargein.loader.source import ModelSource

# Tokens that end a turn in common chat formats; generation stops on those that are special.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<end_of_turn>",
)

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


@dataclass
class Tokenizer:
    """Text <-> token ids, plus what generation and chat need from the tokenizer.

    ``encode`` and ``decode`` equal the Hugging Face reference tokenizer for the same
    model. ``eos_token_ids`` holds the declared EOS plus end-of-turn special tokens, so a
    chat answer stops at its end-of-turn marker. ``token_bytes`` gives the raw bytes a
    token stands for, for incremental (UTF-8-safe) detokenizing.
    """

    backend: HFTokenizer
    byte_level: bool  # pieces spelled in GPT-2's byte alphabet (else SentencePiece "▁"/<0xNN>)
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None
    extra_eos_ids: Iterable[int] = ()
    _bytes_cache: dict[int, bytes] = field(default_factory=dict, repr=False)
    _plain_text: PlainTextEncoder = field(init=False, repr=False)

    def __post_init__(self) -> None:
        added = self.backend.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        # The texts ``encode`` turns into control tokens (``encode_as_text`` does not): special
        # ones, and markers (added tokens decoding keeps: Qwen's ``<tool_call>``, ``<think>``).
        self.special_texts: tuple[str, ...] = tuple(t.content for t in added.values() if t.special)
        self.marker_texts: tuple[str, ...] = tuple(t.content for t in added.values() if not t.special)
        self._plain_text = PlainTextEncoder(self.backend)
        self._added_ids = frozenset(added)
        self.vocab_size: int = self.backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = self._id_of(self.bos_token)
        eos = {self._id_of(self.eos_token), *self.extra_eos_ids}
        eos |= {i for i in map(self._id_of, END_OF_TURN_TOKENS) if i in self.special_token_ids}
        self.eos_token_ids: frozenset[int] = frozenset(i for i in eos if i is not None)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids; special tokens written in ``text`` become their single ids. Off the
        GIL while it works; ``UnencodableTextError`` for text that is not valid Unicode
        (``encoding.encode_one``)."""
        return encode_one(self.backend, text, add_special_tokens=add_special_tokens)

    def encode_as_text(self, text: str, *, keep_markers: bool = False) -> list[int]:
        """Token ids of ``text`` as plain text, no BOS/EOS: an added token's text written in it
        (a user typing ``<|im_end|>`` or ``<tool_call>``) becomes the tokens that spell it,
        never the control token (``encoding.PlainTextEncoder``). ``keep_markers``: only
        special tokens are spelled; markers stay one token (the model's own answer, repeated
        in a history). Same errors as ``encode``."""
        return self._plain_text.encode(text, keep_markers=keep_markers)

    def at_least_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text, add_special_tokens=False))``, without encoding.

        No token covers more bytes than the longest piece of the vocabulary, so a text of
        b bytes has at least ``ceil(b / max_piece_bytes)`` tokens: a server can refuse a
        prompt that cannot fit the context from its size alone, in microseconds, instead of
        tokenizing megabytes first. 0 (no bound) when the tokenizer normalizes the text
        first, since a normalizer may shorten it.
        """
        if self.backend.normalizer is not None or not text:
            return 0
        return -(-len(text.encode("utf-8", errors="surrogatepass")) // self.max_piece_bytes)

    @functools.cached_property
    def max_piece_bytes(self) -> int:
        """The most bytes of text one token stands for (special tokens included).

        From the vocabulary in one pass: the lengths :meth:`token_bytes` gives, counted
        without building each token's bytes (a piece in the byte alphabet has one byte per
        character; a SentencePiece "▁" is three bytes of UTF-8 for one space), which at
        a 49k vocabulary's start-up is ~1 s less than asking the backend token by token
        and ~60 ms less than building the bytes."""
        vocab = self.backend.get_vocab(with_added_tokens=True)
        lengths = [len(piece.encode("utf-8")) for piece, i in vocab.items() if i in self._added_ids]
        plain = [piece for piece, i in vocab.items() if i not in self._added_ids]
        if not self.byte_level:
            lengths += [1 if is_byte_piece(p) else len(p.encode("utf-8")) - 2 * p.count("▁") for p in plain]
        elif in_byte_alphabet("".join(plain)):  # usually: one search instead of one per piece
            lengths.append(max(map(len, plain), default=1))
        else:
            lengths += [len(p) if in_byte_alphabet(p) else len(p.encode("utf-8")) for p in plain]
        return max(lengths, default=1) or 1

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int, *, skip_special_tokens: bool = True) -> bytes:
        """The raw UTF-8 bytes of one token (may be part of a character).

        Special tokens give b"" when skipped and their text otherwise. For SentencePiece
        vocabularies "▁" is a space, including at the start of the text (decode strips
        that one leading space; a continuation keeps it).
        """
        if token_id in self.special_token_ids and skip_special_tokens:
            return b""
        cached = self._bytes_cache.get(token_id)
        if cached is None:
            cached = self._bytes_cache[token_id] = self._piece_bytes(token_id)
        return cached

    def _piece_bytes(self, token_id: int) -> bytes:
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is out of range (vocab size {self.vocab_size})")
        return self._bytes_of(piece, token_id)

    def _bytes_of(self, piece: str, token_id: int) -> bytes:
        if token_id in self._added_ids:
            return piece.encode("utf-8")
        if self.byte_level:
            if in_byte_alphabet(piece):
                return bytes(BYTE_OF_CHAR[c] for c in piece)
            return piece.encode("utf-8")
        if is_byte_piece(piece):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("▁", " ").encode("utf-8")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[Any] | None = None,
        **extra: Any,
    ) -> str:
        """Render the model's chat template (raises ChatTemplateError if it has none)."""
        specials = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **{**specials, **extra},
        )


def load_tokenizer(source: ModelSource) -> Tokenizer:
    """The tokenizer of a model source (GGUF metadata or the folder's tokenizer.json)."""
    if source.kind == "gguf":
        return tokenizer_from_gguf(open_gguf(source.path))
    return tokenizer_from_folder(source.path)


# ---------------------------------------------------------------- GGUF


def tokenizer_from_gguf(f: GGUFFile) -> Tokenizer:
    kind = f.get("tokenizer.ggml.model")
    tokens = f.strings("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise CorruptModelError(
            f"{f.path}: no tokenizer in the metadata (tokenizer.ggml.model/tokens)"
        )
    types = f.ints("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        backend = _gguf_byte_level(f, tokens, types)
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
    backend.post_processor = _bos_eos_processor(
        backend, bos if add_bos else None, eos if add_eos else None
    )
    return Tokenizer(
        backend=backend,
        byte_level=kind == "gpt2",
        bos_token=bos,
        eos_token=eos,
        chat_template=f.get("tokenizer.chat_template"),
    )


def _gguf_byte_level(f: GGUFFile, tokens: list[str], types: list[int]) -> HFTokenizer:
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
    merges_text = f.strings("tokenizer.ggml.merges")
    if merges_text is None:
        raise CorruptModelError(f"{f.path}: a gpt2 tokenizer needs tokenizer.ggml.merges")
    merges = [tuple(m.split(" ", 1)) for m in merges_text]
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
    merges_text = f.strings("tokenizer.ggml.merges")
    if merges_text is not None:
        merges = [tuple(m.split(" ", 1)) for m in merges_text]
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


def _add_marked_tokens(
    backend: HFTokenizer, tokens: list[str], types: list[int], *, byte_level: bool
) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens.

    In a byte-level vocabulary a "control" token spelled outside the byte alphabet is a
    llama.cpp mislabel; it is not added (transformers skips it too).
    """
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(tokens, types, strict=False)
        if ty == _CONTROL and (not byte_level or in_byte_alphabet(t))
    ]
    if control:
        backend.add_special_tokens(control)
    user_defined = [t for t, ty in zip(tokens, types, strict=False) if ty == _USER_DEFINED]
    if not user_defined:  # most vocabularies: no need for the whole vocabulary as a dict
        return
    vocab = backend.get_vocab()
    user = [AddedToken(t, normalized=False, special=False) for t in user_defined if t in vocab]
    if user:
        backend.add_tokens(user)


def _bos_eos_processor(
    backend: HFTokenizer, bos: str | None, eos: str | None
) -> processors.TemplateProcessing:
    """Post-processor that wraps each sequence in ``bos`` / ``eos`` (either may be None)."""

    def wrap(sequence: str, type_id: int) -> str:
        parts = [f"{bos}:{type_id}"] if bos else []
        parts.append(f"${sequence}:{type_id}")
        return " ".join(parts + ([f"{eos}:{type_id}"] if eos else []))

    specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    return processors.TemplateProcessing(
        single=wrap("A", 0), pair=f"{wrap('A', 0)} {wrap('B', 1)}", special_tokens=specials
    )


# ---------------------------------------------------------------- Hugging Face folders


def tokenizer_from_folder(folder: Path) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise CorruptModelError(
            f"{folder}: no tokenizer.json (bargein reads only the fast tokenizer format)"
        )
    try:
        backend = HFTokenizer.from_file(str(path))
    except Exception as exc:
        raise CorruptModelError(f"{path}: not a readable tokenizer ({exc})") from exc
    config = _read_optional_json(folder / "tokenizer_config.json")
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    if "add_bos_token" in config or "add_eos_token" in config:
        # an explicit flag overrides tokenizer.json's post-processor (as transformers does)
        backend.post_processor = _bos_eos_processor(
            backend,
            bos if config.get("add_bos_token") else None,
            eos if config.get("add_eos_token") else None,
        )
    generation = _read_optional_json(folder / "generation_config.json")
    extra = generation.get("eos_token_id")
    extra_ids = extra if isinstance(extra, list) else [extra] if isinstance(extra, int) else []
    return Tokenizer(
        backend=backend,
        byte_level=_is_byte_level(backend),
        bos_token=bos,
        eos_token=eos,
        chat_template=_folder_chat_template(folder, config),
        extra_eos_ids=extra_ids,
    )


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptModelError(f"{path}: not valid JSON ({exc})") from exc


def _token_text(value: Any) -> str | None:
    """tokenizer_config writes special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _folder_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja, then chat_template.json, then tokenizer_config.json's entry."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = _read_optional_json(folder / "chat_template.json").get("chat_template")
    template = template or config.get("chat_template")
    if isinstance(template, list):  # named templates: use "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _is_byte_level(backend: HFTokenizer) -> bool:
    if backend.decoder is None:
        return False
    decoder = json.loads(backend.decoder.__getstate__())
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(p.get("type") == "ByteLevel" for p in parts)
