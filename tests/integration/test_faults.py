"""Triton dying under load (kill -9 while 8 streams run): every open stream ends with an error event then
[DONE] (none of them finished: each ended by the failure, never hanging), readiness turns 503, new requests get 503, and
the frontend serves again once Triton is back, without a restart.

Triton serves a slow test copy of the engine model only (>= 50 ms a step: engine_knobs.py), so that the streams
still run when Triton dies however fast this machine is."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest

from launcher.ports import find_free_port
from launcher.tritonserver import TritonServer
from tests.integration.conftest import read_stream, start_frontend, stop_process, wait_http_ok
from tests.integration.engine_knobs import add_knob_model

pytestmark = pytest.mark.integration

SLOW = "tensorrt_llm_faults_slow"  # this test's repository only


async def test_triton_killed_mid_stream_then_restarted(built_engine: Path, tmp_path: Path) -> None:
    http, grpc, metrics, port = (find_free_port() for _ in range(4))
    repository = tmp_path / "model_repository"
    shutil.copytree(built_engine / "model_repository" / "tensorrt_llm", repository / "tensorrt_llm")
    add_knob_model(repository, SLOW, test_step_delay_s=0.05)  # 450 tokens take >= 22 s
    shutil.rmtree(repository / "tensorrt_llm")

    def triton() -> TritonServer:
        return TritonServer(repository, http_port=http, grpc_port=grpc, metrics_port=metrics,
                            log_file=tmp_path / f"triton-{time.monotonic_ns()}.log", work_dir=built_engine,
                            model_name=SLOW)

    first = triton()
    first.start()
    frontend = None
    second = None
    try:
        first.wait_ready(300)
        frontend = start_frontend(f"127.0.0.1:{grpc}", port, tmp_path / "frontend.log", ENGINE_MODEL=SLOW,
                                  TOKENIZER_DIR=str(built_engine / "checkpoints" / "demo-tiny"))
        root = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{root}/health/ready", 120, frontend)
        body = {"model": "demo-tiny", "prompt": "keep going", "max_tokens": 450, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(timeout=60) as client:
            events = [asyncio.Event() for _ in range(8)]  # 8 concurrent streams, as many as the engine runs
            streams = [asyncio.create_task(read_stream(client, f"{root}/v1/completions", body, e, started_after=3))
                       for e in events]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
            os.killpg(first.pid, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*streams), 60)  # a hang guard, not a timing
            for payloads, _ in results:
                assert payloads[-1] == "[DONE]"
                # ended by the failure, not by itself: no choice finished (450 tokens take >= 22 s)
                assert not [c for p in payloads[:-2] for c in json.loads(p)["choices"] if c["finish_reason"]], payloads
                error = json.loads(payloads[-2])["error"]
                assert error["code"] == "service_unavailable" and error["message"]
            deadline = time.monotonic() + 60
            while (await client.get(f"{root}/health/ready")).status_code != 503:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)
            response = await client.post(f"{root}/v1/completions", json={**body, "stream": False, "max_tokens": 2})
            assert response.status_code == 503 and response.json()["error"]["type"] == "server_error"
            first.stop()

            second = triton()
            second.start()
            second.wait_ready(300)
            deadline = time.monotonic() + 60
            while True:
                response = await client.post(f"{root}/v1/completions",
                                             json={**body, "stream": False, "max_tokens": 2})
                if response.status_code == 200:
                    break
                assert time.monotonic() < deadline, response.text
                await asyncio.sleep(0.5)
            assert response.json()["usage"]["completion_tokens"] == 2
            assert (await client.get(f"{root}/health/ready")).status_code == 200
    finally:
        if frontend is not None:
            stop_process(frontend)
        first.stop()
        if second is not None:
            second.stop()
