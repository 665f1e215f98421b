"""The real stack for integration tests: the tiny demo engine, `tritonserver`, and the frontend.

Built once per test session on free loopback ports; every test talks to real processes. Next to the real
`tensorrt_llm` model, the session's Triton serves test copies of it whose speed and faults the tests
control (tests/integration/engine_knobs.py), so that no test depends on how fast this machine is.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import httpx
import openai
import pytest

from benchmarks.servers import stop_process, wait_http_ok
from launcher.ports import find_free_port
from launcher.tritonserver import TritonServer
from tests.integration.engine_knobs import add_knob_model
from tests.integration.scripted_model import ScriptedModel, add_scripted_model
from tests.trtllm_contract.double import add_contract_double


# Test copies of the engine model (same weights), each with what a test needs (engine_knobs.py); a step
# delay makes a stream last at least ((tokens - 1) x delay) on any machine:
SLOW_MODEL = "tensorrt_llm_slow"  # >= 50 ms a step: 450 tokens take >= 22 s
HELD_MODEL = "tensorrt_llm_held"  # no response leaves until 60 s after the request (or its end)
FAULTY_MODEL = "tensorrt_llm_faulty"  # a request with seed FAIL_SEED fails after its first token
FAIL_SEED = 1001
SLOW_MODEL_QUEUE = 4  # the slow engine's own queue bound (the real one's is 256): 8 running + 4 waiting
KNOB_MODELS: dict[str, dict[str, float]] = {
    SLOW_MODEL: {"test_step_delay_s": 0.05},
    HELD_MODEL: {"test_hold_first_response_s": 60, "test_step_delay_s": 0.05},
    FAULTY_MODEL: {"test_fail_seed": FAIL_SEED, "test_step_delay_s": 0.02},
}

# The TensorRT-LLM contract double (tests/trtllm_contract): the TensorRT-LLM template rendered with the
# TensorRT-LLM values, on the CPU engine, refusing what the real C++ backend refuses. A step delay, as in
# the knob models, so that a stream outlives its client's departure on any machine.
CONTRACT_MODEL = "tensorrt_llm_contract"
CONTRACT_STEP_DELAY_S = 0.02
CONTRACT_LORA_CACHE_TASKS = 2  # the double's PEFT cache holds two LoRA tasks: a third evicts (tests/integration/test_lora.py)

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
    triton_http_url: str
    scripted: ScriptedModel  # the engine model whose greedy output the tests script (scripted_model.py)
    repository: Path  # the session Triton's model repository (explicit model control: models load on demand)
    triton_control: dict[str, str]  # the HTTP header Triton's load/unload/index endpoints need (restricted API)
    triton_log: Path  # the session Triton's log (its models' server log lines too)

    def engine_metric(self, name: str, model: str = "tensorrt_llm") -> float:
        """A CPU engine metric of one engine model, from Triton's metrics port (`cpu_engine_<name>`)."""
        text = httpx.get(self.triton_metrics_url, timeout=10).text
        match = re.search(rf'^cpu_engine_{name}{{[^}}]*model="{model}"[^}}]*}} ([0-9.e+-]+)$', text, re.M)
        assert match, f"cpu_engine_{name} of {model} not exported"
        return float(match.group(1))


async def read_stream(client: httpx.AsyncClient, url: str, body: dict, started: asyncio.Event,
                      started_after: int = 1) -> tuple[list[str], float]:
    """Every data payload of one SSE stream (`started` set once `started_after` have come), and when the
    stream ended."""
    payloads: list[str] = []
    async with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                payloads.append(line[len("data: "):])
                if len(payloads) >= started_after:
                    started.set()
    return payloads, time.monotonic()


def wait_until(condition: Callable[[], bool], within_s: float) -> bool:
    """Poll `condition` every 20 ms until it holds (True) or `within_s` has passed (False)."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def set_parameter(model_dir: Path, key: str, value: str) -> None:
    """Change one parameter of a rendered model config."""
    config = model_dir / "config.pbtxt"
    text, count = re.subn(rf'(key: "{key}"\s*value: {{ string_value: )"[^"]*"', rf'\1"{value}"', config.read_text())
    assert count == 1, f"{key} not in {config}"
    config.write_text(text)


def start_frontend(triton_grpc_url: str, port: int, log_file: Path, **env: str) -> subprocess.Popen:
    # Stored responses next to the log unless the test (or the environment) names a database: never a file
    # shared with another test session.
    environment = {"RESPONSES_DB_URL": f"sqlite:///{log_file.parent / 'responses.sqlite3'}", **os.environ,
                   "FRONTEND_HOST": "127.0.0.1", "FRONTEND_PORT": str(port), "TRITON_GRPC_URL": triton_grpc_url, **env}
    return subprocess.Popen([sys.executable, "-m", "frontend"], env=environment, cwd=REPO_ROOT,
                            stdout=log_file.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


@contextmanager
def frontend_on(stack: Stack, engine_model: str, log_dir: Path, **env: str) -> Iterator[str]:
    """A frontend of its own on one engine model of the session Triton, serving it under the stack's model
    id (unless `env` says otherwise): its base URL (http://.../v1), until the block ends."""
    port = find_free_port()
    process = start_frontend(stack.triton_grpc_url, port, log_dir / "frontend.log", ENGINE_MODEL=engine_model,
                             **{"SERVED_MODEL_NAME": stack.model, **env})
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health/ready", 120, process)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop_process(process)


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
    repository = tmp_path_factory.mktemp("stack") / "model_repository"
    shutil.copytree(built_engine / "model_repository", repository)
    for name, knobs in KNOB_MODELS.items():
        add_knob_model(repository, name, **knobs)
    set_parameter(repository / SLOW_MODEL, "cpu_max_queue_size", str(SLOW_MODEL_QUEUE))
    add_contract_double(repository, CONTRACT_MODEL, built_engine / "engine", test_step_delay_s=CONTRACT_STEP_DELAY_S,
                        test_lora_cache_tasks=CONTRACT_LORA_CACHE_TASKS)
    scripted = add_scripted_model(repository, repository.parent / "scripted")
    http, grpc, metrics, frontend_port = (find_free_port() for _ in range(4))
    triton = TritonServer(repository, http_port=http, grpc_port=grpc,
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
                    checkpoint, 512, f"http://127.0.0.1:{http}", scripted, repository, triton.control_headers,
                    logs / "tritonserver.log")
    finally:
        if frontend is not None:
            stop_process(frontend)
        triton.stop()


QWEN_MODEL = "tensorrt_llm_qwen"
QWEN_SERVED_NAME = "demo-qwen-tiny"


@pytest.fixture(scope="session")
def qwen_url(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second model family in the session Triton: the Qwen2 demo checkpoint (Hermes-style tool calling in
    its chat template), built as `make engine PRESET=qwen-tiny` builds it, loaded into the running Triton
    (explicit model control) only when a test asks for it, with a frontend of its own: its base URL."""
    out = tmp_path_factory.mktemp("build_qwen")
    subprocess.run([sys.executable, "-m", "build_engine", "--preset", "qwen-tiny", "--output-dir", str(out),
                    "--max-batch-size", "8", "--max-seq-len", "1024"], check=True, cwd=REPO_ROOT)
    target = stack.repository / QWEN_MODEL
    shutil.copytree(out / "model_repository" / "tensorrt_llm", target, ignore=shutil.ignore_patterns("__pycache__"))
    config = target / "config.pbtxt"
    config.write_text(re.sub(r'^name:\s*"[^"]*"', f'name: "{QWEN_MODEL}"', config.read_text(), count=1, flags=re.M))
    httpx.post(f"{stack.triton_http_url}/v2/repository/models/{QWEN_MODEL}/load", headers=stack.triton_control,
               timeout=300).raise_for_status()
    port = find_free_port()
    process = start_frontend(stack.triton_grpc_url, port, tmp_path_factory.mktemp("qwen_logs") / "frontend.log",
                             ENGINE_MODEL=QWEN_MODEL, SERVED_MODEL_NAME=QWEN_SERVED_NAME,
                             TOKENIZER_DIR=str(out / "checkpoints" / QWEN_SERVED_NAME))
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health/ready", 120, process)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop_process(process)


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def async_client(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)


# ----- the engine's metrics, without racing them ------------------------------------------------------------
# The engine publishes its metrics from a thread of its own (cpu_engine/engine.py: _LatestOnly, at least
# MIN_STATS_SPACING_S apart, again every stats_period_s while idle), so a scrape may show a state the engine
# has already left: right after a request ends its slot can still read busy, and right after one starts the
# engine can still read idle. A test decides on what only the request it sent can have caused (a counter
# that moved past its value before the send), never on a gauge alone.
ENGINE_STATS_PERIOD_S = 0.1  # cpu_engine.engine.Engine's stats_period_s, as the Triton model uses it
ENGINE_WAIT_S = 60.0  # a bound for a hung stack, not a speed: every wait below ends on what the engine reports


def engine_metrics(metrics_url: str, model: str) -> dict[str, float]:
    """Every `cpu_engine_<name>` of one engine model from one scrape of Triton's metrics: name -> value."""
    text = httpx.get(metrics_url, timeout=10).text
    return {name: float(value) for name, labels, value in re.findall(r"^cpu_engine_(\w+)\{([^}]*)\} (\S+)$", text, re.M)
            if re.search(rf'(^|,)model="{re.escape(model)}"(,|$)', labels)}


def wait_engine(metrics_url: str, model: str, condition: Callable[[dict[str, float]], bool], what: str,
                within_s: float = ENGINE_WAIT_S) -> dict[str, float]:
    """Poll the engine model's metrics until `condition` holds; they are returned. Fails the test, with what was
    last seen, after `within_s` (a hang guard)."""
    deadline = time.monotonic() + within_s
    while True:
        values = engine_metrics(metrics_url, model)
        if values and condition(values):
            return values
        assert time.monotonic() < deadline, f"{model}: timed out after {within_s:.0f} s waiting for {what}; " \
                                            f"last seen {values}"
        time.sleep(0.02)


def engine_is_idle(values: dict[str, float]) -> bool:
    return values["active_slots"] == 0 and values["queued_requests"] == 0


def engine_settled(metrics_url: str, model: str, after: dict[str, float] | None = None,
                   within_s: float = ENGINE_WAIT_S) -> dict[str, float]:
    """The engine model's metrics once it is idle and they have stopped changing: its counters then include
    every request that ended before. With `after` (metrics read before requests that reached the engine were
    sent), only once the engine has stepped since, so that a stale idle snapshot from before those requests
    cannot pass for one after them. Idle, the engine publishes again every period: two idle scrapes some periods
    apart that agree on every value were not read from a snapshot that a newer one was about to replace."""
    def idle(values: dict[str, float]) -> bool:
        return engine_is_idle(values) and (after is None or values["steps_total"] > after["steps_total"])

    deadline = time.monotonic() + within_s
    while True:
        first = wait_engine(metrics_url, model, idle, "the engine to be idle", max(0.0, deadline - time.monotonic()))
        time.sleep(3 * ENGINE_STATS_PERIOD_S)
        second = engine_metrics(metrics_url, model)
        if second == first:
            return second
        assert time.monotonic() < deadline, f"{model}: metrics still changing after {within_s:.0f} s: {second}"
