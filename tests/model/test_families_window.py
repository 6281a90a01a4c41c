"""The sliding window a GGUF does not carry (issue 25): llama.cpp's converter writes none for
Mistral, so such a file attends globally, as llama.cpp runs it, with a warning where its name
says Mistral; ``--sliding-window`` (EngineConfig.sliding_window) applies the trained window."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from bargein.config import CacheConfig, EngineConfig
from bargein.engine.engine import Engine
from bargein.engine.sampling import SamplingParams
from bargein.loader import load_config, resolve_model_ref
from tests.model.family_files import model_path, reference_greedy, spec

WINDOW = spec("mistral").window


@pytest.fixture(scope="module")
def mistral_named(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Mistral GGUF under a Mistral file name (its general.name is the converter's 'Hf')."""
    path = tmp_path_factory.mktemp("mistral") / "Mistral-7B-Instruct-v0.1.Q8_0.gguf"
    shutil.copyfile(model_path("mistral", "gguf"), path)  # a copy: a link resolves to its target's name
    return path


def test_a_mistral_gguf_without_a_window_warns_and_attends_globally(mistral_named: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="bargein.loader"):
        config = load_config(resolve_model_ref(mistral_named))
    assert config.sliding_window is None and config.local_layers == ()
    (record,) = [r for r in caplog.records if "sliding window" in r.getMessage()]
    assert "--sliding-window 4096" in record.getMessage() and str(mistral_named) in record.getMessage()


def test_a_file_not_named_like_a_windowed_family_loads_without_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="bargein.loader"):
        load_config(resolve_model_ref(model_path("mistral", "gguf")))  # general.name 'Hf', file model.gguf
    assert not [r for r in caplog.records if "sliding window" in r.getMessage()]


def test_the_override_sets_every_layer_of_a_file_without_one_and_silences_the_warning(
        mistral_named: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="bargein.loader"):
        config = load_config(resolve_model_ref(mistral_named), sliding_window=WINDOW)
        off = load_config(resolve_model_ref(mistral_named), sliding_window=0)
    assert (config.sliding_window, config.local_layers) == (WINDOW, tuple(range(config.num_layers)))
    assert (off.sliding_window, off.local_layers) == (None, ())
    assert not caplog.records


def test_the_override_keeps_an_interleaved_models_local_layers() -> None:
    source = resolve_model_ref(model_path("gemma3", "gguf"))
    read = load_config(source)
    assert 0 < len(read.local_layers) < read.num_layers
    wider = load_config(source, sliding_window=16)
    assert (wider.sliding_window, wider.local_layers) == (16, read.local_layers)
    assert load_config(source, sliding_window=0).local_layers == ()


def test_a_negative_window_is_refused() -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        EngineConfig(sliding_window=-1)


def test_a_mistral_gguf_with_the_window_equals_transformers_with_it() -> None:
    """Greedy 32 tokens after a prompt longer than the window, from the GGUF with
    ``sliding_window`` set: transformers' Mistral with its window (the folder's config)."""
    config = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=96), precision="exact", device="cpu",
                          max_model_len=64, sliding_window=WINDOW)
    eng = Engine.from_pretrained(model_path("mistral", "gguf"), config, progress=False)
    prompt = [(7 * i) % 290 + 3 for i in range(20)]
    (out,) = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    answer = list(out.token_ids)
    assert answer == reference_greedy("mistral", "hf", prompt, answer)  # "hf": the window applies
    assert answer != reference_greedy("mistral", "gguf", prompt, answer)  # and it changes the answer


def test_serve_takes_the_flag_and_refuses_a_negative_window_before_loading() -> None:
    import argparse

    from bargein.cli.errors import EXIT_USAGE, CliError
    from bargein.cli.serve import _add_serve_arguments, _start_serving

    p = argparse.ArgumentParser()
    _add_serve_arguments(p)
    assert p.parse_args([]).sliding_window is None
    assert p.parse_args(["--sliding-window", "4096"]).sliding_window == 4096
    with pytest.raises(CliError) as info:
        _start_serving(p.parse_args(["--sliding-window", "-1"]))
    assert info.value.status == EXIT_USAGE and "sliding_window" in str(info.value)
