"""The serving benchmark's prompts: synthetic chat turns of an exact token length.

Each prompt is a slice of ``tests/data/public_domain.txt`` of ``input_tokens`` tokens by
the model's own tokenizer, from a seeded random offset (as AIPerf's synthetic prompts
are slices of its corpus), decoded back to text. Every server gets the same prompts.
Distinct offsets keep one request's prompt from being another's cached prefix.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "public_domain.txt"


@dataclass(frozen=True)
class PromptMaker:
    corpus_ids: tuple[int, ...]
    decode: object  # Callable[[list[int]], str]

    @classmethod
    def for_tokenizer(cls, tokenizer) -> PromptMaker:
        text = CORPUS.read_text()
        ids = tokenizer.encode(text, add_special_tokens=False)
        while len(ids) < 8192:  # a short corpus repeats; offsets stay distinct
            ids = ids + ids
        return cls(tuple(ids), lambda t: tokenizer.decode(t, skip_special_tokens=True))

    def prompts(self, n: int, input_tokens: int, seed: int) -> list[str]:
        rng = random.Random(seed * 7919 + input_tokens)
        span = len(self.corpus_ids) - input_tokens
        out = []
        for _ in range(n):
            start = rng.randrange(span)
            out.append(self.decode(list(self.corpus_ids[start:start + input_tokens])))
        return out

    def conversations(self, n: int, turns: int, user_tokens: int, seed: int) -> list[list[str]]:
        flat = self.prompts(n * turns, user_tokens, seed + 1)
        return [flat[i * turns:(i + 1) * turns] for i in range(n)]
