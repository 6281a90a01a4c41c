"""The native kernels' build cache: a start with the library built runs no compiler, and the
cache key still changes with the compiler and with the sources."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from bargein.kernels import native


@pytest.fixture
def compiler_copy(tmp_path: Path) -> Path:
    """A compiler of our own: a script that runs the real one (the key reads its file)."""
    real = native._compiler()
    if real is None:
        pytest.skip("no C compiler here")
    script = tmp_path / "bin" / "mycc"
    script.parent.mkdir()
    script.write_text(f'#!/bin/sh\nexec {shutil.which(real)} "$@"\n')
    script.chmod(0o755)
    return script


@pytest.fixture
def sources_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The kernels' sources copied where a test may change them."""
    folder = tmp_path / "src"
    folder.mkdir()
    copies = []
    for path in (*native._SOURCES, *native._HEADERS):
        copies.append(folder / path.name)
        shutil.copy(path, copies[-1])
    monkeypatch.setattr(native, "_SOURCES", tuple(copies[: len(native._SOURCES)]))
    monkeypatch.setattr(native, "_HEADERS", tuple(copies[len(native._SOURCES):]))
    return copies


def _no_process(*args, **kwargs):
    raise AssertionError(f"a process was started: {args}")


def test_the_key_is_found_without_running_the_compiler(compiler_copy: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    before = native.library_path(str(compiler_copy), tmp_path / "cache")
    monkeypatch.setattr(subprocess, "run", _no_process)
    monkeypatch.setattr(subprocess, "Popen", _no_process)
    assert native.library_path(str(compiler_copy), tmp_path / "cache") == before


def test_a_built_library_is_found_without_running_the_compiler(compiler_copy: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    built = native.library_path(str(compiler_copy), cache)
    cache.mkdir()
    built.write_bytes(b"a library built earlier")
    monkeypatch.setattr(subprocess, "run", _no_process)
    assert native.build_library(str(compiler_copy), cache) == built


def test_the_key_changes_with_the_compiler(compiler_copy: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = native.library_path(str(compiler_copy), cache)
    # an upgrade in place: another file of another size and time under the same name
    stat = compiler_copy.stat()
    compiler_copy.write_text(compiler_copy.read_text() + "# upgraded\n")
    assert native.library_path(str(compiler_copy), cache) != first
    # the same size, only a newer modification time
    text = compiler_copy.read_text()
    compiler_copy.write_text(text.replace("# upgraded", "# upgrade2"))
    second = native.library_path(str(compiler_copy), cache)
    os.utime(compiler_copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert native.library_path(str(compiler_copy), cache) != second


def test_the_key_follows_a_link_to_the_compiler(compiler_copy: Path, tmp_path: Path) -> None:
    """``cc`` is usually a chain of links: the file at its end is what is keyed, so a link
    switched to another compiler (update-alternatives) changes the key."""
    link = tmp_path / "bin" / "cc-link"
    link.symlink_to(compiler_copy)
    cache = tmp_path / "cache"
    assert native.library_path(str(link), cache) == native.library_path(str(compiler_copy), cache)
    other = tmp_path / "bin" / "othercc"
    other.write_text(compiler_copy.read_text() + "# another compiler\n")
    other.chmod(0o755)
    link.unlink()
    link.symlink_to(other)
    assert native.library_path(str(link), cache) != native.library_path(str(compiler_copy), cache)


def test_the_key_changes_with_a_source(compiler_copy: Path, tmp_path: Path, sources_copy: list[Path]) -> None:
    cache = tmp_path / "cache"
    first = native.library_path(str(compiler_copy), cache)
    for path in (sources_copy[0], sources_copy[-1]):  # a .c file, then a header
        before = native.library_path(str(compiler_copy), cache)
        path.write_text(path.read_text() + "\n/* changed */\n")
        assert native.library_path(str(compiler_copy), cache) not in (before, first)


@pytest.mark.skipif(native._compiler() is None, reason="no C compiler here")
def test_a_changed_compiler_builds_anew(compiler_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end with a tiny source: built once, reused, rebuilt after the compiler changes."""
    source = tmp_path / "tiny.c"
    source.write_text("int bargein_tiny(void) { return 7; }\n")
    monkeypatch.setattr(native, "_SOURCES", (source,))
    monkeypatch.setattr(native, "_HEADERS", ())
    cache = tmp_path / "cache"
    first = native.build_library(str(compiler_copy), cache)
    assert first.is_file() and native.build_library(str(compiler_copy), cache) == first
    compiler_copy.write_text(compiler_copy.read_text() + "# upgraded\n")
    second = native.build_library(str(compiler_copy), cache)
    assert second != first and second.is_file()
    assert sorted(p.name for p in cache.iterdir()) == sorted([first.name, second.name])
