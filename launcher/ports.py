"""Port checks done before starting anything.

Triton with `--exit-on-error` dies on a taken port with a message buried in its log, and uvicorn fails
only after Triton has spent minutes loading; checking up front turns both into one clear line that names
the environment variable to change.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping


class PortInUseError(RuntimeError):
    """A port we are about to bind is already taken."""

    def __init__(self, env_var: str, port: int) -> None:
        self.env_var = env_var
        self.port = port
        super().__init__(f"port {port} ({env_var}) is already in use; set {env_var} to a free port")


def _port_is_free(port: int, host: str) -> bool:
    """Try to bind the port the way the servers will.

    SO_REUSEADDR as uvicorn, gRPC and Triton's HTTP server set it: a port whose last connections linger
    in TIME_WAIT (e.g. right after a restart) is free for them, and on Linux a listener still blocks it.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def check_ports_free(ports: Mapping[str, int], host: str = "127.0.0.1") -> None:
    """Raise PortInUseError for the first taken port; keys are the env vars that set each port."""
    for env_var, port in ports.items():
        if not _port_is_free(port, host):
            raise PortInUseError(env_var, port)


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free right now (tests use it; racy by nature, good enough there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
