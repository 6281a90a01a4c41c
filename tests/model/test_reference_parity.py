"""The bundled SmolLM2 against Hugging Face transformers loading the same GGUF file.

transformers is the reference (a test dependency only): the same logits at every
position of a chat, and the same greedy continuations, token for token.
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch

from bargein.config import CacheConfig, EngineConfig
from bargein.engine.engine import Engine
from bargein.engine.sampling import SamplingParams
from bargein.loader import resolve_model_ref

pytestmark = pytest.mark.slow

CHAT = [
    {"role": "system", "content": "You are a concise assistant who answers in one or two sentences."},
    {"role": "user", "content": "What is the capital of France, and why is it famous?"},
    {"role": "assistant", "content": "Paris. It is famous for the Eiffel Tower, art and food."},
    {"role": "user", "content": "Name three museums there. 🎨 Also: 東京 is where?"},
]
PROMPTS = [
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Explain recursion to a child."}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Where is the treasure?"}],
]


@pytest.fixture(scope="module")
def reference():
    transformers = pytest.importorskip("transformers")
    gguf = pytest.importorskip("gguf")
    source = resolve_model_ref(None)
    # transformers parses the file twice (config, then tensors) and builds gguf-py's name
    # table once per module of the model (~400 times): over half of a ~24 s load on CI.
    # Within this load, one parse and one table per key serve every call; what is read
    # and dequantized, and how, is transformers' and gguf-py's own.
    readers: dict[str, object] = {}
    parse = gguf.GGUFReader

    def read_once(path, *args, **kwargs):
        if str(path) not in readers:
            readers[str(path)] = parse(path, *args, **kwargs)
        return readers[str(path)]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", read_once)
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(source.path.parent), gguf_file=source.path.name, torch_dtype=torch.float32)
    assert list(readers) == [str(source.path)]  # the one file, parsed once
    return model.eval()


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(None, EngineConfig(cache=CacheConfig(memory_bytes=64 * 1024**2), precision="exact"), progress=False)


def chat_ids(engine: Engine, messages) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def our_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Logits at every position, through the paged runner, in 3 chunks to exercise the cache."""
    from bargein.engine.blocks import BlockTable
    from bargein.engine.plan import ScheduledChunk, StepPlan

    table = BlockTable()
    engine.pool.ensure_writable(table, 0, len(ids))
    rows = []
    bounds = [0, len(ids) // 3, 2 * len(ids) // 3, len(ids)]
    for start, end in zip(bounds, bounds[1:], strict=False):
        plan = StepPlan(0, (ScheduledChunk("x", tuple(ids[start:end]), start, tuple(table.block_ids), True),))
        rows.append(_all_positions(engine, plan))
    engine.pool.release(table)
    return torch.cat(rows)


def _all_positions(engine: Engine, plan) -> torch.Tensor:
    from bargein.model.attention import AttentionMetadata

    runner = engine.runner
    chunk = plan.chunks[0]
    meta = AttentionMetadata.build(block_tables=[list(chunk.block_table)], query_lens=[len(chunk.token_ids)],
                                   context_lens=[chunk.context_len], block_size=runner.block_size)
    x = torch.tensor(chunk.token_ids)
    pos = torch.arange(chunk.start_pos, chunk.context_len)
    (stage,) = runner.stages
    return stage(x, pos, meta, runner.kv_caches[0], logits_indices=torch.arange(len(chunk.token_ids)))


def test_logits_match_the_reference_at_every_position(engine, reference) -> None:
    ids = chat_ids(engine, CHAT)
    assert len(ids) >= 64
    ours = our_logits(engine, ids)
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0].float()
    assert ours.shape == theirs.shape
    diff = (ours - theirs).abs().max().item()
    assert diff < 1e-3, f"max abs logit difference {diff}"


def test_greedy_continuations_match_the_reference(engine, reference) -> None:
    prompts = [chat_ids(engine, m) for m in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    ours = engine.generate(prompts, params)  # batched together
    theirs = reference_greedy(reference, prompts, 64)
    for out, want in zip(ours, theirs, strict=True):
        assert list(out.token_ids) == want


def reference_greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """argmax decoding of every prompt with the reference's own KV cache, free of any
    generation config, all prompts in one batch (one forward a token for all three, not
    one each: the weights are read a third as often).

    The prompts are padded on the right, so that no query row is masked whole (a padded
    row attends to its prompt); the padding is masked out of every later key and each row
    keeps its own positions, so a row computes what it would alone."""
    lengths = [len(ids) for ids in prompts]
    width = max(lengths)
    inputs = torch.tensor([ids + [ids[-1]] * (width - len(ids)) for ids in prompts])  # (B, width)
    mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in prompts])  # (B, width)
    positions = torch.arange(width).expand(len(prompts), width)
    last = torch.tensor(lengths) - 1  # each row's last prompt position
    out: list[list[int]] = [[] for _ in prompts]
    past = None
    # The KV cache's argument and output are `cache` where the forward takes it (transformers
    # 5.25 here, which deprecates `past_key_values` for removal in 5.40), else `past_key_values`.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        for step in range(n):
            result = model(inputs, attention_mask=mask, position_ids=positions, use_cache=True, **{name: past})
            past = getattr(result, name)
            logits = result.logits[torch.arange(len(prompts)), last if step == 0 else -1]  # (B, vocab)
            tokens = logits.argmax(-1)  # (B,)
            for row, token in zip(out, tokens.tolist(), strict=True):
                row.append(token)
            inputs = tokens[:, None]
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], dim=1)
            positions = (torch.tensor(lengths) + step)[:, None]
    return out
