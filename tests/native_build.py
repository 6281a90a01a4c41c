"""The session's native kernel build, which CI requires.

``load_native_kernels`` answers None when the build fails or runs past its time limit
(bargein then runs on PyTorch kernels, as it should for a user), and every test that
needs the library skips. On a loaded machine a compile once ran past its 300 s limit
and a run skipped a few hundred kernel tests silently. Under ``CI=true`` the session
therefore builds the library first and stops, with the compiler's own error, when a
compiler is there but the build fails; elsewhere the tests skip as before.
"""

from __future__ import annotations

import os
import subprocess

import pytest


def required() -> bool:
    """Whether this run must have the native kernels: under ``CI=true`` with a C compiler,
    unless they were turned off (``BARGEIN_NATIVE_KERNELS=0``)."""
    # Imported here, not at the top: tests/conftest.py settles OpenMP before torch loads.
    from bargein.kernels import native

    turned_off = os.environ.get("BARGEIN_NATIVE_KERNELS", "1").strip().lower() in ("0", "false", "no", "off")
    return os.environ.get("CI", "").lower() == "true" and not turned_off and native._compiler() is not None


def build_or_stop() -> None:
    """Builds (or finds) the session's native kernels and loads them; under
    :func:`required`, a failed or timed-out build stops the session with its reason."""
    from bargein.kernels import native

    if required():
        try:
            native.build_library(native._compiler(), native.cache_dir())
        except subprocess.TimeoutExpired as exc:
            pytest.exit(f"CI=true: the native kernel build ran past its {exc.timeout:.0f} s limit "
                        f"({' '.join(map(str, exc.cmd))}); the kernel tests would have skipped", returncode=3)
        except subprocess.CalledProcessError as exc:
            pytest.exit(f"CI=true: the native kernels did not build:\n{exc.stderr}", returncode=3)
        except OSError as exc:
            pytest.exit(f"CI=true: the native kernels did not build: {exc}", returncode=3)
    if native.load_native_kernels() is None and required():
        pytest.exit("CI=true: the native kernels were built but did not load (see the warning above)", returncode=3)
