"""The ARM64 kernels (NEON, and sdot from the dot-product extension), checked bit for bit on
this x86-64 machine: tests/kernels/arm64/kernel_harness.c runs every `fast` kernel on fixed
inputs and prints a hash of each output per path. It is cross-built with the kernel
sources for ARM64 and run under qemu-aarch64 on an ARMv8.0 CPU (no dot product: the NEON
paths) and on qemu's ``max`` CPU (the sdot paths), and built for this machine against the
library bargein loads here (its AVX2 / AVX-512 VNNI paths).

What must hold, exactly:
- in each run, every int8-matmul instruction set and thread count gives its plain C's bits;
- every ARM64 run gives the x86-64 run's bits, case by case (up to a whole two-layer fused
  forward, embedding to logits and K/V), so a mixed cluster's stages and replicas agree
  (contract C4), with no case left out. That includes GeGLU and soft caps, softmax, SiLU
  and the MoE router: they use the kernels' own tanh and exp (tanh.h, exp.h), since glibc's
  tanhf and expf round apart on x86-64 and AArch64;
- the kernels' exp (tests/kernels/arm64/exp_check.c, on a dense sample of every float):
  within 1 ulp, its vector bodies (AVX2, NEON) give its bits for every input, and its bits
  are the same built for this machine, as plain C without -march, and for ARM64 under qemu
  (bench/bench_exp.py runs all 2^32 inputs).

Needs gcc-aarch64-linux-gnu and qemu-user (Debian; ``scripts/bootstrap.sh --test`` installs
them when run as root). The two ARM64 builds are cached by their sources, so a rerun costs
only the emulated runs (a few seconds).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from bargein.kernels import build_flags, native

KERNELS_DIR = Path(native.__file__).parent
HARNESS = Path(__file__).with_name("arm64") / "kernel_harness.c"
EXP_CHECK = HARNESS.with_name("exp_check.c")
# Every 2053rd bit pattern (about 2.1 million floats: every exponent, varied mantissas), then
# exp_check's edge cases and the 24,579 floats around the limits of its scaling steps.
EXP_STRIDE = 2053
CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"
# Builds: the library's flags on a CPU without and with the dot-product extension.
BUILDS = {"armv8-a": build_flags.ARM64_BASE_MARCH, "armv8.2-a+dotprod": build_flags.ARM64_DOTPROD_MARCH}
# Runs: (build, qemu CPU). cortex-a57 is ARMv8.0 (no sdot); max has every extension qemu knows.
RUNS = {"neon": ("armv8-a", "cortex-a57"), "sdot": ("armv8-a", "max"), "sdot-build": ("armv8.2-a+dotprod", "max")}
ISA_C, ISA_NEON, ISA_DOTPROD = native.Q8_ISAS["c"], native.Q8_ISAS["neon"], native.Q8_ISAS["dotprod"]

missing = [tool for tool in (CROSS_CC, QEMU) if shutil.which(tool) is None]
needs_cross_tools = pytest.mark.skipif(bool(missing), reason=f"{', '.join(missing)} not installed: the ARM64 cross tools "
                                "(apt-get install gcc-aarch64-linux-gnu qemu-user; scripts/bootstrap.sh --test as root)")


def _sources() -> list[Path]:
    return [*native._SOURCES]


# The library's flags, less those of a shared object.
PROGRAM_FLAGS = [f for f in build_flags.COMMON_FLAGS if f not in ("-shared", "-fPIC")]


def _cached_build(compiler: str, flags: list[str], sources: list[Path], name: str, folder: Path) -> Path:
    """``sources`` built into a program with ``compiler`` and ``flags`` (and the kernels'
    headers), once per source, compiler and flags."""
    inputs = [*sources, *native._HEADERS]
    key = hashlib.sha256(b"\0".join([*(p.read_bytes() for p in inputs), repr(flags).encode(),
                                     native._compiler_identity(compiler).encode()])).hexdigest()[:16]
    binary = folder / f"{name}-{key}"
    if not binary.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = binary.with_suffix(f".tmp{os.getpid()}")
        subprocess.run([compiler, *flags, f"-I{KERNELS_DIR}", "-o", str(tmp), *map(str, sources), "-lm"], check=True,
                       capture_output=True, text=True, timeout=600)
        os.replace(tmp, binary)
    return binary


def _cross_build(march: str, folder: Path) -> Path:
    """The harness and the kernels for ARM64 with the library's flags and ``march``."""
    return _cached_build(CROSS_CC, [*PROGRAM_FLAGS, march, "-fopenmp"], [HARNESS, *_sources()],
                         f"harness-{march.removeprefix('-march=')}", folder)


def _parse(output: str) -> dict[str, dict[str, str]]:
    """case -> path -> hash (or status=N), from the harness's lines."""
    cases: dict[str, dict[str, str]] = {}
    for line in output.splitlines():
        case, path, value = line.split("\t")
        cases.setdefault(case, {})[path] = value
    return cases


def _run(command: list[str]) -> dict[str, dict[str, str]]:
    done = subprocess.run(command, check=True, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_WAIT_POLICY": "passive"})
    return _parse(done.stdout)


@pytest.fixture(scope="module")
def arm64_runs() -> dict[str, dict[str, dict[str, str]]]:
    """Each run of RUNS: its cases' hashes by path."""
    folder = native.cache_dir() / "arm64-harness"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        binaries = dict(zip(BUILDS, pool.map(lambda march: _cross_build(march, folder), BUILDS.values()),
                            strict=True))
        runs = {name: pool.submit(_run, [QEMU, "-L", SYSROOT, "-cpu", cpu, str(binaries[build])])
                for name, (build, cpu) in RUNS.items()}
        return {name: future.result() for name, future in runs.items()}


@pytest.fixture(scope="module")
def x86_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """The harness on this machine, against the library bargein itself loads here: built
    with -march=native, so on a CPU with AVX2, FMA and F16C its float kernels are the AVX2
    bodies that the ARM64 ones mirror (on another CPU there is no such node to agree with)."""
    kernels = native.load_native_kernels()
    compiler = native._compiler()
    if kernels is None or compiler is None:
        pytest.skip("no native kernels on this machine to compare with")
    if platform.machine() != "x86_64" or not {"avx2", "fma", "f16c"} <= build_flags.cpu_features():
        pytest.skip("the x86-64 reference is the AVX2 build, and this CPU has no AVX2, FMA and F16C")
    binary = tmp_path_factory.mktemp("x86-harness") / "harness"
    subprocess.run([compiler, "-O2", "-std=c11", f"-I{KERNELS_DIR}", "-o", str(binary), str(HARNESS), str(kernels.path),
                    "-lm"], check=True, capture_output=True, text=True, timeout=300)
    return _run([str(binary)])


@pytest.fixture(scope="module")
def exp_runs() -> dict[str, dict[str, str]]:
    """exp_check's results on EXP_STRIDE's sample, per build: ``native`` for this machine
    (-march=native: on x86-64 with AVX2 its exp256), ``plain`` without -march (no vector
    body; fmaf from libm where the compiler may not assume an fma instruction) and, where
    the cross tools are installed, ``arm64`` under qemu on an ARMv8.0 CPU (NEON's body)."""
    compiler = native._compiler()
    if compiler is None:
        pytest.skip("no C compiler here")
    folder = native.cache_dir() / "arm64-harness"
    builds = {"native": (compiler, [*PROGRAM_FLAGS, "-march=native"], []),
              "plain": (compiler, PROGRAM_FLAGS, [])}
    if not missing:
        builds["arm64"] = (CROSS_CC, [*PROGRAM_FLAGS, build_flags.ARM64_BASE_MARCH], [QEMU, "-L", SYSROOT, "-cpu",
                                                                                        "cortex-a57"])

    def run(name: str) -> dict[str, str]:
        cc, flags, runner = builds[name]
        binary = _cached_build(cc, flags, [EXP_CHECK], f"exp_check-{name}", folder)
        done = subprocess.run([*runner, str(binary), str(EXP_STRIDE)], check=True, capture_output=True, text=True,
                              timeout=300)
        return dict(line.split("\t") for line in done.stdout.splitlines())

    with concurrent.futures.ThreadPoolExecutor(len(builds)) as pool:
        return dict(zip(builds, pool.map(run, builds), strict=True))


def _isas(run: dict[str, dict[str, str]]) -> list[int]:
    return [int(n) for n in run["isas"]["-"].split(",")]


@needs_cross_tools
def test_each_emulated_cpu_runs_the_paths_its_features_allow(arm64_runs) -> None:
    """Chosen at run time from the CPU's features (getauxval), not from the build's -march."""
    assert _isas(arm64_runs["neon"]) == [ISA_C, ISA_NEON]
    assert _isas(arm64_runs["sdot"]) == [ISA_C, ISA_NEON, ISA_DOTPROD]
    assert _isas(arm64_runs["sdot-build"]) == [ISA_C, ISA_NEON, ISA_DOTPROD]


@needs_cross_tools
@pytest.mark.parametrize("run_name", list(RUNS))
def test_every_arm64_path_and_thread_count_gives_the_plain_c_bits(arm64_runs, run_name: str) -> None:
    run = arm64_runs[run_name]
    kinds = {case.split("/")[0] for case in run if case != "isas"}
    assert kinds >= {"gguf_fast", "gguf_exact_c", "gguf_rows", "q8_block", "block_float", "attention_f16",
                     "attention_f16_decode", "rope_store_f16", "decode_attention", "rms_norm", "silu_mul",
                     "gelu_tanh_mul", "softcap", "moe_route", "moe_experts", "fast_layers"}
    types = {case.split("/")[1] for case in run if case.startswith("gguf_fast/")}
    assert types >= {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}
    failed = {case: paths for case, paths in run.items() if any(v.startswith("status=") for v in paths.values())}
    assert not failed
    for case, paths in run.items():
        if case == "isas":
            continue
        reference = paths.get(f"isa={ISA_C},t=1", paths.get("t=1"))
        assert {path: value for path, value in paths.items() if value != reference} == {}, case
        if case.startswith(("gguf_fast/", "q8_block/", "moe_experts/", "fast_layers/")):  # every instruction set ran
            assert {int(p.split(",")[0].removeprefix("isa=")) for p in paths} == set(_isas(run)), case


@needs_cross_tools
@pytest.mark.parametrize("run_name", list(RUNS))
def test_arm64_gives_the_x86_64_bits(arm64_runs, x86_run, run_name: str) -> None:
    run = arm64_runs[run_name]
    assert set(run) == set(x86_run)

    def reference(paths: dict[str, str]) -> str:
        return paths.get(f"isa={ISA_C},t=1", paths.get("t=1"))

    tanh_cases = [case for case in x86_run if case.startswith(("gelu_tanh_mul/", "softcap/", "fast_layers/gelu=1"))]
    assert tanh_cases  # GeGLU and soft caps are compared too: the kernels' own tanh has one set of bits
    # and softmax, SiLU (at the inputs glibc's expf rounds apart) and the MoE router: the kernels' own exp
    assert {"silu_mul/exp_edges", "moe_route/m=5", "decode_attention/d=36", "attention_f16_decode/d=36,window=0,softcap=0"} <= set(x86_run)
    assert [case for case in x86_run if case != "isas" and reference(run[case]) != reference(x86_run[case])] == []


def test_exp_is_within_one_ulp_and_its_vector_bodies_give_its_bits(exp_runs) -> None:
    for name, run in exp_runs.items():
        assert int(run["count"]) > 2_000_000, name
        assert (run["max_ulp"], run["over_one"], run["vector_mismatch"]) == ("1", "0", "0"), (name, run)
    assert exp_runs["plain"]["vector"] == "none"
    if platform.machine() == "x86_64" and {"avx2", "fma"} <= build_flags.cpu_features():
        assert exp_runs["native"]["vector"] == "avx2"


@needs_cross_tools
def test_exp_has_the_same_bits_on_x86_64_and_arm64(exp_runs) -> None:
    """The scalar exp built three ways (this machine's -march, plain C, ARM64 under qemu)
    hashes the same outputs; its vector bodies match it in each build (the test above)."""
    assert exp_runs["arm64"]["vector"] == "neon"
    assert len({run["hash"] for run in exp_runs.values()}) == 1, exp_runs


def test_build_flags_per_architecture() -> None:
    x86 = build_flags.compile_variants("x86_64", frozenset({"avx2"}))
    assert x86[0] == ("-march=native", "-fopenmp") and not any("armv8" in f for v in x86 for f in v)
    with_dot = build_flags.compile_variants("aarch64", frozenset({"asimd", "asimddp"}))
    assert with_dot[0] == (build_flags.ARM64_DOTPROD_MARCH, "-fopenmp")
    assert (build_flags.ARM64_BASE_MARCH,) in with_dot and with_dot[-1] == ()
    without = build_flags.compile_variants("aarch64", frozenset({"asimd"}))  # a Pi 4: never a dotprod -march
    assert not any(build_flags.ARM64_DOTPROD_MARCH in v for v in without)
    assert not any(f.startswith("-m") and "avx" in f for v in (*with_dot, *without) for f in v)
    assert build_flags.cpu_features("processor\t: 0\nFeatures\t: fp asimd asimddp\n") == {"fp", "asimd", "asimddp"}
    assert build_flags.arm64_fallback_note(False, "aarch64", frozenset({"asimddp"})) is not None
    assert build_flags.arm64_fallback_note(True, "aarch64", frozenset({"asimddp"})) is None
    assert build_flags.arm64_fallback_note(False, "aarch64", frozenset({"asimd"})) is None
    assert build_flags.arm64_fallback_note(False, "x86_64", frozenset()) is None


def test_darwin_features_from_sysctl() -> None:
    """macOS has no /proc/cpuinfo: its sysctls name the features, by the same names."""
    def mac(values: dict[str, str]):
        return lambda name: values.get(name)

    m1 = build_flags.darwin_features(mac({"hw.optional.arm.FEAT_DotProd": "1", "hw.optional.neon": "1"}))
    assert m1 == {"asimddp", "asimd"}
    assert build_flags.darwin_features(mac({"hw.optional.armv8_2_dotprod": "1", "hw.optional.neon": "1"})) == m1
    assert build_flags.darwin_features(mac({"hw.optional.arm.FEAT_DotProd": "0", "hw.optional.neon": "1"})) == {"asimd"}
    assert build_flags.darwin_features(mac({})) == frozenset()
    assert build_flags.compile_variants("arm64", m1)[0] == (build_flags.ARM64_DOTPROD_MARCH, "-fopenmp")
    assert build_flags.arm64_fallback_note(False, "arm64", m1) is not None

    asked: list[str] = []

    def sysctl(name: str) -> str | None:
        asked.append(name)
        return "1"

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build_flags, "read_sysctl", sysctl)
        assert build_flags.cpu_features(system="Darwin") == {"asimddp", "asimd"}
        assert "hw.optional.arm.FEAT_DotProd" in asked
        patch.setattr(build_flags.platform, "system", lambda: "Darwin")
        assert build_flags.compile_variants("arm64")[0] == (build_flags.ARM64_DOTPROD_MARCH, "-fopenmp")
        assert "asimddp" in build_flags.cpu_signature()


def test_read_sysctl_missing_tool() -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build_flags.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError("sysctl")))
        assert build_flags.read_sysctl("hw.optional.arm.FEAT_DotProd") is None
    assert build_flags.darwin_features(lambda name: None) == frozenset()


@needs_cross_tools
def test_darwin_runtime_dotprod_check(tmp_path: Path) -> None:
    """arm64_simd.h's macOS branch (sysctlbyname), built for AArch64 as if for macOS against a
    stand-in sysctlbyname and run under qemu: either sysctl name set means sdot, none does not."""
    binary = tmp_path / "darwin_dotprod"
    arm64_dir = HARNESS.parent
    subprocess.run([CROSS_CC, "-std=c11", "-O1", "-U__linux__", "-D__APPLE__", f"-I{arm64_dir / 'darwin_include'}",
                    f"-I{KERNELS_DIR}", "-o", str(binary), str(arm64_dir / "darwin_dotprod.c")],
                   check=True, capture_output=True, text=True, timeout=120)

    def has_dotprod(set_name: str) -> str:
        return subprocess.run([QEMU, "-L", SYSROOT, str(binary)], check=True, capture_output=True, text=True,
                              timeout=60, env={**os.environ, "SET": set_name}).stdout.strip()

    assert [has_dotprod(name) for name in ("hw.optional.arm.FEAT_DotProd", "hw.optional.armv8_2_dotprod",
                                           "hw.optional.neon", "")] == ["1", "1", "0", "0"]
