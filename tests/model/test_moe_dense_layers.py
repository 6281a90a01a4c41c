"""An MoE model whose config makes some layers dense (Qwen2-MoE's ``decoder_sparse_step`` and
``mlp_only_layers``): those layers load and run their dense MLP, the others their experts,
and greedy tokens in ``exact`` equal transformers'. The folder is written here, with
transformers' own classes, from the committed Qwen2-MoE spec."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from bargein.config import CacheConfig, EngineConfig
from bargein.engine.engine import Engine
from bargein.engine.sampling import SamplingParams
from bargein.model.llama import FeedForward
from bargein.model.moe import MoEFeedForward
from tests.model.make_moe_files import save_hf
from tests.model.moe_specs import MOE_FAMILIES


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = next(s for s in MOE_FAMILIES if s.name == "qwen2moe")
    # layers 0, 2: dense (mlp_only_layers, and step 2 skips the even ones); 1, 3: experts
    spec = type(base)(base.name, base.config_class, base.model_class,
                      dict(base.config, num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[0]))
    out = tmp_path_factory.mktemp("moe-dense-layers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_hf(spec, out)
    return out


def test_dense_layers_run_their_mlp_and_tokens_equal_transformers(folder: Path) -> None:
    import transformers

    config = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=32), precision="exact", device="cpu",
                          max_model_len=64)
    eng = Engine.from_pretrained(str(folder), config, progress=False)
    kinds = [type(layer.feed_forward) for layer in eng.runner.stages[0].layers]
    assert kinds == [FeedForward, MoEFeedForward, FeedForward, MoEFeedForward]
    prompt = list(range(10, 30))
    (out,) = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    answer = list(out.token_ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + answer[:-1]])).logits[0]
    assert answer == logits[len(prompt) - 1:].argmax(-1).tolist()
