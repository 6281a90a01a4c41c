"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import ctypes
import shutil

import pytest

from bargein.kernels import native


@pytest.fixture(scope="session")
def portable_kernels(tmp_path_factory: pytest.TempPathFactory) -> native.NativeKernels:
    """The kernels as a compiler that refuses ``-march=native`` (and OpenMP) builds them:
    the first variant fails, the plainest one (no ``-march``, no ``-fopenmp``) builds, so
    the vector paths exist only through their own target attributes and ``parallel.c``
    runs its own thread pool. Built once per session: a build is ~25 s of CPU, most of it
    gguf_matmul.c, and two tests need exactly this library."""
    compiler = native._compiler()
    if compiler is None or shutil.which(compiler) is None:
        pytest.skip("no C compiler here")
    folder = tmp_path_factory.mktemp("portable-kernels")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "_VARIANTS", (("-march=no-such-cpu",), ()))
        path = native.build_library(compiler, folder)
    assert [p.name for p in folder.iterdir()] == [path.name]  # the refused variant left nothing
    return native.NativeKernels(ctypes.CDLL(str(path)), path)
