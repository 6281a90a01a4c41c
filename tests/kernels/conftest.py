"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest

from bargein.kernels import build_flags, native

# The sources of the kernels the portable library's tests call (test_native_kernels.py:
# paged decode attention; test_quant_kernels.py: the int8 matmul and its instruction sets,
# RMS norm, SiLU-mul, RoPE store and float16 attention), with the thread pool they all
# run on. gguf_matmul.c (~25 s of CPU at -O3), half_matmul.c (~4 s) and the ones that call
# into them are left out: no portable test reaches them.
PORTABLE_SOURCES = ("decode_attention.c", "quant_matmul.c", "attention_f16.c", "rowwise.c", "parallel.c")


class PartialLibrary:
    """A library built from some of the kernel sources, as :class:`native.NativeKernels`
    binds it: a symbol the library has is itself; one it lacks (a kernel of a source not
    built) binds, and fails the test that calls it, naming the symbol."""

    def __init__(self, library: ctypes.CDLL):
        self._library = library

    def __getattr__(self, name: str):
        try:
            return getattr(self._library, name)
        except AttributeError:
            return NotBuilt(name)


class NotBuilt:
    """A kernel left out of a partial library: takes ``restype``/``argtypes``, fails when called."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise AssertionError(f"{self.name} is not in the portable test library: add its source to "
                             f"tests/kernels/conftest.py's PORTABLE_SOURCES")


def build_partial(folder: Path, variants: tuple[tuple[str, ...], ...], names: tuple[str, ...]) -> native.NativeKernels:
    """The kernel sources ``names`` built into ``folder`` with the first of ``variants``
    (architecture flags) that compiles, bound as :class:`native.NativeKernels` binds the
    whole library; skips the test where there is no C compiler."""
    compiler = native._compiler()
    if compiler is None or shutil.which(compiler) is None:
        pytest.skip("no C compiler here")
    sources = tuple(source for source in native._SOURCES if source.name in names)
    assert len(sources) == len(names), "a kernel source was renamed in bargein/kernels/native.py"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "_VARIANTS", variants)
        patch.setattr(native, "_SOURCES", sources)
        path = native.build_library(compiler, folder)
    assert [p.name for p in folder.iterdir()] == [path.name]  # a refused variant left nothing
    return native.NativeKernels(PartialLibrary(ctypes.CDLL(str(path))), path)


@pytest.fixture(scope="session")
def portable_kernels(tmp_path_factory: pytest.TempPathFactory) -> native.NativeKernels:
    """The kernels as a compiler that refuses ``-march=native`` (and OpenMP) builds them:
    the first variant fails, the plainest one (no ``-march``, no ``-fopenmp``) builds, so
    the vector paths exist only through their own target attributes and ``parallel.c``
    runs its own thread pool. Built once per session, from :data:`PORTABLE_SOURCES` only
    (~5 s of CPU; all of them take ~35 s); two tests need exactly this library."""
    return build_partial(tmp_path_factory.mktemp("portable-kernels"), (("-march=no-such-cpu",), ()), PORTABLE_SOURCES)


@pytest.fixture(scope="session")
def avx2_attention_kernels(tmp_path_factory: pytest.TempPathFactory) -> native.NativeKernels:
    """The float16 attention (attention_f16.c, its thread pool, and quant_matmul.c, which the
    binding asks for its instruction sets) built for x86-64-v3: AVX2, FMA and F16C without
    AVX-512, as an AVX2-only machine builds it with -march=native, so that a machine with
    AVX-512 checks the 256-bit prompt path too (~3 s of CPU). Skipped off x86-64 or where
    the CPU cannot run it."""
    if build_flags.is_arm64() or not {"avx2", "fma", "f16c"} <= build_flags.cpu_features():
        pytest.skip("this CPU cannot run an x86-64-v3 build")
    return build_partial(tmp_path_factory.mktemp("avx2-attention"),
                         (("-march=x86-64-v3", "-fopenmp"), ("-march=haswell", "-fopenmp"), ("-march=x86-64-v3",)),
                         ("attention_f16.c", "quant_matmul.c", "parallel.c"))
