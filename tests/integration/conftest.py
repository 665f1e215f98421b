"""The real stack for integration tests: the tiny demo engine, `tritonserver`, and the frontend.

Built once per test session on free loopback ports; every test talks to real processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import openai
import pytest

from benchmarks.servers import stop_process, wait_http_ok
from launcher.ports import find_free_port
from launcher.tritonserver import TritonServer

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Stack:
    base_url: str  # http://127.0.0.1:<port>/v1
    root_url: str  # http://127.0.0.1:<port>
    triton_grpc_url: str
    triton_metrics_url: str
    model: str
    checkpoint_dir: Path
    context_length: int


def start_frontend(triton_grpc_url: str, port: int, log_file: Path, **env: str) -> subprocess.Popen:
    environment = {**os.environ, "FRONTEND_HOST": "127.0.0.1", "FRONTEND_PORT": str(port),
                   "TRITON_GRPC_URL": triton_grpc_url, **env}
    return subprocess.Popen([sys.executable, "-m", "frontend"], env=environment, cwd=REPO_ROOT,
                            stdout=log_file.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="session")
def built_engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`python -m build_engine --preset tiny`, exactly as `make engine PRESET=tiny` runs it."""
    out = tmp_path_factory.mktemp("build")
    subprocess.run([sys.executable, "-m", "build_engine", "--preset", "tiny", "--output-dir", str(out),
                    "--max-batch-size", "8", "--max-seq-len", "512"], check=True, cwd=REPO_ROOT)
    return out


@pytest.fixture(scope="session")
def stack(built_engine: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("logs")
    http, grpc, metrics, frontend_port = (find_free_port() for _ in range(4))
    triton = TritonServer(built_engine / "model_repository", http_port=http, grpc_port=grpc,
                          metrics_port=metrics, log_file=logs / "tritonserver.log", work_dir=built_engine)
    triton.start()
    frontend = None
    try:
        triton.wait_ready(300)
        grpc_url = f"127.0.0.1:{grpc}"
        frontend = start_frontend(grpc_url, frontend_port, logs / "frontend.log")
        root = f"http://127.0.0.1:{frontend_port}"
        wait_http_ok(f"{root}/health/ready", 120, frontend)
        checkpoint = built_engine / "checkpoints" / "demo-tiny"
        yield Stack(f"{root}/v1", root, grpc_url, f"http://127.0.0.1:{metrics}/metrics", "demo-tiny",
                    checkpoint, 512)
    finally:
        if frontend is not None:
            stop_process(frontend)
        triton.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def async_client(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)
