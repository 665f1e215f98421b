"""Start tritonserver and the OpenAI frontend together (`python -m launcher serve`).

Standard library only, so it runs before any optional dependency is installed.
"""

from launcher.ports import PortInUseError, check_ports_free, find_free_port
from launcher.tritonserver import TritonInstall, TritonNotFoundError, TritonServer, TritonStartError, find_tritonserver

__all__ = [
    "PortInUseError",
    "TritonInstall",
    "TritonNotFoundError",
    "TritonServer",
    "TritonStartError",
    "check_ports_free",
    "find_free_port",
    "find_tritonserver",
]
