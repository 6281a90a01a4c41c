"""The tokenizer's boundary with the server: invalid Unicode is a typed error, long texts do not stall threads."""

from __future__ import annotations

import threading
import time

import pytest

from bargein.loader import load_tokenizer, resolve_model_ref
from bargein.loader.tokenizer import UnencodableTextError


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_ref(None))


def test_lone_surrogate_is_a_value_error_with_its_position(tokenizer):
    with pytest.raises(UnencodableTextError) as info:
        tokenizer.encode("ab\ud800c")
    assert info.value.position == 2 and isinstance(info.value, ValueError)
    assert tokenizer.encode("smile \U0001F600") == tokenizer.backend.encode("smile \U0001F600").ids


def test_encoding_a_long_text_lets_other_threads_run(tokenizer):
    """``encode`` releases the GIL: the engine thread keeps stepping while a huge prompt is tokenized."""
    text = "lorem ipsum dolor " * 60_000  # about 1 MB
    ticks: list[float] = []
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.001)

    thread = threading.Thread(target=tick)
    thread.start()
    time.sleep(0.05)
    started = time.monotonic()
    ids = tokenizer.encode(text, add_special_tokens=False)
    took = time.monotonic() - started
    done.set()
    thread.join()
    assert ids == tokenizer.backend.encode(text, add_special_tokens=False).ids
    longest_gap = max(b - a for a, b in zip(ticks, ticks[1:], strict=False))
    assert longest_gap < max(0.05, took / 2), (longest_gap, took)  # holding the GIL, the gap is all of `took`


def test_at_least_tokens_is_a_lower_bound_found_without_encoding(tokenizer):
    import random

    rng = random.Random(0)
    pieces = ["a", "the", " ", "\n", "é", "日本", "😀", "<|im_start|>", "ing", "1234", "    "]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        assert tokenizer.at_least_tokens(text) <= len(tokenizer.encode(text, add_special_tokens=False)), text
    huge = "lorem ipsum " * 350_000  # 4.2 MB
    started = time.monotonic()
    bound = tokenizer.at_least_tokens(huge)
    assert time.monotonic() - started < 0.5
    assert bound > 8192 and bound <= len(huge)  # refusable for a context of 8k without tokenizing
