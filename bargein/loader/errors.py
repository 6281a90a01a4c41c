"""Errors the loader raises. Every message names the file or reference and the problem."""

from __future__ import annotations


class LoaderError(Exception):
    """Base class: a model reference, file or template that cannot be used."""


class ModelNotFoundError(LoaderError):
    """The reference points at nothing (missing path, missing default package)."""


class UnsupportedModelError(LoaderError):
    """A well-formed model that bargein cannot run (architecture, tensor type, pickles)."""


class CorruptModelError(LoaderError):
    """A file that is truncated, malformed or missing tensors it must have."""


class ChatTemplateError(LoaderError):
    """A chat template that is missing, does not parse, or raised while rendering."""
