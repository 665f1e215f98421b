"""tritonserver for a TensorRT-LLM engine: directly for one GPU, under mpirun with one rank per GPU for more.

``python -m launcher.mpi --model-repository DIR`` checks the engine version, then *replaces itself* with
tritonserver (or mpirun), so in a container it is PID 1 and receives the stop signal itself. Unlike
upstream's ``launch_triton_server.py`` it does not background the server and exit.

The argv mirrors ``launch_triton_server.py``: rank 0 loads the whole repository; ranks above 0 load only
``tensorrt_llm`` (their backend instances join rank 0's engine through MPI); every rank has its own Python
backend shared-memory prefix.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from launcher.engine_check import EngineMismatchError, check_model_repository

ENGINE_MODEL = "tensorrt_llm"


def rank_argv(
    rank: int,
    model_repository: str | Path,
    *,
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    address: str | None = None,
    tritonserver: str = "tritonserver",
    engine_model: str = ENGINE_MODEL,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """One rank's tritonserver argv. ``address`` None keeps Triton's default (all interfaces)."""
    argv = [tritonserver, f"--model-repository={model_repository}"]
    if address is not None:
        argv += [f"--http-address={address}", f"--grpc-address={address}", f"--metrics-address={address}"]
    argv += [f"--grpc-port={grpc_port}", f"--http-port={http_port}", f"--metrics-port={metrics_port}"]
    if rank > 0:
        argv += ["--model-control-mode=explicit", f"--load-model={engine_model}"]
    argv += [
        "--disable-auto-complete-config",
        f"--backend-config=python,shm-region-prefix-name=prefix{rank}_",
        *extra_args,
    ]
    return argv


def tritonserver_argv(
    world_size: int,
    model_repository: str | Path,
    *,
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    address: str | None = None,
    tritonserver: str = "tritonserver",
    mpirun: str = "mpirun",
    engine_model: str = ENGINE_MODEL,
    extra_args: Sequence[str] = (),
    oversubscribe: bool = False,
) -> list[str]:
    """The full argv: plain tritonserver for world_size 1, else ``mpirun -n 1 <rank 0> : -n 1 <rank 1> ...``."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    ranks = [
        rank_argv(
            rank,
            model_repository,
            http_port=http_port,
            grpc_port=grpc_port,
            metrics_port=metrics_port,
            address=address,
            tritonserver=tritonserver,
            engine_model=engine_model,
            extra_args=extra_args,
        )
        for rank in range(world_size)
    ]
    if world_size == 1:
        return ranks[0]
    argv = [mpirun, "--allow-run-as-root"]
    if oversubscribe:
        argv.append("--oversubscribe")
    for rank, rank_args in enumerate(ranks):
        if rank > 0:
            argv.append(":")
        argv += ["-n", "1", *rank_args]
    return argv


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name) or str(default)
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"error: {name}={raw!r} is not an integer") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.mpi", description=__doc__.splitlines()[0])
    parser.add_argument("--model-repository", default="build/model_repository")
    parser.add_argument(
        "--world-size", type=int, help="ranks = GPUs (default: the engine's tensor-parallel size)"
    )
    parser.add_argument(
        "--address", default=os.environ.get("TRITON_ADDRESS") or None,
        help="bind address (default: $TRITON_ADDRESS, else Triton's default, all interfaces)",
    )
    parser.add_argument("--print", action="store_true", help="print the command instead of running it")
    args, extra = parser.parse_known_args(argv)
    try:
        engine = check_model_repository(Path(args.model_repository))
    except EngineMismatchError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    if engine is None:
        print(f"error: {args.model_repository} does not serve a TensorRT-LLM engine; use `python -m launcher serve`",
              file=sys.stderr, flush=True)
        return 1
    world_size = args.world_size if args.world_size is not None else int(engine.get("world_size", 1))
    command = tritonserver_argv(
        world_size,
        args.model_repository,
        http_port=_env_int("TRITON_HTTP_PORT", 8000),
        grpc_port=_env_int("TRITON_GRPC_PORT", 8001),
        metrics_port=_env_int("TRITON_METRICS_PORT", 8002),
        address=args.address,
        extra_args=[arg for arg in extra if arg != "--"],
    )
    if args.print:
        print(shlex.join(command))
        return 0
    print(f"exec {shlex.join(command)}", flush=True)
    os.execvp(command[0], command)  # never returns: tritonserver / mpirun takes over this process (PID 1)
    return 1  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
