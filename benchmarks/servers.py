"""Start what a benchmark needs, on free loopback ports, and stop it all afterwards: Triton (launcher's
TritonServer), the frontend (`python -m frontend`, as tests/integration/conftest.py starts it) and the
naive baseline (`python -m benchmarks.naive_server`)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from launcher.ports import find_free_port
from launcher.tritonserver import TritonServer

REPO_ROOT = Path(__file__).resolve().parents[1]


def wait_http_ok(url: str, timeout_s: float, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode} while waiting for {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not ready after {timeout_s} s")


def stop_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def repository_parameter(model_repository: Path, model: str, key: str) -> str | None:
    """A `parameters { key: ... value: { string_value: ... } }` entry of a rendered config.pbtxt."""
    text = (Path(model_repository) / model / "config.pbtxt").read_text()
    match = re.search(r'key:\s*"' + re.escape(key) + r'"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', text)
    return match.group(1) if match else None


def _parameter_pattern(key: str) -> "re.Pattern[str]":
    return re.compile(r'(key:\s*"' + re.escape(key) + r'"\s*value:\s*\{\s*string_value:\s*")([^"]*)(")')


def set_repository_parameter(model_repository: Path, model: str, key: str, value: str) -> None:
    """Rewrite (or add) a `parameters` entry of a rendered config.pbtxt, in place."""
    path = Path(model_repository) / model / "config.pbtxt"
    text = path.read_text()
    text, count = _parameter_pattern(key).subn(lambda m: m.group(1) + value + m.group(3), text)
    if not count:
        text += f'\nparameters: {{\n  key: "{key}"\n  value: {{ string_value: "{value}" }}\n}}\n'
    path.write_text(text)


@contextlib.contextmanager
def repository_copy(model_repository: Path, model: str, parameters: dict[str, str]) -> Iterator[Path]:
    """A temporary copy of a rendered model repository with some of `model`'s parameters rewritten
    (e.g. enable_kv_cache_reuse), removed afterwards. The rendered configs hold absolute paths (engine,
    tokenizer), so the copy serves the same engine."""
    with tempfile.TemporaryDirectory(prefix="model-repository-") as tmp:
        copy = Path(tmp) / "model_repository"
        shutil.copytree(model_repository, copy, ignore=shutil.ignore_patterns("__pycache__"))
        for key, value in parameters.items():
            set_repository_parameter(copy, model, key, value)
        yield copy


@dataclass(frozen=True)
class TritonEndpoints:
    grpc_url: str
    http_url: str
    metrics_url: str


@contextlib.contextmanager
def triton(model_repository: Path, work_dir: Path, log_dir: Path, timeout_s: float = 300) -> Iterator[TritonEndpoints]:
    http, grpc, metrics = find_free_port(), find_free_port(), find_free_port()
    server = TritonServer(Path(model_repository), http_port=http, grpc_port=grpc, metrics_port=metrics,
                          log_file=Path(log_dir) / "tritonserver.log", work_dir=Path(work_dir))
    server.start()
    try:
        server.wait_ready(timeout_s)
        yield TritonEndpoints(f"127.0.0.1:{grpc}", f"http://127.0.0.1:{http}", f"http://127.0.0.1:{metrics}/metrics")
    finally:
        server.stop()


def _spawn(args: list[str], log_file: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], env={**os.environ, **(env or {})}, cwd=REPO_ROOT,
                            stdout=Path(log_file).open("w"), stderr=subprocess.STDOUT, start_new_session=True)


@contextlib.contextmanager
def frontend(triton_grpc_url: str, log_dir: Path, timeout_s: float = 180) -> Iterator[str]:
    """Yields the OpenAI base URL (http://127.0.0.1:PORT/v1)."""
    with frontend_process(triton_grpc_url, log_dir, timeout_s) as (base_url, _):
        yield base_url


@contextlib.contextmanager
def frontend_process(triton_grpc_url: str, log_dir: Path, timeout_s: float = 180,
                     env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """`frontend`, with more environment (e.g. ENGINE_MODEL) and the process itself (its pid: CPU time)."""
    port = find_free_port()
    process = _spawn(["-m", "frontend"], Path(log_dir) / "frontend.log",
                     {"FRONTEND_HOST": "127.0.0.1", "FRONTEND_PORT": str(port), "TRITON_GRPC_URL": triton_grpc_url,
                      **(env or {})})
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health/ready", timeout_s, process)
        yield f"http://127.0.0.1:{port}/v1", process
    finally:
        stop_process(process)


@contextlib.contextmanager
def naive_server(checkpoint: Path, model_name: str, log_dir: Path, timeout_s: float = 180) -> Iterator[str]:
    """Starts the naive baseline and yields at once (it loads while the caller starts other things);
    call the handle's wait_ready() before sending requests."""
    port = find_free_port()
    process = _spawn(["-m", "benchmarks.naive_server", "--checkpoint", str(checkpoint), "--port", str(port),
                      "--model-name", model_name], Path(log_dir) / "naive_server.log")
    try:
        yield NaiveHandle(f"http://127.0.0.1:{port}", process, timeout_s)
    finally:
        stop_process(process)


@dataclass
class NaiveHandle:
    root_url: str
    process: subprocess.Popen
    timeout_s: float

    @property
    def base_url(self) -> str:
        return f"{self.root_url}/v1"

    def wait_ready(self) -> str:
        wait_http_ok(f"{self.root_url}/health/ready", self.timeout_s, self.process)
        return self.base_url
