"""Find a tritonserver binary and run it as a supervised child process.

Two installs are supported: the NGC image (``tritonserver`` on PATH, backends in /opt/tritonserver) and,
on machines without a GPU or docker, the ``nvidia-pytriton`` wheel, which ships a real tritonserver and
the Python backend but not in the layout tritonserver expects; we assemble that layout under a work dir.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

NGC_BACKEND_DIR = Path("/opt/tritonserver/backends")
SHM_DIR = Path("/dev/shm")
LOG_TAIL_LINES = 40
# A load that times out: the engine model (model_repository/tensorrt_llm/1/model.py) writes every thread's
# Python stack to the log on this signal, and the error shows them (a few hundred lines for ~15 threads).
STACK_DUMP_SIGNAL = signal.SIGUSR1
STACK_DUMP_TAIL_LINES = 400
STACK_DUMP_MARKER = "(most recent call first)"  # faulthandler's header of each thread's stack
STACK_DUMP_WAIT_S = 5.0
STUB_PROGRAM = "triton_python_backend_stub"


class TritonNotFoundError(RuntimeError):
    """Neither a tritonserver on PATH nor the nvidia-pytriton wheel is available."""


class TritonStartError(RuntimeError):
    """tritonserver exited or did not become ready; the message carries the tail of its log."""


@dataclass(frozen=True)
class TritonInstall:
    """Everything needed to exec tritonserver: the binary, its backends and extra environment."""

    binary: Path
    backend_dir: Path
    env: dict[str, str] = field(default_factory=dict)


# ----- locating an install ------------------------------------------------------------------------------
def find_tritonserver(work_dir: Path) -> TritonInstall:
    """Prefer a system tritonserver (NGC image); else build a usable layout from the pytriton wheel."""
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonInstall(binary=Path(on_path), backend_dir=NGC_BACKEND_DIR, env={})
    wheel_root = _pytriton_tritonserver_dir()
    if wheel_root is None:
        raise TritonNotFoundError(
            "no tritonserver found: it is not on PATH and the nvidia-pytriton wheel is not installed; "
            "install the engine extras (pip install -e '.[engine]') or run inside the Triton NGC image"
        )
    return _install_from_wheel(wheel_root, Path(work_dir))


def _pytriton_tritonserver_dir() -> Path | None:
    """The wheel's ``pytriton/tritonserver`` directory, found without importing pytriton (it is heavy)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    return root if (root / "bin" / "tritonserver").is_file() else None


def _install_from_wheel(wheel_root: Path, work_dir: Path) -> TritonInstall:
    """Assemble backends/python (library + stub for this Python) and the library path the binary needs."""
    backend_dir = work_dir / "triton_backends"
    python_dir = backend_dir / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for src in (wheel_root / "backends" / "python").iterdir():
        if src.is_file():
            _copy_if_changed(src, python_dir / src.name)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = wheel_root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise TritonNotFoundError(f"the nvidia-pytriton wheel has no Python backend stub for Python {version}")
    stub_dst = python_dir / stub.name
    _copy_if_changed(stub, stub_dst)
    stub_dst.chmod(0o755)
    site_packages = wheel_root.parent.parent
    return TritonInstall(
        binary=wheel_root / "bin" / "tritonserver",
        backend_dir=backend_dir,
        env={
            "LD_LIBRARY_PATH": _library_path(site_packages / "nvidia_pytriton.libs"),
            # The stub's embedded Python finds its prefix through the `python` on PATH: put this
            # environment's first so the models import its packages (torch, transformers, cpu_engine).
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        },
    )


def _copy_if_changed(src: Path, dst: Path) -> None:
    """Copy unless an equally sized file is there; write-then-rename so a concurrent run never sees half a file."""
    if dst.is_file() and dst.stat().st_size == src.stat().st_size:
        return
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def _library_path(wheel_libs: Path) -> str:
    """Wheel's bundled libs (libcudart etc. for the stub) + libpython's dir (the stub embeds Python) + existing."""
    parts = [str(wheel_libs)]
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir:
        parts.append(str(libdir))
    existing = os.environ.get("LD_LIBRARY_PATH")
    if existing:
        parts.append(existing)
    return os.pathsep.join(parts)


# ----- running a server ---------------------------------------------------------------------------------
# Triton's endpoints that change the server (load/unload/repository index, tracing, logging, shared-memory
# registration: tracing and verbose logging would record prompts) need CONTROL_HEADER; Triton's gRPC
# server expects it as `triton-grpc-protocol-<header>` (grpc_control_headers).
RESTRICTED_APIS = "model-repository,trace,logging,shared-memory"
CONTROL_HEADER = "triton-control-key"


def new_control_key() -> str:
    return secrets.token_urlsafe(32)


def grpc_control_headers(key: str) -> dict[str, str]:
    """The gRPC metadata a restricted Triton gRPC call must carry."""
    return {f"triton-grpc-protocol-{CONTROL_HEADER}": key}


class TritonServer:
    """One tritonserver process in its own process group, bound to loopback, logging to a file.

    Its own process group lets stop() take down the Python backend stubs too, which otherwise outlive a
    killed tritonserver and keep their shared-memory regions. Use as a context manager: start on enter,
    stop on exit (call wait_ready() inside).
    """

    def __init__(
        self,
        model_repository: Path,
        http_port: int,
        grpc_port: int,
        metrics_port: int,
        log_file: Path,
        work_dir: Path,
        model_name: str = "tensorrt_llm",
        extra_args: Sequence[str] = (),
        control_key: str | None = None,
    ) -> None:
        self.model_repository = Path(model_repository)
        self.http_port = http_port
        self.grpc_port = grpc_port
        self.metrics_port = metrics_port
        self._log_file = Path(log_file)
        self.work_dir = Path(work_dir)
        self.model_name = model_name
        self.extra_args = tuple(extra_args)
        # Triton's control endpoints answer only requests that carry this key (see command()); a fresh
        # random one unless the caller keeps one across restarts (the launcher, so its frontend keeps it).
        self.control_key = control_key or new_control_key()
        self._install: TritonInstall | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopped = False

    @property
    def install(self) -> TritonInstall:
        """Located lazily so that building the command for tests/printing needs no copying twice."""
        if self._install is None:
            self._install = find_tritonserver(self.work_dir)
        return self._install

    @property
    def pid(self) -> int | None:
        """PID of tritonserver (also its process group id), or None before start()."""
        return self._proc.pid if self._proc is not None else None

    @property
    def log_file(self) -> Path:
        return self._log_file

    @property
    def shm_prefix(self) -> str:
        """Names of this server's Python-backend shared-memory regions start with it (per gRPC port)."""
        return f"prefix{self.grpc_port}_"

    def command(self) -> list[str]:
        """The argv; loopback only, and a per-server shm prefix so two servers on one host don't collide."""
        return [
            str(self.install.binary),
            f"--model-repository={self.model_repository}",
            "--http-address=127.0.0.1",
            f"--http-port={self.http_port}",
            "--grpc-address=127.0.0.1",
            f"--grpc-port={self.grpc_port}",
            "--metrics-address=127.0.0.1",
            f"--metrics-port={self.metrics_port}",
            f"--backend-directory={self.install.backend_dir}",
            "--disable-auto-complete-config",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            "--exit-on-error=true",
            # Explicit model control, every model loaded at start: the same models as the default mode, but a
            # model can be unloaded at run time, which is how the CPU engine takes itself out of readiness
            # when its engine thread dies (model_repository/tensorrt_llm/1/model.py).
            "--model-control-mode=explicit",
            "--load-model=*",
            "--log-verbose=0",
            # Control endpoints only with the key: in explicit mode anyone who reaches the ports could otherwise
            # unload models or load their own Python as a model. Health, metadata, model config, inference and
            # statistics stay open to the frontend and the probes. Triton takes the key only here, on its
            # command line (README, "Triton's control API").
            f"--http-restricted-api={RESTRICTED_APIS}:{CONTROL_HEADER}={self.control_key}",
            f"--grpc-restricted-protocol={RESTRICTED_APIS}:{CONTROL_HEADER}={self.control_key}",
            *self.extra_args,
        ]

    @property
    def control_headers(self) -> dict[str, str]:
        """What an HTTP request to a restricted endpoint must carry (gRPC: `grpc_control_headers`)."""
        return {CONTROL_HEADER: self.control_key}

    def start(self) -> None:
        """Launch tritonserver; returns at once (see wait_ready)."""
        if self._proc is not None:
            raise RuntimeError("TritonServer already started")
        argv = self.command()
        # How long the CPU engine's OpenMP threads spin between parallel regions before they sleep. Spinning
        # long steals the cores the frontend and Triton need on a small CPU box (2 cores, concurrency 16:
        # 49 tok/s spinning, 84 default, 89 never spinning, OMP_WAIT_POLICY=PASSIVE); never spinning pays a
        # wake-up for each of the forward pass's hundreds of parallel regions (a batch-1 step ~25% slower).
        # A short spin (about the gap between two ops of one step) keeps the threads awake through a step
        # and lets them sleep between steps: the small preset, same run, c=1 38.4 and 35.7 tok/s against
        # 28.9 and 32.6 with PASSIVE, c=16 even (178 and 171 against 166 and 182). Either is overridable.
        env = {"GOMP_SPINCOUNT": "10000", **os.environ, **self.install.env}
        self._log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self._log_file, "wb") as log:
            self._proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def poll(self) -> int | None:
        """Exit code if tritonserver has exited, else None."""
        return self._proc.poll() if self._proc is not None else None

    def wait_ready(self, timeout_s: float) -> float:
        """Block until the server and ``model_name`` report ready; return the seconds it took.

        Raises TritonStartError (with the log tail) if the process exits first or the timeout passes, so a
        failed model load is reported as the model's error, not as a bare timeout.
        """
        if self._proc is None:
            raise RuntimeError("TritonServer not started")
        started = time.monotonic()
        deadline = started + timeout_s
        while True:
            code = self._proc.poll()
            if code is not None:
                raise TritonStartError(f"tritonserver exited with code {code} before it was ready\n{self.log_tail()}")
            if self.is_ready():
                return time.monotonic() - started
            if time.monotonic() >= deadline:
                lines = STACK_DUMP_TAIL_LINES if self.dump_stub_stacks() else LOG_TAIL_LINES
                raise TritonStartError(
                    f"tritonserver (model {self.model_name!r}) not ready after {timeout_s:.0f} s\n"
                    f"{self.log_tail(lines)}"
                )
            time.sleep(0.25)

    def is_ready(self) -> bool:
        """One non-blocking look: the server and ``model_name`` both ready (the supervisor polls this after a
        restart instead of blocking in wait_ready, so it keeps watching the frontend meanwhile)."""
        urls = [self._url("/v2/health/ready"), self._url(f"/v2/models/{self.model_name}/ready")]
        return all(_http_ok(url) for url in urls)

    def dump_stub_stacks(self) -> bool:
        """Have this server's Python-backend stubs write their threads' Python stacks to the log, so that a
        load that never ends says where it waits; True once a dump reached the log (waits up to
        STACK_DUMP_WAIT_S for it). Only stubs that catch STACK_DUMP_SIGNAL are signalled: SIGUSR1's default
        action would kill another model's stub."""
        if self._proc is None or self._proc.poll() is not None:
            return False
        stubs = [pid for pid in group_members(self._proc.pid)
                 if pid != self._proc.pid and _program(pid) == STUB_PROGRAM and catches_signal(pid, STACK_DUMP_SIGNAL)]
        if not stubs:
            return False
        try:
            start = self._log_file.stat().st_size
        except OSError:
            return False
        for pid in stubs:
            try:
                os.kill(pid, STACK_DUMP_SIGNAL)
            except (ProcessLookupError, PermissionError):
                continue
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        while time.monotonic() < deadline:
            with open(self._log_file, "rb") as log:
                log.seek(start)
                if STACK_DUMP_MARKER.encode() in log.read():
                    time.sleep(0.5)  # the other stubs' dumps, and the rest of this one's threads
                    return True
            time.sleep(0.1)
        return False

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """Error lines of the whole log, then its last lines, framed, for error messages.

        The tail alone is not enough: after a failed model load Triton prints its status tables and
        shutdown chatter, which push the actual cause (e.g. a config parse error) out of the last 40 lines.
        """
        try:
            text = self._log_file.read_text(errors="replace")
        except OSError as exc:
            return f"(no log at {self._log_file}: {exc})"
        all_lines = text.splitlines()
        tail = all_lines[-lines:]
        errors = [line for line in all_lines[:-lines] if _is_error_line(line)] if len(all_lines) > lines else []
        parts = []
        if errors:
            parts += [f"--- errors earlier in {self._log_file} ---", *errors]
        parts += [f"--- last {lines} lines of {self._log_file} ---", *tail, "--- end of log ---"]
        return "\n".join(parts)

    def stop(self, grace_s: float = 35) -> None:
        """SIGTERM the whole group, wait up to grace_s, then SIGKILL it; safe to call repeatedly. The default is
        Triton's own --exit-timeout-secs (30 s, for in-flight requests and model unloads) and a margin: a busy
        machine unloading Python-backend stubs took more than 15 s, and a SIGKILL then leaves their regions."""
        if self._proc is None or self._stopped:
            return
        # Mark first: signalling a group id again later could hit a recycled pid.
        self._stopped = True
        terminate_group(self._proc, grace_s)
        if self._proc.returncode != 0:
            # Killed or crashed: Triton did not unlink its stubs' regions (1 MiB+ each in /dev/shm, which is
            # 64 MiB in a default container), and a supervised restart would leak them again on every crash.
            # The group is gone and the gRPC port (hence the prefix) is still ours: nothing else uses them.
            remove_shm_regions(self.shm_prefix)

    def _url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http_port}{path}"

    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


# Errors every CPU-only start logs (no CUDA driver); not the reason anything failed.
_HARMLESS_ERRORS = ("CudaDriverHelper has not been initialized",)


def _is_error_line(line: str) -> bool:
    """Triton's glog error lines (E1129 ...), protobuf parse errors and the final 'error: ...'."""
    if any(harmless in line for harmless in _HARMLESS_ERRORS):
        return False
    return (len(line) > 1 and line[0] == "E" and line[1].isdigit()) or "ERROR" in line or line.startswith("error:")


def _http_ok(url: str) -> bool:
    """True on HTTP 200; connection refused / 4xx / 5xx all mean 'not yet'."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def remove_shm_regions(prefix: str, shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the shared-memory regions whose names start with ``prefix``; returns the names removed."""
    removed = []
    try:
        entries = list(shm_dir.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if entry.name.startswith(prefix):
            try:
                entry.unlink()
            except OSError:  # gone meanwhile, or not ours to remove
                continue
            removed.append(entry.name)
    return removed


# ----- process-group helpers (shared with __main__ for the frontend) ------------------------------------
def group_alive(pgid: int) -> bool:
    """Whether any process of the group still exists (signal 0 probes without delivering)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_members(pgid: int) -> list[int]:
    """The pids of the process group `pgid` (from /proc: field 5 of /proc/<pid>/stat is the group)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ", which may hold spaces
        if len(fields) > 2 and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def catches_signal(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler for `sig` (SigCgt in /proc/<pid>/status: a hex mask, bit sig-1)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    return False


def _program(pid: int) -> str:
    """The file name of the program process `pid` runs ("" when gone)."""
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0]
    except OSError:
        return ""
    return Path(argv0.decode(errors="replace")).name


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def terminate_group(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """Stop a child started with start_new_session=True and everything it spawned.

    SIGTERM first so servers shut down cleanly (Triton unloads models, stubs free shared memory); SIGKILL
    what is left after grace_s, including grandchildren that outlive the leader.
    """
    pgid = proc.pid
    if proc.poll() is None:
        _signal_group(pgid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    else:
        # Leader already gone: orphaned members (e.g. backend stubs) get the same polite request.
        _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + min(grace_s, 5.0)
    while group_alive(pgid) and time.monotonic() < deadline and proc.poll() is not None:
        time.sleep(0.1)
    _signal_group(pgid, signal.SIGKILL)
    proc.wait()
