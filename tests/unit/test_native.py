"""How our C kernels (cpu_engine.native: int8_gemm.c, float32_gemm.c) are built, found again and refused, and
what the engine runs without them."""

from __future__ import annotations

import ctypes
import platform
import shutil
from pathlib import Path

import pytest
import torch

from cpu_engine import float32_gemm, native, vnni_gemm
from cpu_engine.int8 import Int8Projection, default_kernel
from cpu_engine.runner import Projection

KERNELS = [pytest.param(vnni_gemm, id="int8_gemm.c"), pytest.param(float32_gemm, id="float32_gemm.c")]


@pytest.mark.skipif(shutil.which("cc") is None or platform.machine() not in ("x86_64", "AMD64"),
                    reason="needs a C compiler for x86 (the flags are AVX-512's)")
@pytest.mark.parametrize("kernel", KERNELS)
def test_the_library_is_built_once_and_found_again(kernel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "library_dirs", lambda: [tmp_path / "read-only", tmp_path / "cache"])
    (tmp_path / "read-only").write_text("a file, not a directory")
    library = native.compile_library(kernel.SOURCE, kernel.FLAGS)
    assert library.parent == tmp_path / "cache" and library.is_file()
    assert not list(library.parent.glob(".*.tmp"))  # built under a staging name, renamed into place
    built = library.stat().st_mtime_ns
    assert native.compile_library(kernel.SOURCE, kernel.FLAGS) == library  # found, not built again
    assert library.stat().st_mtime_ns == built
    library.chmod(0o666)  # a file others may write is never loaded: built again, in its place
    assert native.compile_library(kernel.SOURCE, kernel.FLAGS) == library and library.stat().st_mode & 0o022 == 0


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_an_edited_header_builds_a_new_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The library's name covers the headers its source includes: after an edit to one (here one included
    through another) the new code runs, not the library built before it."""
    monkeypatch.setattr(native, "library_dirs", lambda: [tmp_path / "cache"])
    source = tmp_path / "answer.c"
    source.write_text('#include "outer.h"\nint answer(void) { return VALUE; }\n')
    (tmp_path / "outer.h").write_text('#include "inner.h"\n')
    flags = ("-O1", "-fPIC", "-shared")

    def answer() -> int:
        return ctypes.CDLL(str(native.compile_library(source, flags))).answer()

    (tmp_path / "inner.h").write_text("#define VALUE 41\n")
    first = native.compile_library(source, flags)
    assert answer() == 41
    (tmp_path / "inner.h").write_text("#define VALUE 42\n")
    assert native.compile_library(source, flags) != first and answer() == 42


def test_a_failed_compile_is_an_error_that_leaves_nothing_behind(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    compiler = tmp_path / "half-a-compiler"  # writes part of its output, then fails
    compiler.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\necho half > "$2"\nexit 1\n')
    compiler.chmod(0o755)
    monkeypatch.setattr(native, "library_dirs", lambda: [tmp_path / "cache"])
    monkeypatch.setenv("CC", str(compiler))
    with pytest.raises(RuntimeError, match="failed"):
        native.compile_library(float32_gemm.SOURCE, float32_gemm.FLAGS)
    assert not list((tmp_path / "cache").iterdir())


def test_without_a_compiler_the_engine_keeps_pytorchs_kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 weights on FBGEMM's product (or the weight-only kernel), float32 weights on oneDNN's."""
    monkeypatch.setattr(native, "library_dirs", lambda: [tmp_path])
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))  # another compiler: another name, none built
    with pytest.raises(RuntimeError, match="no C compiler"):
        native.compile_library(vnni_gemm.SOURCE, vnni_gemm.FLAGS)
    vnni_gemm.gemm.cache_clear()
    float32_gemm.gemm.cache_clear()
    try:
        assert vnni_gemm.gemm() is None and float32_gemm.gemm() is None
        assert default_kernel() in ("fbgemm", "fbgemm-residual", "weight-only")
        with pytest.raises(ValueError, match="cannot run on this machine"):
            Int8Projection(torch.zeros(32, 8, dtype=torch.int8), torch.ones(32), kernel="vnni")
        projection = Projection(torch.ones(32, 8))
        assert projection.kernel == "onednn" and not projection.fusable
        assert torch.equal(projection(torch.ones(1, 8)), torch.full((1, 32), 8.0))
    finally:
        monkeypatch.undo()
        vnni_gemm.gemm.cache_clear()
        float32_gemm.gemm.cache_clear()
