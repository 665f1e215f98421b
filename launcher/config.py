"""What a launch is configured with: the ports, paths and limits of `python -m launcher`, read once from its
arguments and the environment (the same variables the Makefile and compose file use), and the one error
worth a line to the user (LaunchError, exit code 1).

Every other launcher module takes a Config; none reads these variables itself.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from build_engine import model_store
from launcher.engine_check import serves_tensorrt_llm
from launcher.loopback import probe_host

DEFAULT_MAX_RESTARTS_PER_MINUTE = 5
ADMIN_KEY_FILE = "admin_api_key"
CONTROL_KEY_FILE = "triton_control_key"  # this launch's key to Triton's control API (for the frontend's rollouts)
MAX_DEFAULT_WORKERS = 8


class LaunchError(RuntimeError):
    """A failure worth one line to the user and exit code 1 (no traceback)."""


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
        return f"{self.scheme}://{probe_host(self.frontend_host)}:{self.frontend_port}"


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


def default_frontend_workers(model_repository: Path) -> int:
    """FRONTEND_WORKERS when unset: one per core up to 8 in front of a TensorRT-LLM engine (the GPU makes
    tokens faster than one Python process relays them); 1 in front of the CPU engine, which needs the cores
    for its forward pass far more than the frontend needs them to relay what it makes (README, "Frontend
    workers")."""
    if not serves_tensorrt_llm(model_repository):
        return 1
    return max(1, min(MAX_DEFAULT_WORKERS, len(os.sched_getaffinity(0))))
