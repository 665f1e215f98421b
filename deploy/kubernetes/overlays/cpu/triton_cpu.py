"""The CPU overlay's Triton container: the tritonserver of `make serve`, as PID 1, every port on loopback.

`make serve` runs `python -m launcher serve`, which starts tritonserver and the frontend side by side. In
the pod they are two containers, so this runs only the first half, with the launcher's own code: the ports
from the same environment variables (load_config), the same command (TritonServer.command(): HTTP, gRPC and
metrics on 127.0.0.1, the Python backend assembled from the nvidia-pytriton wheel, the shared-memory
prefix, the control APIs restricted to requests carrying the control key), nothing added. The key is the
pod's, not one made per launch as `make serve` makes it: the init container triton-control-key writes it to
TRITON_CONTROL_KEY_FILE, which the frontend reads too. The endpoint picker and Prometheus read the engine's
gauges (cpu_engine_*) through the frontend's /metrics, which fetches Triton's on loopback
(TRITON_METRICS_URL), as under `make serve`.

It exec's tritonserver rather than supervising it: the container runtime restarts it, SIGTERM reaches it
directly, and its log goes to the container's stdout (`kubectl logs -c triton`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from launcher.__main__ import build_parser
from launcher.config import load_config
from launcher.tritonserver import TritonServer

# launcher/tritonserver.py TritonServer.start() sets this default too (OpenMP threads spin briefly between
# the engine step's parallel regions, then sleep); the environment may override it.
DEFAULT_ENV = {"GOMP_SPINCOUNT": "10000"}


def control_key() -> str | None:
    """The pod's key for Triton's control APIs, from TRITON_CONTROL_KEY_FILE (None when that is not set)."""
    path = os.environ.get("TRITON_CONTROL_KEY_FILE")
    if not path:
        return None
    key = Path(path).read_text().strip()
    if not key:
        raise SystemExit(f"error: TRITON_CONTROL_KEY_FILE={path} is empty")
    return key


def command(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """tritonserver's argv and environment for `serve` arguments (--model-repository, --work-dir)."""
    cfg = load_config(build_parser().parse_args(["serve", *argv]))
    server = TritonServer(cfg.model_repository, cfg.http_port, cfg.grpc_port, cfg.metrics_port,
                          log_file=cfg.triton_log, work_dir=cfg.work_dir, model_name=cfg.engine_model,
                          control_key=control_key())
    return server.command(), {**DEFAULT_ENV, **os.environ, **server.install.env}


def main() -> None:
    argv, env = command(sys.argv[1:])
    print("exec", " ".join(argv), flush=True)
    os.execve(argv[0], argv, env)


if __name__ == "__main__":
    main()
