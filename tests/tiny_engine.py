"""A tiny random-weight engine for fast engine tests, and an independent greedy oracle.

The tokenizer is bytes: token t < 256 is the byte t; 256 is end-of-sequence. Prompts
are token lists, so no test depends on a real vocabulary.

``BARGEIN_TEST_DEVICE`` (default ``cpu``) and ``BARGEIN_TEST_DTYPE`` (default
``float32``) choose where these engines run, so the same contract tests run on a GPU
(scripts/gpu_check.sh sets ``cuda``). ``precision`` (default ``BARGEIN_TEST_PRECISION``,
else ``exact``) picks the engine's precision mode. ``speculative`` (default
``BARGEIN_TEST_SPECULATIVE``, else off) turns on speculative decoding, so the whole
contract suite can run with it: the answers must not change. "ngram" is prompt lookup;
"draft" a draft model with the engine's own weights, whose guesses are all right: every
decode step then yields several tokens (tests that count steps see fewer of them).
"""

from __future__ import annotations

import os
import weakref

import torch

from bargein.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from bargein.engine.device import build_model
from bargein.engine.engine import Engine
from bargein.engine.outputs import OutputCollector
from tests.dense_reference import dense_logits, random_weights

EOS = 256
TINY = ModelConfig(vocab_size=260, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, tie_word_embeddings=False, max_position_embeddings=512)


class ByteTokenizer:
    vocab_size = 260
    bos_token_id = None
    eos_token_ids = frozenset({EOS})
    special_token_ids = frozenset({256, 257, 258, 259})
    special_texts: tuple[str, ...] = ()  # no text encodes to a special token: bytes only
    marker_texts: tuple[str, ...] = ()  # nor to an added token that is not special
    chat_template = None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def encode_as_text(self, text: str, *, keep_markers: bool = False) -> list[int]:
        return list(text.encode())

    def token_bytes(self, token_id: int, *, skip_special_tokens: bool = True) -> bytes:
        if token_id < 256:
            return bytes([token_id])
        return b"" if skip_special_tokens else f"<{token_id}>".encode()

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return b"".join(self.token_bytes(t, skip_special_tokens=skip_special_tokens) for t in ids).decode(
            errors="replace")


_WEIGHTS: dict[int, dict[str, torch.Tensor]] = {}


def tiny_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    if seed not in _WEIGHTS:
        _WEIGHTS[seed] = random_weights(TINY, seed=seed)
    return _WEIGHTS[seed]


def target_device() -> str:
    return os.environ.get("BARGEIN_TEST_DEVICE", "cpu")


def tiny_engine(*, num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 16,
                max_num_batched_tokens: int = 64, seed: int = 0, prefix_caching: bool = True,
                device: str | None = None, dtype: str | None = None, cuda_graphs: bool = True,
                precision: str | None = None, speculative: SpeculativeConfig | str | None = None,
                draft_proposer=None, kv_disk_dir: str | None = None) -> Engine:
    speculative = speculative or os.environ.get("BARGEIN_TEST_SPECULATIVE", "off")
    own_draft = speculative == "draft"
    if isinstance(speculative, str):
        speculative = SpeculativeConfig(method="ngram" if own_draft else speculative, guess_cost=0.1)
    config = EngineConfig(
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix_caching,
                          kv_disk_dir=kv_disk_dir),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        device=device or target_device(), dtype=dtype or os.environ.get("BARGEIN_TEST_DTYPE", "float32"),
        cuda_graphs=cuda_graphs, precision=precision or os.environ.get("BARGEIN_TEST_PRECISION", "exact"),
        speculative=speculative,
    )
    model = build_model(TINY, dict(tiny_weights(seed)), config, max_positions=TINY.max_position_embeddings)
    if own_draft and draft_proposer is None:
        from bargein.engine.speculative.draft_model import DraftModelProposer

        draft = build_model(TINY, dict(tiny_weights(seed)), config, max_positions=TINY.max_position_embeddings)
        draft_proposer = DraftModelProposer(draft, kv_tokens=1024, block_size=block_size,
                                            target_vocab_size=TINY.vocab_size)
    return Engine(model, ByteTokenizer(), config, model_name="tiny", draft_proposer=draft_proposer,
                  model_identity=None if kv_disk_dir is None else f"tiny-seed-{seed}")


# (prompt, seed) -> the longest greedy continuation computed so far. Greedy decoding is
# prefix-consistent (the first n tokens of a longer continuation are the n-token one), and
# the reference is deterministic, so every test session computes each token once.
_GREEDY: dict[tuple[tuple[int, ...], int], list[int]] = {}


def reference_greedy(tokens: list[int], n: int, seed: int = 0) -> list[int]:
    """Greedy continuation by the dense float64 reference, recomputing everything each token
    (remembered per prompt for the session: many tests ask for the same one)."""
    out = _GREEDY.setdefault((tuple(tokens), seed), [])
    context = [*tokens, *out]
    while len(out) < n:
        nxt = int(dense_logits(TINY, tiny_weights(seed), context)[-1].argmax())
        out.append(nxt)
        context.append(nxt)
    return out[:n]


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


_COLLECTORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def collector(engine: Engine) -> OutputCollector:
    """The synchronous consumer of ``engine`` for tests: add requests and step through it."""
    if engine not in _COLLECTORS:
        _COLLECTORS[engine] = OutputCollector(engine)
    return _COLLECTORS[engine]


def step_until_delivered(engine: Engine, count: int) -> list[int]:
    """Steps ``engine`` until its one running request has delivered at least ``count``
    tokens (a step may deliver several); those tokens."""
    delivered: list[int] = []
    while len(delivered) < count:
        for out in collector(engine).step():
            delivered += out.new_token_ids
    return delivered


def run_until_finished(engine: Engine, request_id: str) -> list:
    """Steps ``engine`` until ``request_id`` finishes; that request's outputs, the last one final."""
    outputs = []
    while not outputs or not outputs[-1].finished:
        outputs += [o for o in collector(engine).step() if o.request_id == request_id]
    return outputs
