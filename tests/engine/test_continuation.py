"""The one continuation function and the server's bounded memory of answers (no model).

The tokenizer here is a toy whose tokens are words with their leading space, so that
re-tokenizing a text can give other ids than the ones "generated" (ids 100+ stand for
generated tokens that decode to the same text as a different split).
"""

from __future__ import annotations

from collections.abc import Sequence

from bargein.engine.continuation import KnownText, continue_text
from bargein.server.prompt_memory import PromptMemory

VOCAB = {"<s>": 0, "Hi": 1, " there": 2, " friend": 3, " go": 4, " on": 5, ".": 6, "\n": 7}
SPLIT = {100: " th", 101: "ere"}  # a generated split of " there" that encode never produces
TEXT_OF = {**{v: k for k, v in VOCAB.items()}, **SPLIT}


def encode(text: str) -> list[int]:
    ids, i = [], 0
    while i < len(text):
        piece = max((p for p in VOCAB if text.startswith(p, i)), key=len)
        ids.append(VOCAB[piece])
        i += len(piece)
    return ids


def decode(ids: Sequence[int]) -> str:
    return "".join(TEXT_OF[i] for i in ids)


def known(prompt: str, answer_ids: list[int]) -> KnownText:
    return KnownText(prompt, tuple(encode(prompt)), tuple(answer_ids), prompt + decode(answer_ids))


def test_a_remembered_answer_is_reused_whole_and_only_the_rest_is_tokenized():
    answer = [100, 101, 3]  # " th" "ere" " friend": encode would give [2, 3]
    k = known("<s>Hi", answer)
    cont = continue_text("<s>Hi there friend\n go on.", [k], encode=encode, decode=decode)
    assert cont.token_ids == [0, 1, 100, 101, 3, 7, 4, 5, 6]
    assert cont.reused == 5 and cont.source is k and cont.rest_text == "\n go on."


def test_a_partial_answer_reuses_the_tokens_its_text_covers():
    k = known("<s>Hi", [100, 101, 3])
    # the client kept only " there" of the answer (a disconnect): two of its three ids
    cont = continue_text("<s>Hi there go", [k], encode=encode, decode=decode)
    assert cont.token_ids == [0, 1, 100, 101, 4] and cont.reused == 4
    # half a token's text: that token is not reused, its text is tokenized
    cont = continue_text("<s>Hi th", [k], encode=encode, decode=decode)
    assert cont.token_ids[:3] == [0, 1, 100] and cont.reused == 3 and cont.rest_text == ""


def test_the_longest_cover_wins_and_unrelated_texts_are_ignored():
    short = known("<s>Hi", [2])
    longer = known("<s>Hi", [100, 101, 3])
    other = known("<s> go", [5])
    cont = continue_text("<s>Hi there friend.", [short, other, longer], encode=encode, decode=decode)
    assert cont.source is longer and cont.token_ids == [0, 1, 100, 101, 3, 6]
    none = continue_text("Hi.", [short, other], encode=encode, decode=decode)
    assert none.source is None and none.reused == 0 and none.token_ids == encode("Hi.")


def test_a_changed_prompt_is_not_reused():
    # the template rewrote the past: the prompt's ids are reused only as a whole
    k = known("<s>Hi there", [3])
    cont = continue_text("<s>Hi friend", [k], encode=encode, decode=decode)
    assert cont.source is None and cont.token_ids == encode("<s>Hi friend")


def test_the_cli_form_rewinds_to_the_longest_matching_prefix():
    tokens = (0, 1, 100, 101, 3)
    k = KnownText("", (), tokens, decode(tokens))
    cont = continue_text("<s>Hi there go", [k], encode=lambda _: [], decode=decode)
    assert cont.reused == 4 and cont.rest_text == " go"


def test_memory_is_bounded_by_entries_and_tokens_lru_first():
    memory = PromptMemory(max_entries=2, max_tokens=10)
    a, b, c = known("<s>Hi", [2]), known("<s> go", [5]), known("<s>Hi", [100, 101, 3])
    memory.remember(a)
    memory.remember(b)
    memory.touch(a)  # b is now the least recently used
    memory.remember(c)
    assert memory.snapshot() == [a, c] and memory.num_tokens == a.num_tokens + c.num_tokens
    assert memory.candidates("<s>Hi there") == [a, c]
    same = known("<s>Hi", [100, 101])  # the same text as a, other ids: the newer replaces it
    memory.remember(same)
    assert memory.snapshot() == [c, same]
    big = known("<s>Hi", [3] * 7)  # 9 tokens: with either older one over 10, so both go
    memory.remember(big)
    assert memory.snapshot() == [big] and memory.num_tokens == 9
    memory.remember(known("<s>Hi", [3] * 20))  # larger than the whole budget: not kept
    assert memory.snapshot() == [big]
    off = PromptMemory(max_entries=0, max_tokens=10)
    off.remember(a)
    assert len(off) == 0
