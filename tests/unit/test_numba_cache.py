"""cpu_engine.numba_cache: a cached kernel never runs stale code of a function it calls from another module.

Each case runs in a fresh interpreter (numba's cache is read at a process's first call), over a small package in a
temporary directory: `caller.g` calls `callee.f`, both cached on disk.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CALLER = "import numba\nfrom pkg.callee import f\n\n\n@numba.njit(cache=True)\ndef g():\n    return f() + 1\n"


def callee(value: int) -> str:
    return f"import numba\n\n\n@numba.njit(cache=True)\ndef f():\n    return {value}\n"


@pytest.fixture
def package(tmp_path: Path) -> Path:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "callee.py").write_text(callee(1))
    (pkg / "caller.py").write_text(CALLER)
    return pkg


def call_g(package: Path, watched: bool) -> int:
    watch = f"import cpu_engine.numba_cache as c; c.install(Path({str(package)!r}))\n" if watched else ""
    code = f"from pathlib import Path\n{watch}from pkg.caller import g\nprint(g())\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package.parent), str(REPO_ROOT)])}
    env.pop("NUMBA_CACHE_DIR", None)  # the package's own __pycache__
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


def test_a_cached_kernel_is_recompiled_when_a_function_it_calls_changes(package: Path) -> None:
    assert call_g(package, watched=True) == 2
    (package / "callee.py").write_text(callee(10))  # the caller's own file is untouched
    assert call_g(package, watched=True) == 11


def test_an_unchanged_package_loads_its_kernels_from_the_cache(package: Path) -> None:
    assert call_g(package, watched=True) == 2
    cached = {path: path.stat().st_mtime_ns for path in (package / "__pycache__").glob("*.nb*")}
    assert {path.name.split("-")[0] for path in cached} == {"callee.f", "caller.g"}
    assert call_g(package, watched=True) == 2
    assert {path: path.stat().st_mtime_ns for path in (package / "__pycache__").glob("*.nb*")} == cached


def test_the_cpu_engine_package_is_watched() -> None:
    import cpu_engine
    from cpu_engine import fused_step, numba_cache

    assert fused_step.decode_step._cache._impl.locator.__class__.__module__ == numba_cache.__name__
    assert numba_cache.sources_stamp(Path(cpu_engine.__file__).resolve().parent)
