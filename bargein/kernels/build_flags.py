"""How the native kernels are compiled on this machine: the compiler flags per CPU
architecture, and what of the CPU enters the kernel cache's key.

x86-64 (and anything not named below): ``-march=native``, so the compiler may use every
instruction the CPU has; the int8 matmuls' AVX2 and AVX-512 VNNI paths are built by
function target attributes either way and chosen at run time.

ARM64 (AArch64): NEON is part of the architecture. Where the CPU has the dot-product
extension (``asimddp`` in /proc/cpuinfo; on macOS, which has no /proc, the sysctl
``hw.optional.arm.FEAT_DotProd``: ARMv8.2-A and later, Raspberry Pi 5, Apple M-series,
Graviton 2+) the library is built for ``armv8.2-a+dotprod``, else for plain
``armv8-a`` (a Pi 4's Cortex-A72), so no instruction the CPU lacks can be emitted. The sdot
paths are function targets too (arm64_simd.h), chosen at run time from the kernel's
hardware capabilities; a compiler too old to know the extension builds the NEON paths only,
which :func:`arm64_fallback_note` words for the log.

Each list of variants is tried in order until one builds (an older compiler may refuse a
``-march``; OpenMP may be missing, and then parallel.c runs a thread pool of its own).
"""

from __future__ import annotations

import platform
import subprocess
from collections.abc import Callable
from pathlib import Path

# -ffp-contract=off: a multiply and an add stay two roundings unless the source asks for a
# fused one, so the `fast` kernels' instruction-set paths round alike (see quant_matmul.c).
COMMON_FLAGS = ("-O3", "-std=c11", "-shared", "-fPIC", "-pthread", "-ffp-contract=off")
ARM64_DOTPROD_MARCH = "-march=armv8.2-a+dotprod"
ARM64_BASE_MARCH = "-march=armv8-a"

# macOS's sysctl names of the ARM features the build cares about, to the names Linux's
# /proc/cpuinfo gives them (one name for one feature everywhere below). The dot-product
# extension had an older name before macOS 12; either one set means the CPU has it.
DARWIN_ARM_FEATURES = {"hw.optional.arm.FEAT_DotProd": "asimddp",
                       "hw.optional.armv8_2_dotprod": "asimddp",
                       "hw.optional.neon": "asimd"}


def read_sysctl(name: str) -> str | None:
    """The value of macOS's sysctl ``name`` (``sysctl -n``), or None where it has none."""
    try:
        done = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def darwin_features(sysctl: Callable[[str], str | None] | None = None) -> frozenset[str]:
    """The ARM features a Mac's sysctls (default: :func:`read_sysctl`) report set (value 1),
    by their /proc/cpuinfo names."""
    sysctl = sysctl or read_sysctl
    return frozenset(feature for name, feature in DARWIN_ARM_FEATURES.items() if sysctl(name) == "1")


def is_arm64(machine: str | None = None) -> bool:
    """Whether ``machine`` (default: this one's, as ``platform.machine()`` names it) is ARM64."""
    return (machine or platform.machine()).lower() in ("aarch64", "arm64")


def cpu_features(cpuinfo: str | None = None, system: str | None = None) -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (x86 ``flags``, ARM ``Features``);
    on macOS (``system``, default this one's ``platform.system()``) the ARM ones its sysctls
    report, by the same names; empty where neither exists."""
    if cpuinfo is None:
        if (system or platform.system()) == "Darwin":
            return darwin_features()
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    features: set[str] = set()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            features.update(value.split())
    return frozenset(features)


def compile_variants(machine: str | None = None,
                     features: frozenset[str] | None = None) -> tuple[tuple[str, ...], ...]:
    """The architecture flags to try, in order, for ``machine`` with CPU ``features``
    (defaults: this machine's)."""
    if not is_arm64(machine):
        return (("-march=native", "-fopenmp"), ("-march=native",), ("-fopenmp",), ())
    features = cpu_features() if features is None else features
    marches = (ARM64_DOTPROD_MARCH, ARM64_BASE_MARCH) if "asimddp" in features else (ARM64_BASE_MARCH,)
    return (*((march, "-fopenmp") for march in marches), *((march,) for march in marches), ("-fopenmp",), ())


def cpu_signature(cpuinfo: str | None = None) -> str:
    """The CPU's model and feature flags (x86: model name, flags; ARM: implementer, part,
    architecture, features), since code built for one CPU is only good on its like."""
    if cpuinfo is None:
        if platform.system() == "Darwin":  # no /proc: the chip's name and its features
            return "\n".join([read_sysctl("machdep.cpu.brand_string") or platform.processor(),
                              *sorted(cpu_features())])
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return platform.processor()
    wanted = ("model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU part")
    return "\n".join(sorted({line for line in cpuinfo.splitlines() if line.split(":")[0].strip() in wanted}))


def arm64_fallback_note(library_has_dotprod: bool, machine: str | None = None,
                        features: frozenset[str] | None = None) -> str | None:
    """What to log where this ARM64 CPU has the dot-product extension but the library built
    no path for it (a compiler that does not know it); None otherwise."""
    if not is_arm64(machine) or library_has_dotprod:
        return None
    if "asimddp" not in (cpu_features() if features is None else features):
        return None
    return ("this CPU has the ARM dot-product extension (asimddp) but the C compiler built no path for it "
            "(GCC 8 or clang 6 are needed); the int8 matmuls run on plain NEON (same results, slower)")
