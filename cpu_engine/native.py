"""Our C kernels (cpu_engine/int8_gemm.c, cpu_engine/float32_gemm.c, cpu_engine/paged_attention.c): compiled on
first use, found again, and loaded only where no one else could have put them.

Each file is compiled with the system's C compiler (`CC`, else `cc`) into NUMBA_CACHE_DIR (where numba's
compiled kernels also go; the package's __pycache__ when unset, else a directory of this user's own in the temp
directory), once per source (with the headers it includes: cpu_engine/gemm_common.h), flags and compiler, and
loaded only from a file and directory that this user owns and no one else may write. Without a compiler, or on
a CPU without the instructions a kernel needs, `load` says why in the server log and returns None: the engine
keeps PyTorch's kernels there.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import re
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

# The kernels loaded so far, and the threads they were told to use (set_threads; a kernel loaded later is told too).
_loaded: list[ctypes.CDLL] = []
_threads = 1


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo lists them (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def library_dirs() -> list[Path]:
    configured = os.environ.get("NUMBA_CACHE_DIR")
    return ([Path(configured)] if configured else []) + [
        Path(__file__).with_name("__pycache__"), Path(tempfile.gettempdir()) / f"cpu_engine-kernels-{os.getuid()}"]


def _trusted(library: Path) -> bool:
    """Whether `library` and its directory are ours and writable by no one else: the process loads it as code,
    so a file another user could have put there (a shared temp directory) is never loaded."""
    for path in (library, library.parent):
        status = path.stat()
        if status.st_uid != os.getuid() or status.st_mode & 0o022:
            return False
    return True


_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def _source_text(source: Path, seen: frozenset[Path] = frozenset()) -> bytes:
    """`source` and, after it, every file it includes with `#include "..."` (from its own directory, as the
    compiler finds them), recursively: what the library's name must change with, or an edited header would
    leave the old library in use."""
    text = source.read_bytes()
    for name in _LOCAL_INCLUDE.findall(text):
        header = (source.parent / name.decode()).resolve()
        if header not in seen:
            text += _source_text(header, seen | {source.resolve(), header})
    return text


def compile_library(source: Path, flags: tuple[str, ...]) -> Path:
    """The compiled library, built once per source (with the headers it includes), flags and compiler: a
    process that finds it skips the compiler; concurrent first starts each write their own file and rename it
    into place."""
    compiler = os.environ.get("CC", "cc")
    digest = hashlib.sha256(_source_text(source) + " ".join((compiler, *flags)).encode()).hexdigest()[:16]
    name = f"{source.stem}-{digest}.so"
    for directory in library_dirs():
        if (directory / name).is_file() and _trusted(directory / name):
            return directory / name
    errors = []
    for directory in library_dirs():
        staging = directory / f".{name}.{os.getpid()}.tmp"
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not _trusted(directory):
                raise PermissionError("not ours alone")
            subprocess.run([compiler, *flags, "-o", str(staging), str(source)], check=True, capture_output=True,
                           text=True, timeout=120)
            staging.chmod(0o755)  # whatever the umask: a library others may write would not be loaded again
            return staging.replace(directory / name)
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"{compiler} failed: {exc.stderr.strip()[-500:]}") from exc
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"{compiler} took over {exc.timeout:.0f} s") from exc
        except FileNotFoundError as exc:
            if exc.filename == compiler:
                raise RuntimeError(f"no C compiler ({compiler})") from exc
            errors.append(f"{directory}: {exc}")
        except OSError as exc:  # not writable: the next directory
            errors.append(f"{directory}: {exc}")
        finally:
            with contextlib.suppress(OSError):  # what a failed or timed-out compile left (after a rename: nothing)
                staging.unlink(missing_ok=True)
    raise RuntimeError("no writable directory for the compiled kernel: " + "; ".join(errors))


def load(source: Path, flags: tuple[str, ...], required_cpu_flags: frozenset[str], argtypes: list,
         fallback: str) -> ctypes._CFuncPtr | None:
    """The kernel's entry point (the function named as the source file), or None where it cannot run here: not
    x86, a CPU without `required_cpu_flags`, or no compiler (the reason is logged with `fallback`, what runs
    instead)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    missing = required_cpu_flags - cpu_flags()
    if missing:
        log.info("%s: not on this CPU (lacks %s); %s", source.name, ", ".join(sorted(missing)), fallback)
        return None
    try:
        library = ctypes.CDLL(str(compile_library(source, flags)))
        function = getattr(library, source.stem)
        library.threads = getattr(library, f"{source.stem}_threads")
    except (RuntimeError, OSError, AttributeError) as exc:
        log.warning("%s is not available (%s); %s", source.name, exc, fallback)
        return None
    function.restype = library.threads.restype = None
    function.argtypes = argtypes
    library.threads.argtypes = [ctypes.c_int]
    library.threads(_threads)
    _loaded.append(library)
    return function


def set_threads(threads: int) -> None:
    """Our kernels split each product over `threads` threads (OpenMP, in the kernel; products whose weights take
    under 256 KiB stay on one thread, where a team's start costs more than it saves).

    Why a team of its own, apart from PyTorch's: a product of a few rows is its weights read from memory, and one
    core does not read as fast as the machine can: on a 2-core AMD EPYC one thread read 24-25 GB/s, two 31-32 (a
    plain 320 MB sum); `small`'s plain batch-1 float32 step took 10.2 ms on two threads against 13.4 on one, int8
    3.3 against 4.0; a product of many rows is compute, and the second vCPU adds ~1.5x of it: batch 16 21.5
    against 31.6 and 11.2 against 14.1. Where the engine chooses (cpu_num_threads 0) it uses every core only
    where a step is long (cpu_engine.engine.choose_kernel_threads)."""
    global _threads
    _threads = threads
    for library in _loaded:
        library.threads(threads)
