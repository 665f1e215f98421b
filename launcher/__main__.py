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
SSL_KEYFILE the frontend serves HTTPS, and the readiness probes use https (launcher/loopback.py).

This module is that order: the checks before anything starts, the starts, the banner, the signals, the
supervision loop and the stops, and the command line (whose `rollout` and `rollback` are launcher/admin.py).
The configuration is launcher/config.py, the two children launcher/processes.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from launcher.admin import administer
from launcher.config import Config, LaunchError, load_config
from launcher.engine_check import check_model_repository, check_named_models
from launcher.keys import probe_api_key, write_secret
from launcher.loopback import http_get, probe_host
from launcher.ports import PortInUseError, check_ports_free
from launcher.processes import (FRONTEND_STOP_GRACE_S, POLL_S, FrontendProcess, TritonProcess, forward_hup,
                                settle_models, wait_frontend_ready)
from launcher.supervise import RestartBudgetExceeded, Supervisor
from launcher.tritonserver import TritonNotFoundError, TritonStartError, new_control_key


class _Shutdown(BaseException):
    """Raised from the signal handler so every wait unwinds through the finally blocks.

    BaseException, like KeyboardInterrupt, so no `except Exception` on the way swallows it.
    """


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


# ----- the banner ---------------------------------------------------------------------------------------
def served_model_id(cfg: Config) -> str:
    """The ids clients may send, as the frontend reports them (falls back to '?' rather than failing)."""
    answer = http_get(f"{cfg.frontend_base}/v1/models", timeout_s=5, api_key=probe_api_key())
    if answer is None or answer[0] != 200:
        return "?"
    try:
        return ", ".join(str(card["id"]) for card in json.loads(answer[1])["data"]) or "?"
    except (ValueError, KeyError, IndexError, TypeError):
        return "?"


def banner(cfg: Config, model_id: str) -> str:
    # Print an address one can connect to; a wildcard bind is reachable on loopback.
    url = f"{cfg.frontend_base}/v1"
    where = url if probe_host(cfg.frontend_host) == cfg.frontend_host else f"{url} (bound to {cfg.frontend_host})"
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


# ----- serve --------------------------------------------------------------------------------------------
def _raise_shutdown(signum: int, _frame: FrameType | None) -> None:
    raise _Shutdown(signum)


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


# ----- the command line ---------------------------------------------------------------------------------
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
    signal.signal(signal.SIGHUP, forward_hup)
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
