"""The int8 matmul's instruction-set paths (``Q8_ISAS``) as test parameters.

Only the paths of this machine's architecture are parameters: NEON and sdot cannot run
on x86-64 (``test_arm64_emulated.py`` runs them under qemu), nor AVX2 and VNNI on ARM64,
and ~90 skips that said so on every run hid the skips that mean something. A path of
this architecture that this CPU lacks (VNNI on an AVX2-only machine) stays a parameter,
skipped by name, so that a run says which paths it checked.
"""

from __future__ import annotations

import pytest

from bargein.kernels.build_flags import is_arm64
from bargein.kernels.native import Q8_ISAS, NativeKernels

X86_64_ISAS = ("c", "avx2", "vnni", "amx")
ARM64_ISAS = ("c", "neon", "dotprod")
assert set(X86_64_ISAS) | set(ARM64_ISAS) == set(Q8_ISAS), "a Q8 path that no architecture's tests run"


def isas_of_this_architecture(machine: str | None = None) -> tuple[str, ...]:
    """The Q8 paths a CPU of this architecture (``platform.machine()`` by default) may run."""
    return ARM64_ISAS if is_arm64(machine) else X86_64_ISAS


def isa_params(kernels: NativeKernels | None) -> list:
    """One ``pytest.param`` per path of this architecture, skipped where ``kernels`` (None:
    no library) cannot run it on this CPU."""
    def param(name: str):
        runs = kernels is not None and kernels.q8_isa_available(name)
        return pytest.param(name, marks=pytest.mark.skipif(not runs, reason=f"this CPU has no {name} path"), id=name)

    return [param(name) for name in isas_of_this_architecture()]
