"""An engine thread that dies, on the real stack: the open streams end with an error event at once (never
hang), the model goes not ready (Triton, and the frontend's /health/ready), and later requests get a
fast 503.

It runs on a tritonserver of its own, holding only a test copy of the engine model that crashes its
engine thread on cue (engine_knobs.py, `test_crash_seed`): the failed model unloads itself, and while a
model unloads Triton's server-wide readiness is false, which must not reach the other tests."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from launcher.ports import find_free_port
from launcher.tritonserver import STACK_DUMP_MARKER, TritonServer, TritonStartError
from tests.integration.conftest import start_frontend, stop_process, wait_http_ok
from tests.integration.engine_knobs import HANG_MESSAGE, add_knob_model

pytestmark = pytest.mark.integration

CRASH_MODEL, CRASH_SEED = "tensorrt_llm_crash", 666
HANG_MODEL = "tensorrt_llm_hang"


@pytest.fixture(scope="module")
def crash_frontend(built_engine: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A frontend (root URL) on a tritonserver that serves only the crashing engine model."""
    work = tmp_path_factory.mktemp("engine_failure")
    repository = work / "model_repository"
    shutil.copytree(built_engine / "model_repository" / "tensorrt_llm", repository / "tensorrt_llm")
    add_knob_model(repository, CRASH_MODEL, test_crash_seed=CRASH_SEED, test_step_delay_s=0.05)
    shutil.rmtree(repository / "tensorrt_llm")
    http, grpc, metrics, port = (find_free_port() for _ in range(4))
    triton = TritonServer(repository, http_port=http, grpc_port=grpc, metrics_port=metrics,
                          log_file=work / "tritonserver.log", work_dir=built_engine, model_name=CRASH_MODEL)
    triton.start()
    frontend = None
    try:
        triton.wait_ready(300)
        frontend = start_frontend(f"127.0.0.1:{grpc}", port, work / "frontend.log", ENGINE_MODEL=CRASH_MODEL,
                                  TOKENIZER_DIR=str(built_engine / "checkpoints" / "demo-tiny"))
        wait_http_ok(f"http://127.0.0.1:{port}/health/ready", 120, frontend)
        yield f"http://127.0.0.1:{port}"
    finally:
        if frontend is not None:
            stop_process(frontend)
        triton.stop()


async def test_an_engine_thread_that_dies_fails_open_streams_and_turns_readiness_off(crash_frontend: str) -> None:
    root = crash_frontend
    body = {"model": "demo-tiny", "prompt": "crash", "max_tokens": 400, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as http:
        async def bystander(started: asyncio.Event) -> list[str]:
            async with http.stream("POST", f"{root}/v1/completions", json={**body, "stream": True}) as response:
                payloads = []
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        payloads.append(line[6:])
                        started.set()
                return payloads

        started = asyncio.Event()
        open_stream = asyncio.create_task(bystander(started))  # 400 tokens: >= 20 s on this engine
        await asyncio.wait_for(started.wait(), 60)
        crash = await http.post(f"{root}/v1/completions", json={**body, "seed": CRASH_SEED, "max_tokens": 5})
        assert crash.status_code == 500 and "engine" in crash.json()["error"]["message"], crash.text
        payloads = await asyncio.wait_for(open_stream, 60)  # ended with an error, not left hanging
        assert payloads[-1] == "[DONE]" and "engine failed" in json.loads(payloads[-2])["error"]["message"]

        deadline = time.monotonic() + 60
        while (await http.get(f"{root}/health/ready")).status_code != 503:
            assert time.monotonic() < deadline, "still ready with a dead engine"
            await asyncio.sleep(0.1)
        refused_at = time.monotonic()
        later = await http.post(f"{root}/v1/completions", json={**body, "max_tokens": 2})
        # at once: no waiting for a slot or a deadline (REQUEST_TIMEOUT_S is minutes); generous for a busy machine
        assert later.status_code == 503 and time.monotonic() - refused_at < 30, later.text


def test_a_load_that_never_ends_fails_with_the_stacks_of_the_stub_threads(built_engine: Path, tmp_path: Path) -> None:
    """A model whose initialize() never returns: waiting for readiness times out with every Python thread's
    stack of the model's stub in the error (model.py registers the dump signal, the launcher sends it), so a
    load that hangs (in CI too) says where it waits."""
    repository = tmp_path / "model_repository"
    shutil.copytree(built_engine / "model_repository" / "tensorrt_llm", repository / "tensorrt_llm")
    add_knob_model(repository, HANG_MODEL, test_hang_in_initialize=1)
    shutil.rmtree(repository / "tensorrt_llm")
    log = tmp_path / "tritonserver.log"
    http, grpc, metrics = (find_free_port() for _ in range(3))
    triton = TritonServer(repository, http_port=http, grpc_port=grpc, metrics_port=metrics, log_file=log,
                          work_dir=built_engine, model_name=HANG_MODEL)
    triton.start()
    try:
        deadline = time.monotonic() + 300
        while HANG_MESSAGE not in log.read_text(errors="replace"):  # the engine loaded; initialize hangs now
            assert triton.poll() is None and time.monotonic() < deadline, triton.log_tail()
            time.sleep(0.1)
        with pytest.raises(TritonStartError) as failure:
            triton.wait_ready(0)
    finally:
        triton.stop(grace_s=5)
    message = str(failure.value)
    assert f"model {HANG_MODEL!r}) not ready after 0 s" in message
    assert STACK_DUMP_MARKER in message, message
    assert "in _hang_in_initialize" in message, message  # the stuck thread, where it waits
    assert "cpu_engine/engine.py" in message, message  # and the others: the engine thread's loop
