"""Checks of the kernels' work stealing (parallel.h's shares): every output written once."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from bargein.kernels.native import Q8_ISAS

# More threads than this machine's cores: they are descheduled mid-call and steal often.
THREADS = (2, 3, 5, 8)
REPEATS = 6


def assert_each_output_written_once(run: Callable[[torch.Tensor, int], int], base: torch.Tensor) -> None:
    """``run(y, threads)`` computes into y (base's shape) and returns the kernel's status.
    With every thread count of THREADS, REPEATS times, y filled with NaN before the call
    comes out with base's bits: no output left unwritten, none written with other bits."""
    for threads in THREADS:
        for _ in range(REPEATS):
            y = torch.full(base.shape, float("nan"))
            assert run(y, threads) == 0 and torch.equal(y, base), threads


def gguf_run(kernels, x: torch.Tensor, matrix, isa: str) -> Callable[[torch.Tensor, int], int]:
    """``run`` for assert_each_output_written_once: bargein_gguf_matmul (fast) of x and a
    described matrix on one instruction set."""
    x = x.contiguous()
    return lambda y, threads: kernels._gguf_matmul(x.data_ptr(), x.shape[0], ctypes.addressof(matrix.struct),
                                                   y.data_ptr(), 0, threads, Q8_ISAS[isa])
