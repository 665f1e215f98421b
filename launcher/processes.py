"""The launcher's two children, tritonserver and the OpenAI frontend: how each is started, waited for, probed
and stopped, as the Supervisor (launcher/supervise.py) drives them after the first start.

TritonProcess wraps launcher/tritonserver.py's TritonServer (a fresh one per start, the log of the run before
kept, the model repository settled first) and watches its engine models (launcher/engine_health.py).
FrontendProcess runs `python -m frontend` with the environment `make serve` gives it (start_frontend), and is
where SIGHUP goes: the frontend reloads API_KEYS_FILE (forward_hup).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from build_engine import model_store
from launcher.config import Config, LaunchError, default_frontend_workers
from launcher.engine_health import EngineHealth, Problem
from launcher.keys import ensure_admin_key
from launcher.loopback import http_get
from launcher.tritonserver import TritonServer, terminate_group

FRONTEND_READY_TIMEOUT_S = 120.0
FRONTEND_STOP_GRACE_S = 10.0  # after the frontend's own drain (SHUTDOWN_GRACE_S)
LEFTOVER_STOP_GRACE_S = 5.0  # what a crashed process left behind gets this long to go before SIGKILL
POLL_S = 0.5
HEALTH_PERIOD_S = 2.0  # how often the engine's health is checked (a probe request each time)

_frontend_pid: int | None = None  # where SIGHUP goes


# ----- tritonserver -------------------------------------------------------------------------------------
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


def rotate_log(path: Path) -> None:
    """Keep one previous log next to the new one (`<name>.1`), so a restart does not erase why it happened."""
    try:
        os.replace(path, path.with_name(path.name + ".1"))
    except FileNotFoundError:
        pass


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


# ----- frontend -----------------------------------------------------------------------------------------
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


def wait_frontend_ready(cfg: Config, frontend: subprocess.Popen[bytes], triton: TritonServer) -> None:
    base = cfg.frontend_base
    deadline = time.monotonic() + FRONTEND_READY_TIMEOUT_S
    while True:
        _check_alive(frontend, triton)
        answer = http_get(f"{base}/health/ready")
        if answer is not None and answer[0] == 200:
            return
        if time.monotonic() >= deadline:
            raise LaunchError(f"frontend not ready at {base}/health/ready after {FRONTEND_READY_TIMEOUT_S:.0f} s")
        time.sleep(POLL_S)


def _check_alive(frontend: subprocess.Popen[bytes] | None, triton: TritonServer) -> None:
    code = triton.poll()
    if code is not None:
        raise LaunchError(f"tritonserver exited unexpectedly (code {code})\n{triton.log_tail()}")
    if frontend is not None and frontend.poll() is not None:
        raise LaunchError(f"frontend exited unexpectedly (code {frontend.returncode}); see its output above")


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
        answer = http_get(f"{self._cfg.frontend_base}/health/live")
        return answer is not None and answer[0] == 200

    def failure_detail(self) -> str:
        return "(the frontend's output is above)"

    def health(self) -> Problem | None:
        """Its liveness is its process (and /health/live after a restart); readiness is Triton's business."""
        return None

    def repair(self, problem: Problem) -> None:
        raise AssertionError("the frontend reports no problems to repair")


def forward_hup(_signum: int, _frame: FrameType | None) -> None:
    """SIGHUP reloads the frontend's API keys; the launcher itself keeps running."""
    if _frontend_pid is not None:
        try:
            os.kill(_frontend_pid, signal.SIGHUP)
        except ProcessLookupError:
            pass
