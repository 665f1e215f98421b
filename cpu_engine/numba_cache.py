"""numba's on-disk cache, made safe across changes to the functions a cached kernel calls.

numba stamps a cached function with its own source file's modification time and size, and nothing else: a
kernel that calls (and so compiles in) a function from another file keeps its cached machine code when only
that other file changes. Seen here: fused_step's cached step kept an old row kernel of row_kernels.py until its
cache files were deleted by hand; a deployment that keeps NUMBA_CACHE_DIR across an upgrade would run the old
code with nothing in the log. So every function compiled from a watched package (this one) is stamped with a
hash of all of that package's modules that hold numba code: a change to any of them recompiles every such
kernel once (the first start after an upgrade takes its ~30-60 s of compiling again), and a kernel never runs
stale code. Functions outside the watched packages keep numba's own locators and stamps.

`install()` runs when cpu_engine is imported, before any of its kernels is defined (numba picks a function's
cache locator when its decorator runs).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from numba.core import caching, config

_watched: set[Path] = set()


@functools.cache
def sources_stamp(package_dir: Path) -> str:
    digest = hashlib.sha256()
    for module in sorted(package_dir.glob("*.py")):
        text = module.read_bytes()
        if b"numba" in text:
            digest.update(module.name.encode() + b"\0" + text + b"\0")
    return digest.hexdigest()


def _watched_dir(py_file: str) -> Path | None:
    directory = Path(py_file).resolve().parent
    return directory if directory in _watched else None


class _PackageStamped:
    """A numba cache locator of functions in a watched package, whose stamp is the package's sources' hash."""

    _package_dir: Path

    @classmethod
    def from_function(cls, py_func, py_file):
        package_dir = _watched_dir(py_file)
        if package_dir is None:
            return None
        locator = super().from_function(py_func, py_file)
        if locator is not None:
            locator._package_dir = package_dir
        return locator

    def get_source_stamp(self):
        return sources_stamp(self._package_dir)


class UserProvidedLocator(_PackageStamped, caching.UserProvidedCacheLocator):
    """NUMBA_CACHE_DIR, where set (as numba's own first choice)."""


class InTreeLocator(_PackageStamped, caching.InTreeCacheLocator):
    """The package's __pycache__, where writable."""


class UserWideLocator(_PackageStamped, caching.UserWideCacheLocator):
    """The user's cache directory, where the package's is not writable."""


def install(package_dir: Path) -> None:
    """Stamp the kernels of the modules in `package_dir` with the hash of its modules that hold numba code: put
    the stamped locators ahead of numba's own (numba tries them in order; each declines functions outside the
    watched packages, which then get numba's usual locators)."""
    _watched.add(Path(package_dir).resolve())
    sources_stamp.cache_clear()
    ours = [f"{__name__}.{cls.__name__}" for cls in (UserProvidedLocator, InTreeLocator, UserWideLocator)]
    current = config.CACHE_LOCATOR_CLASSES or ",".join(
        f"{cls.__module__}.{cls.__qualname__}" for cls in caching.CacheImpl._locator_classes)
    if ours[0] not in current:
        config.CACHE_LOCATOR_CLASSES = ",".join(ours + [current])
