"""Start tritonserver and the OpenAI frontend together (`python -m launcher serve`).

It imports neither the frontend nor the engine: the standard library, the model store (build_engine/model_store.py),
and tritonclient with numpy for the engine's health probe (launcher/engine_health.py).

__main__.py   the entry point: preflight, the starts in order, the banner, signals, the stops, the CLI
config.py     what a launch is configured with (arguments and environment), LaunchError
processes.py  the two supervised children: tritonserver and the frontend (start, probe, stop, SIGHUP)
supervise.py  keeps both running: restarts with back-off within a budget, reloads of models that stop serving
admin.py      `rollout` / `rollback` through the running frontend's admin API
keys.py       the secrets the launcher writes and the keys it presents to its own frontend
loopback.py   reaching its own frontend on this machine (wildcard binds, https without a certificate check)
tritonserver.py, engine_health.py, engine_check.py, ports.py, mpi.py: tritonserver itself, whether its
engine models serve, whether an engine fits the installed TensorRT-LLM, port checks, the multi-GPU launch
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
