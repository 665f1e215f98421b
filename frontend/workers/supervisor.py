"""FRONTEND_WORKERS=N: N frontend worker processes on one port, in front of one Triton.

One Python process relays a few thousand streamed tokens a second (each is a gRPC message in, an SSE frame
out and some event-loop turns), far less than one GPU makes; several processes relay several times that, as
vLLM's `--api-server-count` and trtllm-serve's post-processing workers do. This supervisor:

- binds the listening socket once and hands it to every worker (the kernel spreads connections over the
  workers accepting on it; a connection waiting in the backlog is not lost when a worker dies);
- runs the coordinator (coordinator.py beside it): admission, rate limits and rollouts for the whole
  server, over a Unix socket in a directory only this user can enter;
- gives the workers one Prometheus multiprocess directory, so that any worker's GET /metrics is the sum of
  all of them (prometheus-client's multiprocess mode);
- passes SIGTERM / SIGINT on (each worker drains; a second signal stops them at once) and SIGHUP (API key
  files reload in every worker), and restarts a worker that dies, at most MAX_RESTARTS_PER_MINUTE times
  a minute per worker before it gives up and stops the server.

Workers run in their own session, so that a signal sent to the supervisor's process group (Ctrl+C, the
launcher) reaches each worker once, through the supervisor, and each asks the kernel to kill it if the
supervisor dies (PR_SET_PDEATHSIG): no worker outlives it, and none holds the port while whoever restarts
the server (the launcher's supervision) binds it again. A supervisor that died did not drain either.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import deque
from multiprocessing import resource_tracker
from multiprocessing.process import BaseProcess
from pathlib import Path

import uvicorn

from frontend.observability.logs import configure_logging
from frontend.policy import auth
from frontend.settings import Settings
from frontend.workers.coordinator import Coordinator

log = logging.getLogger("frontend.workers.supervisor")

MAX_RESTARTS_PER_MINUTE = 5
RESTART_DELAY_S = 0.5  # between a worker's death and its replacement: a crash loop must not spin
PR_SET_PDEATHSIG = 1


def _die_with(parent: int) -> None:
    """In a worker: killed when the supervisor dies (Linux), and out of its process group (module docstring)."""
    os.setsid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)


def worker_main(app: str, argv: list[str], listener: socket.socket, coordinator: str, parent: int,
                key_id_salt: bytes) -> None:
    """A worker process (spawned, so a fresh interpreter: PROMETHEUS_MULTIPROC_DIR is set before any import
    of prometheus_client): `app`, the one-process server, on the shared socket, with the coordinator's limits
    and the supervisor's key-id salt (one id per key server-wide: the rate limits are keyed by it).

    `app` is a "module:function" name, imported here, in the worker only: the supervisor's process never loads
    the app (tokenizers, xgrammar and torch: hundreds of MB), and this package does not depend on the server
    it runs (frontend/__main__.py names it). The function is called as (settings, coordinator, [listener])."""
    _die_with(parent)
    auth.use_key_id_salt(key_id_salt)
    settings = Settings(_cli_parse_args=argv)
    configure_logging(settings.log_level, settings.access_log)
    module, _, function = app.partition(":")
    getattr(importlib.import_module(module), function)(settings, coordinator, [listener])


class Supervisor:
    def __init__(self, settings: Settings, argv: list[str], listener: socket.socket, run_dir: Path, app: str):
        self.settings = settings
        self.app = app
        self.argv = argv
        self.listener = listener
        self.coordinator_path = str(run_dir / "coordinator.sock")
        self.coordinator = Coordinator(settings)
        self._context = multiprocessing.get_context("spawn")
        self._workers: list[BaseProcess | None] = [None] * settings.frontend_workers
        self._restarts: list[deque[float]] = [deque() for _ in self._workers]
        self._stopping = False
        self._failed = False
        self._done = asyncio.Event()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        coordinator = await self.coordinator.serve(self.coordinator_path)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        loop.add_signal_handler(signal.SIGHUP, self._forward, signal.SIGHUP)
        for index in range(len(self._workers)):
            self._start(index)
        log.info("%d frontend workers on %s:%d", len(self._workers), self.settings.frontend_host,
                 self.settings.frontend_port)
        await self._done.wait()
        coordinator.close()
        return 1 if self._failed else 0

    def _start(self, index: int) -> None:
        if self._stopping:
            return
        process = self._context.Process(target=worker_main, name=f"frontend-worker-{index}",
                                        args=(self.app, self.argv, self.listener, self.coordinator_path, os.getpid(),
                                              auth.key_id_salt()))
        process.start()
        self._workers[index] = process
        log.info("worker %d started (pid %d)", index, process.pid)
        asyncio.get_running_loop().add_reader(process.sentinel, self._exited, index, process)

    def _exited(self, index: int, process: BaseProcess) -> None:
        asyncio.get_running_loop().remove_reader(process.sentinel)
        process.join()
        self._workers[index] = None
        if self._stopping:
            if not any(self._workers):
                self._done.set()
            return
        now = time.monotonic()
        restarts = self._restarts[index]
        while restarts and now - restarts[0] > 60:
            restarts.popleft()
        if len(restarts) >= MAX_RESTARTS_PER_MINUTE:
            log.error("worker %d (pid %d) exited with %s, its %d restart in a minute: stopping the server", index,
                      process.pid, process.exitcode, len(restarts) + 1)
            self._failed = True
            self.stop()
            return
        restarts.append(now)
        log.error("worker %d (pid %d) exited with %s; starting another", index, process.pid, process.exitcode)
        asyncio.get_running_loop().call_later(RESTART_DELAY_S, self._start, index)

    def _forward(self, sig: int) -> None:
        for process in self._workers:
            if process is not None and process.pid is not None:
                try:
                    os.kill(process.pid, sig)
                except ProcessLookupError:
                    pass

    def stop(self) -> None:
        """SIGTERM/SIGINT: every worker drains (frontend/__main__.py); a second signal stops them at once."""
        if not self._stopping:
            log.warning("stopping %d worker(s)", sum(1 for p in self._workers if p is not None))
        self._stopping = True
        self._forward(signal.SIGTERM)
        if not any(self._workers):
            self._done.set()


def serve(settings: Settings, argv: list[str], app: str) -> int:
    """Run `settings.frontend_workers` workers of `app` ("module:function", `worker_main`) until they are
    stopped; the exit status."""
    # uvicorn's own binding (address families, SO_REUSEADDR), as one server process binds.
    listener = uvicorn.Config(None, host=settings.frontend_host, port=settings.frontend_port).bind_socket()  # type: ignore[arg-type]
    run_dir = Path(tempfile.mkdtemp(prefix="frontend-"))  # mode 0700: only this user reaches the coordinator
    metrics_dir = run_dir / "metrics"
    metrics_dir.mkdir()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)  # inherited by the workers, never read here
    try:
        return asyncio.run(Supervisor(settings, argv, listener, run_dir, app).run())
    finally:
        listener.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        _stop_resource_tracker()


def _stop_resource_tracker() -> None:
    """Stop and reap the helper process that multiprocessing's spawn starts beside the workers.

    It sits in this process group, ignores SIGTERM and exits only once every worker and this process have
    closed its pipe, so without this it outlives the supervisor by a moment as an orphan, and whoever waits
    for the group to empty (the launcher, the supervision tests) waits on init to reap it. The workers use
    nothing it tracks. `_stop` is private (CPython's own tests call it), hence the guard."""
    stop = getattr(resource_tracker._resource_tracker, "_stop", None)
    if stop is not None:
        stop()
