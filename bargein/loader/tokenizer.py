"""Tokenizers built on Hugging Face ``tokenizers``: the :class:`Tokenizer` and its loading
from a Hugging Face folder's tokenizer.json (a GGUF's vocabulary: gguf_tokenizer.py).

Built to match what transformers does for the same model (the test oracle), so token ids
match it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from bargein.loader.byte_alphabet import (
    BYTE_OF_CHAR,
    bytes_to_unicode,  # noqa: F401  (imported from here by callers)
    in_byte_alphabet,
    is_byte_piece,
)
from bargein.loader.chat_template import render_chat_template
from bargein.loader.encoding import (
    PlainTextEncoder,
    UnencodableTextError,  # noqa: F401  (its import path before encoding.py)
    encode_one,
)
from bargein.loader.errors import CorruptModelError

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


def bos_eos_processor(
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
        backend.post_processor = bos_eos_processor(
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
