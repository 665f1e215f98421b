"""tritonserver for a TensorRT-LLM engine: directly for one GPU, under mpirun with one rank per GPU for more.

``python -m launcher.mpi --model-repository DIR`` checks the engine version, then *replaces itself* with
tritonserver (or mpirun), so in a container it is PID 1 and receives the stop signal itself. Unlike
upstream's ``launch_triton_server.py`` it does not background the server and exit.

The argv mirrors ``launch_triton_server.py``: rank 0 loads the whole repository; ranks above 0 load only
``tensorrt_llm`` (their backend instances join rank 0's engine through MPI); every rank has its own Python
backend shared-memory prefix.

Across several hosts (``--host`` or ``--lws-group``, as NVIDIA's multi-node Triton example does it): mpirun
gets the hosts with their slots (one per GPU: rank 0 and the first host's other slots here, the next host's
after them, so that a tensor-parallel group of at most one host's GPUs stays on one host and pipeline stages
go across), the remote launch agent (``--rsh-agent``: ``-mca plm_rsh_agent``, e.g. a ``kubectl exec``
script; no tree spawn, so only this host needs it), the environment variables the remote ranks need
(``--export``: ``-x NAME``), and ranks above 0 serve no HTTP, gRPC or metrics endpoint. Give mpirun by its
absolute path (``--mpirun /opt/hpcx/ompi/bin/mpirun``): Open MPI then starts the remote daemons from the same
prefix, whatever the remote PATH.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from launcher.engine_check import EngineMismatchError, check_model_repository

ENGINE_MODEL = "tensorrt_llm"
# Ranks above 0 of a multi-host run: no endpoints at all (upstream's multi-node server.py does the same).
NO_ENDPOINTS = ("--allow-http=false", "--allow-grpc=false", "--allow-metrics=false")

Hosts = Sequence[tuple[str, int]]


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
    endpoints: bool = True,
) -> list[str]:
    """One rank's tritonserver argv. ``address`` None keeps Triton's default (all interfaces); ``endpoints``
    False (ranks above 0 only) turns HTTP, gRPC and metrics off."""
    argv = [tritonserver, f"--model-repository={model_repository}"]
    if address is not None:
        argv += [f"--http-address={address}", f"--grpc-address={address}", f"--metrics-address={address}"]
    argv += [f"--grpc-port={grpc_port}", f"--http-port={http_port}", f"--metrics-port={metrics_port}"]
    if rank > 0:
        argv += ["--model-control-mode=explicit", f"--load-model={engine_model}"]
        if not endpoints:
            argv += list(NO_ENDPOINTS)
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
    hosts: Hosts | None = None,
    rsh_agent: str | None = None,
    export: Sequence[str] = (),
) -> list[str]:
    """The full argv: plain tritonserver for world_size 1, else ``mpirun -n 1 <rank 0> : -n 1 <rank 1> ...``.

    ``hosts`` (name, slots), ``rsh_agent`` and ``export`` are for a run across hosts (module docstring); without
    them the argv is the single-host one, all ranks in this container."""
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
            endpoints=hosts is None,
        )
        for rank in range(world_size)
    ]
    if world_size == 1 and hosts is None:
        return ranks[0]
    argv = [mpirun, "--allow-run-as-root"]
    if oversubscribe:
        argv.append("--oversubscribe")
    if hosts is not None:
        argv += ["--host", format_hosts(hosts)]
    if rsh_agent:
        # Only mpirun's host starts the remote daemons (no tree spawn): the agent need not exist elsewhere.
        argv += ["-mca", "plm_rsh_agent", rsh_agent, "-mca", "plm_rsh_no_tree_spawn", "1"]
    for name in export:
        argv += ["-x", name]
    for rank, rank_args in enumerate(ranks):
        if rank > 0:
            argv.append(":")
        argv += ["-n", "1", *rank_args]
    return argv


# ----- hosts and environment of a multi-host run ----------------------------------------------------------
_HOST = re.compile(r"([A-Za-z0-9][A-Za-z0-9.-]*):([1-9][0-9]*)")


def parse_hosts(text: str) -> list[tuple[str, int]]:
    """``a:8,b:8`` -> [("a", 8), ("b", 8)]: mpirun's --host syntax, with the slots required."""
    hosts = []
    for item in text.replace(" ", ",").split(","):
        if not item:
            continue
        match = _HOST.fullmatch(item)
        if match is None:
            raise ValueError(f"host {item!r} is not NAME:SLOTS (slots = GPUs of that host)")
        hosts.append((match.group(1), int(match.group(2))))
    if not hosts:
        raise ValueError("no hosts given")
    names = [name for name, _ in hosts]
    if len(set(names)) != len(names):
        raise ValueError(f"a host is listed twice: {text}")
    return hosts


def format_hosts(hosts: Hosts) -> str:
    return ",".join(f"{name}:{slots}" for name, slots in hosts)


def lws_hosts(gpus_per_pod: int, environ: Mapping[str, str] = os.environ) -> list[tuple[str, int]]:
    """The pods of this LeaderWorkerSet group, leader (this pod) first, ``gpus_per_pod`` slots each.

    LWS gives every pod of a group LWS_LEADER_ADDRESS (``<leader pod>.<subdomain>.<namespace>``) and
    LWS_GROUP_SIZE; the leader pod is ``<lws>-<group>``, its workers ``<lws>-<group>-<1..size-1>``. These are
    pod names (the pods' hostnames), which is what a ``kubectl exec`` agent needs, and the leader's own name,
    so that mpirun starts ranks 0.. here."""
    if gpus_per_pod < 1:
        raise ValueError(f"GPUs per pod must be at least 1, got {gpus_per_pod}")
    address, size = environ.get("LWS_LEADER_ADDRESS"), environ.get("LWS_GROUP_SIZE")
    if not address or not size:
        raise ValueError("LWS_LEADER_ADDRESS and LWS_GROUP_SIZE are not set: not a LeaderWorkerSet pod")
    try:
        group_size = int(size)
    except ValueError:
        raise ValueError(f"LWS_GROUP_SIZE={size!r} is not an integer") from None
    if group_size < 1:
        raise ValueError(f"LWS_GROUP_SIZE={size!r} is not at least 1")
    leader = address.split(".", 1)[0]
    return [(leader, gpus_per_pod)] + [(f"{leader}-{index}", gpus_per_pod) for index in range(1, group_size)]


def export_names(patterns: str | Sequence[str], environ: Mapping[str, str] = os.environ) -> list[str]:
    """The variables to forward (mpirun -x): each name that is set, and every set name starting with PREFIX
    for a ``PREFIX*`` pattern; in the order given, each once."""
    if isinstance(patterns, str):
        patterns = patterns.replace(",", " ").split()
    names: list[str] = []
    for pattern in patterns:
        if pattern.endswith("*"):
            found = sorted(name for name in environ if name.startswith(pattern[:-1]))
        else:
            found = [pattern] if pattern in environ else []
        names += [name for name in found if name not in names]
    return names


def check_layout(world_size: int, hosts: Hosts, tp_size: int | None = None) -> list[str]:
    """Refuses a run whose ranks do not fill the hosts' slots exactly (ValueError); returns warnings (a
    tensor-parallel group wider than the first host: its all-reduces would cross the network)."""
    slots = sum(count for _, count in hosts)
    if slots != world_size:
        raise ValueError(f"the engine has {world_size} ranks (TP x PP) but the hosts {format_hosts(hosts)} have "
                         f"{slots} slots (GPUs): build the engine for the group's GPUs, or change the hosts")
    warnings = []
    if tp_size is not None and tp_size > hosts[0][1]:
        warnings.append(f"tensor parallelism {tp_size} spans hosts ({hosts[0][1]} GPUs on {hosts[0][0]}): every "
                        "layer's all-reduce crosses the network; prefer TP <= GPUs per host and PP across hosts")
    return warnings


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
        "--world-size", type=int, help="ranks = GPUs (default: the engine's world size, TP x PP)"
    )
    parser.add_argument(
        "--address", default=os.environ.get("TRITON_ADDRESS") or None,
        help="bind address (default: $TRITON_ADDRESS, else Triton's default, all interfaces)",
    )
    parser.add_argument("--mpirun", default=os.environ.get("MPIRUN") or "mpirun",
                        help="mpirun to run (default: $MPIRUN, else mpirun on PATH); across hosts give its "
                        "absolute path, e.g. /opt/hpcx/ompi/bin/mpirun")
    hosts_group = parser.add_mutually_exclusive_group()
    hosts_group.add_argument("--host", default=os.environ.get("MPI_HOSTS") or None, metavar="NAME:SLOTS,...",
                             help="run across these hosts, this one first (default: $MPI_HOSTS)")
    hosts_group.add_argument("--lws-group", type=int, metavar="GPUS_PER_POD",
                             default=_env_int("MPI_LWS_GPUS_PER_POD", 0) or None,
                             help="run across the pods of this LeaderWorkerSet group, this (leader) pod first, "
                             "GPUS_PER_POD ranks each (default: $MPI_LWS_GPUS_PER_POD)")
    parser.add_argument("--rsh-agent", default=os.environ.get("MPI_RSH_AGENT") or None,
                        help="command mpirun starts remote daemons with (-mca plm_rsh_agent; default: $MPI_RSH_AGENT)")
    parser.add_argument("--export", default=os.environ.get("MPI_EXPORT") or "", metavar="NAMES",
                        help="environment variables forwarded to every rank (mpirun -x), NAME or PREFIX*, "
                        "separated by spaces or commas (default: $MPI_EXPORT)")
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
    hosts = None
    try:
        if args.host is not None:
            hosts = parse_hosts(args.host)
        elif args.lws_group is not None:
            hosts = lws_hosts(args.lws_group)
        if hosts is not None:
            tp_size = engine.get("tp_size")
            for warning in check_layout(world_size, hosts, int(tp_size) if tp_size is not None else None):
                print(f"warning: {warning}", file=sys.stderr, flush=True)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    command = tritonserver_argv(
        world_size,
        args.model_repository,
        http_port=_env_int("TRITON_HTTP_PORT", 8000),
        grpc_port=_env_int("TRITON_GRPC_PORT", 8001),
        metrics_port=_env_int("TRITON_METRICS_PORT", 8002),
        address=args.address,
        mpirun=args.mpirun,
        extra_args=[arg for arg in extra if arg != "--"],
        hosts=hosts,
        rsh_agent=args.rsh_agent,
        export=export_names(args.export),
    )
    if args.print:
        print(shlex.join(command))
        return 0
    print(f"exec {shlex.join(command)}", flush=True)
    os.execvp(command[0], command)  # never returns: tritonserver / mpirun takes over this process (PID 1)
    return 1  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
