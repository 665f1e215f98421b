"""`python -m launcher serve`: Triton + the OpenAI frontend as one foreground command.

Starts tritonserver, waits until the engine model is ready, starts the frontend, waits until it answers,
prints where to send requests, and then supervises both: Ctrl+C / SIGTERM stops the frontend first (so no
request is accepted that Triton can no longer serve; it drains for SHUTDOWN_GRACE_S) and then Triton. If
either dies once it has served, it alone is restarted with back-off while the other keeps running
(launcher/supervise.py): the frontend answers 503 while Triton is down and reconnects by itself. Past
MAX_RESTARTS_PER_MINUTE restarts of one process within a minute the launcher gives up, stops the other,
and exits 1 with the reason (and Triton's log tail). The first start is not retried: a stack that never
came up has a cause to fix, not a crash to ride out. Nothing is left running on any path out
(try/finally). SIGHUP is forwarded to the frontend, which reloads API_KEYS_FILE. With SSL_CERTFILE and
SSL_KEYFILE the frontend serves HTTPS, and the readiness probes here use https (no certificate check:
they only ever connect to this machine).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from build_engine import model_store
from launcher.engine_check import check_model_repository, check_named_models, serves_tensorrt_llm
from launcher.engine_health import EngineHealth, Problem
from launcher.ports import PortInUseError, check_ports_free
from launcher.supervise import RestartBudgetExceeded, Supervisor
from launcher.tritonserver import (TritonNotFoundError, TritonServer, TritonStartError, new_control_key,
                                   terminate_group)

FRONTEND_READY_TIMEOUT_S = 120.0
FRONTEND_STOP_GRACE_S = 10.0  # after the frontend's own drain (SHUTDOWN_GRACE_S)
LEFTOVER_STOP_GRACE_S = 5.0  # what a crashed process left behind gets this long to go before SIGKILL
DEFAULT_MAX_RESTARTS_PER_MINUTE = 5
POLL_S = 0.5
ADMIN_KEY_FILE = "admin_api_key"
CONTROL_KEY_FILE = "triton_control_key"  # this launch's key to Triton's control API (for the frontend's rollouts)
HEALTH_PERIOD_S = 2.0  # how often the engine's health is checked (a probe request each time)
ADMIN_TIMEOUT_S = 1800.0  # a rollout loads a version and waits for the old one to drain (ROLLOUT_GRACE_S)

_frontend_pid: int | None = None  # where SIGHUP goes


class LaunchError(RuntimeError):
    """A failure worth one line to the user and exit code 1 (no traceback)."""


class _Shutdown(BaseException):
    """Raised from the signal handler so every wait unwinds through the finally blocks.

    BaseException, like KeyboardInterrupt, so no `except Exception` on the way swallows it.
    """


@dataclass(frozen=True)
class Config:
    """Where everything listens; ports come from the same env vars the Makefile and compose file use."""

    frontend_host: str
    frontend_port: int
    http_port: int
    grpc_port: int
    metrics_port: int
    model_repository: Path
    work_dir: Path
    engine_model: str
    triton_ready_timeout_s: float
    ssl_certfile: str = ""
    ssl_keyfile: str = ""
    shutdown_grace_s: float = 30.0
    max_restarts_per_minute: int = DEFAULT_MAX_RESTARTS_PER_MINUTE
    named_models: tuple[str, ...] = ()  # a repository of named models (make engine NAME=...): their names
    engine_unhealthy_s: float = 10.0  # a model no longer loaded this long is loaded again

    @property
    def admin_key_file(self) -> Path:
        """The admin key `make serve` makes when none is configured; `make rollout` reads it."""
        return self.work_dir / ADMIN_KEY_FILE

    @property
    def control_key_file(self) -> Path:
        return self.work_dir / CONTROL_KEY_FILE

    @property
    def triton_log(self) -> Path:
        return self.work_dir / "logs" / "tritonserver.log"

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"

    @property
    def frontend_base(self) -> str:
        """The frontend as the probes reach it (a wildcard bind is reachable on loopback)."""
        return f"{self.scheme}://{_probe_host(self.frontend_host)}:{self.frontend_port}"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"{name}={raw!r} is not an integer") from None


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise LaunchError(f"{name}={raw!r} is not a number") from None


def load_config(args: argparse.Namespace) -> Config:
    named = tuple(m.name for m in model_store.managed_models(Path(args.model_repository)))
    return Config(
        frontend_host=os.environ.get("FRONTEND_HOST") or "127.0.0.1",
        frontend_port=_env_int("FRONTEND_PORT", 9000),
        http_port=_env_int("TRITON_HTTP_PORT", 8000),
        grpc_port=_env_int("TRITON_GRPC_PORT", 8001),
        metrics_port=_env_int("TRITON_METRICS_PORT", 8002),
        model_repository=Path(args.model_repository),
        work_dir=Path(args.work_dir),
        # The frontend reads ENGINE_MODEL too, so one variable renames the model for both.
        # Named models: Triton is ready once one is (the frontend's readiness then waits for all of them).
        engine_model=named[0] if named else (os.environ.get("ENGINE_MODEL") or "tensorrt_llm"),
        triton_ready_timeout_s=_env_float("TRITON_READY_TIMEOUT", 600.0),
        ssl_certfile=os.environ.get("SSL_CERTFILE", ""),
        ssl_keyfile=os.environ.get("SSL_KEYFILE", ""),
        shutdown_grace_s=_env_float("SHUTDOWN_GRACE_S", 30.0),
        max_restarts_per_minute=_max_restarts_per_minute(),
        named_models=named,
        engine_unhealthy_s=_env_float("ENGINE_UNHEALTHY_S", 10.0),
    )


def _max_restarts_per_minute() -> int:
    """MAX_RESTARTS_PER_MINUTE, per supervised process; 0 turns restarts off (any death ends the launcher)."""
    value = _env_int("MAX_RESTARTS_PER_MINUTE", DEFAULT_MAX_RESTARTS_PER_MINUTE)
    if value < 0:
        raise LaunchError(f"MAX_RESTARTS_PER_MINUTE={value} must be 0 (no restarts) or more")
    return value


# ----- preflight ----------------------------------------------------------------------------------------
def preflight(cfg: Config) -> None:
    """Fail in a second, with the fix in the message, instead of after Triton has loaded for minutes."""
    triton_ports = {"TRITON_HTTP_PORT": cfg.http_port, "TRITON_GRPC_PORT": cfg.grpc_port,
                    "TRITON_METRICS_PORT": cfg.metrics_port}
    all_ports = {"FRONTEND_PORT": cfg.frontend_port, **triton_ports}
    if len(set(all_ports.values())) != len(all_ports):
        raise LaunchError(f"two services share a port: {all_ports}; give each its own")
    try:
        check_ports_free({"FRONTEND_PORT": cfg.frontend_port}, host=cfg.frontend_host)
        check_ports_free(triton_ports)
    except PortInUseError as exc:
        raise LaunchError(str(exc)) from None
    except OSError as exc:  # e.g. FRONTEND_HOST is not an address of this machine
        raise LaunchError(f"cannot bind FRONTEND_HOST={cfg.frontend_host!r}: {exc}") from None
    if bool(cfg.ssl_certfile) != bool(cfg.ssl_keyfile):
        raise LaunchError("set both SSL_CERTFILE and SSL_KEYFILE for HTTPS, or neither")
    for name, path in (("SSL_CERTFILE", cfg.ssl_certfile), ("SSL_KEYFILE", cfg.ssl_keyfile)):
        if path and not Path(path).is_file():
            raise LaunchError(f"{name}={path!r}: no such file")
    if not cfg.model_repository.is_dir():
        raise LaunchError(f"no model repository at {cfg.model_repository}; run `make engine` first")
    check_model_repository(cfg.model_repository)  # a TensorRT-LLM engine must match the installed version
    for warning in check_named_models(cfg.model_repository):
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    settle_models(cfg.model_repository)


def settle_models(repository: Path) -> None:
    """Before every start of Triton (which loads what the files say): a rollout interrupted by a stop, or by
    Triton's death, goes back to the version rollout.json records as live (model_store settle()). Otherwise
    Triton would load both versions, and with TensorRT-LLM the old one would read the new one's engine through
    the `live` link. A frontend rollout that finishes after this commits its version in full (policy, link and
    state together), and the frontend has Triton load it (frontend/models/registry.py refresh())."""
    for model in model_store.managed_models(repository):
        try:
            repaired = model.settle()
        except (model_store.ModelStoreError, OSError) as exc:  # Triton reports the model's load failure
            print(f"warning: model {model.name}: cannot settle its rollout state: {exc}", file=sys.stderr,
                  flush=True)
            continue
        if repaired:
            print(f"model {model.name}: an interrupted rollout was undone ({repaired}); version "
                  f"{model.live_version} is live", flush=True)


# ----- frontend -----------------------------------------------------------------------------------------
MAX_DEFAULT_WORKERS = 8


def default_frontend_workers(model_repository: Path) -> int:
    """FRONTEND_WORKERS when unset: one per core up to 8 in front of a TensorRT-LLM engine (the GPU makes
    tokens faster than one Python process relays them); 1 in front of the CPU engine, which needs the cores
    for its forward pass far more than the frontend needs them to relay what it makes (README, "Frontend
    workers")."""
    if not serves_tensorrt_llm(model_repository):
        return 1
    return max(1, min(MAX_DEFAULT_WORKERS, len(os.sched_getaffinity(0))))


def start_frontend(cfg: Config) -> subprocess.Popen[bytes]:
    """Own process group (we decide when it stops); output inherited so its log shows on the console."""
    env = {
        **os.environ,
        "FRONTEND_HOST": cfg.frontend_host,
        "FRONTEND_PORT": str(cfg.frontend_port),
        "TRITON_GRPC_URL": f"127.0.0.1:{cfg.grpc_port}",
        "TRITON_HTTP_URL": f"127.0.0.1:{cfg.http_port}",
        "TRITON_METRICS_URL": f"http://127.0.0.1:{cfg.metrics_port}/metrics",
        "TRITON_CONTROL_KEY_FILE": str(cfg.control_key_file.resolve()),
        "ENGINE_MODEL": cfg.engine_model,
        # Stored /v1/responses: in the work dir, unless the environment names a database.
        "RESPONSES_DB_URL": os.environ.get("RESPONSES_DB_URL")
        or f"sqlite:///{(cfg.work_dir / 'responses.sqlite3').resolve()}",
    }
    if not os.environ.get("FRONTEND_WORKERS"):
        env["FRONTEND_WORKERS"] = str(default_frontend_workers(cfg.model_repository))
    if cfg.named_models:
        env["MODEL_REPOSITORY"] = str(cfg.model_repository.resolve())
        if not (os.environ.get("ADMIN_API_KEYS") or os.environ.get("ADMIN_API_KEYS_FILE")):
            env["ADMIN_API_KEYS_FILE"] = str(ensure_admin_key(cfg.admin_key_file))
    return subprocess.Popen([sys.executable, "-m", "frontend"], env=env, stdin=subprocess.DEVNULL,
                            start_new_session=True)


def _probe_host(host: str) -> str:
    """A wildcard bind address is not something to connect to; loopback reaches it."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def _loopback_tls() -> ssl.SSLContext:
    """For probing our own frontend on this machine: encrypted, certificate not checked (it may well be
    self-signed, or issued for a public name rather than 127.0.0.1)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def first_key(keys_var: str, file_var: str, fallback_file: Path | None = None) -> str | None:
    """The first key of a comma-separated variable, else of the key file a variable names (else of
    `fallback_file`): what the launcher presents to its own frontend (never printed)."""
    keys = [k.strip() for k in os.environ.get(keys_var, "").split(",") if k.strip()]
    if keys:
        return keys[0]
    for path in (os.environ.get(file_var), fallback_file):
        if not path:
            continue
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError:
            continue
        keys = [k.strip() for k in lines if k.strip() and not k.strip().startswith("#")]
        if keys:
            return keys[0]
    return None


def probe_api_key() -> str | None:
    """A key for the launcher's own /v1/models call when the frontend requires keys."""
    return first_key("API_KEYS", "API_KEYS_FILE")


def _http_get(url: str, timeout_s: float = 2.0, api_key: str | None = None) -> tuple[int, bytes] | None:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    context = _loopback_tls() if url.startswith("https://") else None
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except (urllib.error.URLError, OSError):
        return None


def wait_frontend_ready(cfg: Config, frontend: subprocess.Popen[bytes], triton: TritonServer) -> None:
    base = cfg.frontend_base
    deadline = time.monotonic() + FRONTEND_READY_TIMEOUT_S
    while True:
        _check_alive(frontend, triton)
        answer = _http_get(f"{base}/health/ready")
        if answer is not None and answer[0] == 200:
            return
        if time.monotonic() >= deadline:
            raise LaunchError(f"frontend not ready at {base}/health/ready after {FRONTEND_READY_TIMEOUT_S:.0f} s")
        time.sleep(POLL_S)


def served_model_id(cfg: Config) -> str:
    """The ids clients may send, as the frontend reports them (falls back to '?' rather than failing)."""
    answer = _http_get(f"{cfg.frontend_base}/v1/models", timeout_s=5, api_key=probe_api_key())
    if answer is None or answer[0] != 200:
        return "?"
    try:
        return ", ".join(str(card["id"]) for card in json.loads(answer[1])["data"]) or "?"
    except (ValueError, KeyError, IndexError, TypeError):
        return "?"


# ----- administration: the admin key, rollout and rollback ----------------------------------------------
def write_secret(path: Path, secret: str) -> Path:
    """`secret` in a file only this user can read, replacing any earlier one (made before it is written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(secret + "\n")
    return path


def ensure_admin_key(path: Path) -> Path:
    """A random admin key in a file only this user can read, made once: with it `make rollout` can talk to
    `make serve`, and nobody else can, without anyone having to choose a key."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path
    with os.fdopen(descriptor, "w") as handle:
        handle.write(secrets.token_urlsafe(32) + "\n")
    return path


def administer(cfg: Config, name: str, action: str, version: int | None) -> int:
    """`make rollout` / `make rollback`: ask the running frontend, print the version now live."""
    url = f"{cfg.frontend_base}/admin/models/{urllib.parse.quote(name, safe='')}/{action}"
    body = json.dumps({"version": version} if version is not None else {}).encode()
    headers = {"Content-Type": "application/json"}
    key = first_key("ADMIN_API_KEYS", "ADMIN_API_KEYS_FILE", cfg.admin_key_file)
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    context = _loopback_tls() if url.startswith("https://") else None
    try:
        with urllib.request.urlopen(request, timeout=ADMIN_TIMEOUT_S, context=context) as response:
            result = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        print(f"error: {action} of {name} refused ({exc.code}): {message}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"error: no server answers at {cfg.frontend_base} ({exc}); is `make serve` running with the same "
              "FRONTEND_PORT?", file=sys.stderr)
        return 1
    if not result["changed"]:
        print(f"{name}: version {result['live_version']} is live (it already was)")
        return 0
    if result["previous_version"] is None:
        print(f"{name}: version {result['live_version']} is live (a model new to this server)")
        return 0
    drained = ("requests on it finished" if result["drained"] else
               "requests still on it after ROLLOUT_GRACE_S were ended")
    print(f"{name}: version {result['live_version']} is live; version {result['previous_version']} unloaded "
          f"({drained}; {result['seconds']:.1f} s)")
    return 0


# ----- supervision --------------------------------------------------------------------------------------
class TritonProcess:
    """tritonserver as a supervised child: a fresh TritonServer per start, on the same ports and log path,
    with this launch's control key (the frontend read it once).

    The log of the run before a restart moves to `tritonserver.log.1`, so the current log (and the tail the
    launcher prints when it gives up) is always the latest run's, and the crashed run's is still there.
    Its health is whether its engine models serve (launcher/engine_health.py), checked every HEALTH_PERIOD_S.
    """

    name = "tritonserver"

    def __init__(self, cfg: Config, control_key: str) -> None:
        self._cfg = cfg
        self._control_key = control_key
        self.ready_timeout_s = cfg.triton_ready_timeout_s
        self.unhealthy_grace_s = cfg.engine_unhealthy_s
        self.server = self._new_server()
        self._starts = 0
        self._health = self._new_health()
        self._checked_at = -HEALTH_PERIOD_S
        self._last_problem: Problem | None = None

    def _new_server(self) -> TritonServer:
        cfg = self._cfg
        return TritonServer(cfg.model_repository, cfg.http_port, cfg.grpc_port, cfg.metrics_port,
                            log_file=cfg.triton_log, work_dir=cfg.work_dir, model_name=cfg.engine_model,
                            control_key=self._control_key)

    def _new_health(self) -> EngineHealth:
        """What this run of Triton serves starts empty: the models it loads join as they become ready."""
        cfg = self._cfg
        return EngineHealth(f"127.0.0.1:{cfg.grpc_port}", self._control_key, self._engine_models,
                            repository=cfg.model_repository)

    def _engine_models(self) -> list[str]:
        """The models with the TensorRT-LLM interface: the named models on disk now (one built while serving
        joins once rolled out), else the one engine model."""
        named = [m.name for m in model_store.managed_models(self._cfg.model_repository)]
        return named or [self._cfg.engine_model]

    @property
    def pid(self) -> int | None:
        return self.server.pid

    def poll(self) -> int | None:
        return self.server.poll()

    def start(self) -> None:
        if self._starts:
            self.server.stop()  # no-op when the supervisor already did; never two servers on one port
            rotate_log(self._cfg.triton_log)
            self.server = self._new_server()
            settle_models(self._cfg.model_repository)  # the first start's ran in preflight()
        self._starts += 1
        self._health = self._new_health()
        self._last_problem = None
        self.server.start()

    def stop(self, *, failed: bool = False) -> None:
        if failed:
            # A server taken down as hung or not serving: its stubs' thread stacks go to its log first (kept
            # as the rotated log after the restart), so that a load or step that never ends says where.
            self.server.dump_stub_stacks()
            self.server.stop(LEFTOVER_STOP_GRACE_S)
        else:
            self.server.stop()

    def ready(self) -> bool:
        return self.server.is_ready()

    def health(self) -> Problem | None:
        now = time.monotonic()
        if now - self._checked_at >= HEALTH_PERIOD_S:
            self._checked_at = now
            self._last_problem = self._health.check()
        return self._last_problem

    def repair(self, problem: Problem) -> None:
        """Load the missing models again, from a thread: a load takes as long as the engine takes to load,
        and the poll loop must keep watching the frontend (and Ctrl+C) meanwhile."""
        health = self._health

        def reload() -> None:
            try:
                health.reload(problem.missing)
            except Exception as exc:  # the supervisor sees the model still missing and restarts Triton
                print(f"launcher: reloading {', '.join(problem.missing)} failed: {exc}", file=sys.stderr, flush=True)

        threading.Thread(target=reload, name="engine-reload", daemon=True).start()

    def failure_detail(self) -> str:
        return self.server.log_tail()


class FrontendProcess:
    """`python -m frontend` as a supervised child; keeps the SIGHUP target pointing at the live one."""

    name = "frontend"
    ready_timeout_s = FRONTEND_READY_TIMEOUT_S
    unhealthy_grace_s = 0.0

    def __init__(self, cfg: Config) -> None:
        self._cfg = cfg
        self.proc: subprocess.Popen[bytes] | None = None
        self._stopped = True

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def start(self) -> None:
        global _frontend_pid
        self.stop()
        self.proc = start_frontend(self._cfg)
        self._stopped = False
        _frontend_pid = self.proc.pid

    def stop(self, grace_s: float = LEFTOVER_STOP_GRACE_S, *, failed: bool = False) -> None:
        """Stop the group once (a second killpg could hit a recycled pid); grace_s covers the drain (a failed
        frontend's leftovers get the same few seconds)."""
        global _frontend_pid
        if self.proc is None or self._stopped:
            return
        self._stopped = True
        _frontend_pid = None
        terminate_group(self.proc, grace_s)

    def ready(self) -> bool:
        # Live, not ready: the frontend's readiness includes Triton's, which is not this process's to fix.
        answer = _http_get(f"{self._cfg.frontend_base}/health/live")
        return answer is not None and answer[0] == 200

    def failure_detail(self) -> str:
        return "(the frontend's output is above)"

    def health(self) -> Problem | None:
        """Its liveness is its process (and /health/live after a restart); readiness is Triton's business."""
        return None

    def repair(self, problem: Problem) -> None:
        raise AssertionError("the frontend reports no problems to repair")


def rotate_log(path: Path) -> None:
    """Keep one previous log next to the new one (`<name>.1`), so a restart does not erase why it happened."""
    try:
        os.replace(path, path.with_name(path.name + ".1"))
    except FileNotFoundError:
        pass


def _check_alive(frontend: subprocess.Popen[bytes] | None, triton: TritonServer) -> None:
    code = triton.poll()
    if code is not None:
        raise LaunchError(f"tritonserver exited unexpectedly (code {code})\n{triton.log_tail()}")
    if frontend is not None and frontend.poll() is not None:
        raise LaunchError(f"frontend exited unexpectedly (code {frontend.returncode}); see its output above")


def banner(cfg: Config, model_id: str) -> str:
    # Print an address one can connect to; a wildcard bind is reachable on loopback.
    url = f"{cfg.frontend_base}/v1"
    where = url if _probe_host(cfg.frontend_host) == cfg.frontend_host else f"{url} (bound to {cfg.frontend_host})"
    body = json.dumps({"model": model_id, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
    auth = " -H 'Authorization: Bearer $API_KEY'" if os.environ.get("API_KEYS") or os.environ.get("API_KEYS_FILE") else ""
    insecure = " -k" if cfg.scheme == "https" else ""
    return (
        f"Serving {model_id} at {where}  (Triton gRPC 127.0.0.1:{cfg.grpc_port}, HTTP :{cfg.http_port}, "
        f"metrics :{cfg.metrics_port}; Triton log: {cfg.triton_log})\n"
        f"Try: curl{insecure} {url}/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'\n"
        f"Metrics: {cfg.frontend_base}/metrics (frontend), http://127.0.0.1:{cfg.metrics_port}/metrics (Triton)\n"
        f"Press Ctrl+C to stop; kill -HUP {os.getpid()} reloads API_KEYS_FILE."
    )


def _raise_shutdown(signum: int, _frame: FrameType | None) -> None:
    raise _Shutdown(signum)


def _forward_hup(_signum: int, _frame: FrameType | None) -> None:
    """SIGHUP reloads the frontend's API keys; the launcher itself keeps running."""
    if _frontend_pid is not None:
        try:
            os.kill(_frontend_pid, signal.SIGHUP)
        except ProcessLookupError:
            pass


def serve(cfg: Config) -> int:
    preflight(cfg)
    control_key = new_control_key()  # per launch: Triton's restarts keep it, the frontend reads it from the file
    write_secret(cfg.control_key_file, control_key)
    triton = TritonProcess(cfg, control_key)
    frontend = FrontendProcess(cfg)
    try:
        triton.start()
        print(f"Starting tritonserver (pid {triton.pid}, log: {cfg.triton_log}) ...", flush=True)
        took = triton.server.wait_ready(cfg.triton_ready_timeout_s)
        print(f"Triton ready in {took:.1f} s; starting the frontend ...", flush=True)
        frontend.start()
        assert frontend.proc is not None
        wait_frontend_ready(cfg, frontend.proc, triton.server)
        print(banner(cfg, served_model_id(cfg)), flush=True)
        supervisor = Supervisor([triton, frontend], cfg.max_restarts_per_minute)
        while True:
            supervisor.step()
            time.sleep(POLL_S)
    except _Shutdown:
        print("Shutting down ...", flush=True)
        return 0
    except RestartBudgetExceeded as exc:
        # Said before the cleanup below, which may take the frontend's drain period.
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        # No second signal may interrupt the cleanup; it is bounded by the grace periods anyway.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        frontend.stop(cfg.shutdown_grace_s + FRONTEND_STOP_GRACE_S)
        triton.stop()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m launcher", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve_p = sub.add_parser("serve", help="run Triton and the OpenAI frontend until Ctrl+C")
    serve_p.add_argument("--model-repository", default="build/model_repository",
                         help="rendered Triton model repository, or a repository of named models "
                              "(build/models) (default: %(default)s)")
    serve_p.add_argument("--work-dir", default="build",
                         help="where logs and the assembled backend dir go (default: %(default)s)")
    for action, text in (("rollout", "make a version of a named model live in the running server"),
                         ("rollback", "make the version that was live before live again")):
        admin_p = sub.add_parser(action, help=text)
        admin_p.add_argument("--name", required=True, help="the model's name (make engine NAME=...)")
        if action == "rollout":
            admin_p.add_argument("--version", type=int, help="the version (default: the newest on disk)")
        admin_p.add_argument("--work-dir", default="build", help="where `make serve` keeps its admin key")
        admin_p.set_defaults(model_repository="build/models")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _raise_shutdown)
    signal.signal(signal.SIGHUP, _forward_hup)
    try:
        if args.command in ("rollout", "rollback"):
            return administer(load_config(args), args.name, args.command, getattr(args, "version", None))
        return serve(load_config(args))
    except (LaunchError, TritonStartError, TritonNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except _Shutdown:  # a signal before serve() entered its try block
        return 0


if __name__ == "__main__":
    sys.exit(main())
