"""launcher: port checks, locating tritonserver, and one real tritonserver on a trivial Python model.

The real-server tests use the nvidia-pytriton wheel's tritonserver (CPU only); they take a few seconds.
"""

from __future__ import annotations

import json
import os
import socket
import textwrap
import urllib.request
from pathlib import Path

import pytest

from launcher.ports import PortInUseError, check_ports_free, find_free_port
from launcher.tritonserver import TritonServer, TritonStartError, find_tritonserver, group_alive

IDENTITY_CONFIG = """\
name: "identity"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

IDENTITY_MODEL = textwrap.dedent("""\
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            responses = []
            for request in requests:
                data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
                out = pb_utils.Tensor("OUTPUT0", data)
                responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
            return responses
""")


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shared so the backend dir (a few MB) is assembled once per module."""
    return tmp_path_factory.mktemp("launcher_work")


def _free_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(find_free_port())
    return sorted(ports)


def _server(repo: Path, work_dir: Path, tmp_path: Path) -> TritonServer:
    http, grpc, metrics = _free_ports(3)
    return TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics,
                        log_file=tmp_path / "logs" / "tritonserver.log", work_dir=work_dir, model_name="identity")


def _identity_repo(root: Path, config: str = IDENTITY_CONFIG) -> Path:
    model_dir = root / "identity"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(config)
    (model_dir / "1" / "model.py").write_text(IDENTITY_MODEL)
    return root


# ----- ports --------------------------------------------------------------------------------------------
def test_check_ports_free_names_the_env_var_of_a_taken_port() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        taken = held.getsockname()[1]
        free = find_free_port()
        with pytest.raises(PortInUseError) as info:
            check_ports_free({"TRITON_HTTP_PORT": free, "TRITON_GRPC_PORT": taken})
    message = str(info.value)
    assert f"port {taken} (TRITON_GRPC_PORT) is already in use" in message
    assert "set TRITON_GRPC_PORT to a free port" in message
    assert info.value.env_var == "TRITON_GRPC_PORT" and info.value.port == taken


def test_check_ports_free_passes_when_all_free() -> None:
    check_ports_free({"A": find_free_port(), "B": find_free_port()})


# ----- locating tritonserver ----------------------------------------------------------------------------
def test_find_tritonserver_gives_runnable_binary_and_python_backend(work_dir: Path) -> None:
    install = find_tritonserver(work_dir)
    assert install.binary.is_file() and os.access(install.binary, os.X_OK)
    python_dir = install.backend_dir / "python"
    assert (python_dir / "libtriton_python.so").is_file()
    stub = python_dir / "triton_python_backend_stub"
    assert stub.is_file() and os.access(stub, os.X_OK)
    # Second call reuses the copies (same size) and gives the same answer.
    assert find_tritonserver(work_dir) == install


def test_command_binds_loopback_with_given_ports(work_dir: Path, tmp_path: Path) -> None:
    server = TritonServer(tmp_path / "repo", http_port=18000, grpc_port=18001, metrics_port=18002,
                          log_file=tmp_path / "t.log", work_dir=work_dir, extra_args=["--log-info=true"])
    argv = server.command()
    for flag in ("--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1",
                 "--http-port=18000", "--grpc-port=18001", "--metrics-port=18002",
                 f"--model-repository={tmp_path / 'repo'}", "--disable-auto-complete-config",
                 "--backend-config=python,shm-region-prefix-name=prefix18001_", "--exit-on-error=true"):
        assert flag in argv
    assert argv[-1] == "--log-info=true"
    assert server.pid is None
    server.stop()  # never started: a no-op


# ----- a real tritonserver ------------------------------------------------------------------------------
def test_real_server_serves_identity_and_stops_cleanly(work_dir: Path, tmp_path: Path) -> None:
    server = _server(_identity_repo(tmp_path / "repo"), work_dir, tmp_path)
    try:
        server.start()
        pgid = server.pid
        assert pgid is not None
        server.wait_ready(120)
        body = {"inputs": [{"name": "INPUT0", "shape": [3], "datatype": "FP32", "data": [1.0, 2.5, -3.0]}]}
        request = urllib.request.Request(
            f"http://127.0.0.1:{server.http_port}/v2/models/identity/infer",
            data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as resp:
            answer = json.loads(resp.read())
        (output,) = answer["outputs"]
        assert output["name"] == "OUTPUT0" and output["data"] == [1.0, 2.5, -3.0]
    finally:
        server.stop()
    assert not group_alive(pgid)
    server.stop()  # idempotent


def test_wait_ready_reports_broken_config_with_log(work_dir: Path, tmp_path: Path) -> None:
    broken = IDENTITY_CONFIG.replace("TYPE_FP32", "TYPE_NOT_A_TYPE", 1)
    server = _server(_identity_repo(tmp_path / "repo", broken), work_dir, tmp_path)
    try:
        server.start()
        with pytest.raises(TritonStartError) as info:
            server.wait_ready(120)
    finally:
        server.stop()
    message = str(info.value)
    assert "exited with code" in message
    assert str(server.log_file) in message and "TYPE_NOT_A_TYPE" in message
