"""Stopping requests on a saturated TensorRT-LLM engine, through the contract double (audit round 3, R2).

Upstream ends a stopped request only once the executor schedules it (rules.STOP_TAKES_EFFECT_WHEN_SCHEDULED): a
queued one still runs its prefill first, and Triton's own cancellation waits the same way. The double does the
same; the frontend resends a stop only while the request may still be queued in Triton, less and less often,
and gives a request without a token the longer grace (frontend/generation/triton_engine.py STOP_RESEND_S). With
32 clients leaving a saturated engine at once, every slot frees, nothing stays in Triton's request gauges, and
no request is logged more than once.
"""

from __future__ import annotations

import asyncio
import re
import threading
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import tritonclient.grpc as grpcclient

from frontend.generation.engine import SamplingOptions
from frontend.generation.trtllm_tensors import stop_inputs
from tests.integration.conftest import (CONTRACT_MODEL, Stack, engine_is_idle, engine_metrics, frontend_on,
                                        wait_engine)
from tests.integration.test_trtllm_guides import GrpcStream

pytestmark = pytest.mark.integration

BATCH = 8  # the session build's --max-batch-size: the double's slots
CLIENTS = 32
FREED_WITHIN_S = 30.0  # the bound for every slot to free once the clients are gone


def send_stop(stack: Stack, request_id: str) -> None:
    """A TensorRT-LLM stop for `request_id`, waited for until answered (an empty FINAL response)."""
    answered = threading.Event()
    client = grpcclient.InferenceServerClient(stack.triton_grpc_url)
    client.start_stream(callback=lambda result, error: answered.set())
    try:
        client.async_stream_infer(CONTRACT_MODEL, stop_inputs(), request_id=request_id)
        assert answered.wait(60), "the stop was not answered"
    finally:
        client.stop_stream()
        client.close()


def test_a_stopped_request_still_queued_runs_only_once_a_slot_frees(stack: Stack) -> None:
    """The double's rule over gRPC: the stop is answered at once, but the queued request ends only after it was
    scheduled, which takes a slot that one of the running requests gave back; it ends with no tokens, no error."""
    ended_before: list[int] = []
    running = [GrpcStream(stack, f"r2-running-{i}", SamplingOptions(max_tokens=150, ignore_eos=True))
               for i in range(BATCH)]
    try:
        wait_engine(stack.triton_metrics_url, CONTRACT_MODEL, lambda m: m["active_slots"] == BATCH, "a full batch")
        queued = GrpcStream(stack, "r2-queued", SamplingOptions(max_tokens=150, ignore_eos=True))
        try:
            wait_engine(stack.triton_metrics_url, CONTRACT_MODEL, lambda m: m["queued_requests"] >= 1,
                        "the request queued")
            send_stop(stack, "r2-queued")
            assert queued.ended.wait(120)
            ended_before.extend(i for i, stream in enumerate(running) if stream.ended.is_set())
        finally:
            queued.close()
        assert all(stream.ended.wait(120) for stream in running)
    finally:
        for stream in running:
            stream.close()
    assert queued.error is None and queued.tokens == 0
    assert ended_before, "the stopped request ended while every slot was still taken: it was never scheduled"
    assert all(stream.error is None and stream.tokens == 150 for stream in running)


def pending_in_triton(stack: Stack) -> float:
    """Triton's gauge of requests to the double it holds before the model takes them."""
    text = httpx.get(stack.triton_metrics_url, timeout=10).text
    match = re.search(rf'^nv_inference_pending_request_count{{[^}}]*model="{CONTRACT_MODEL}"[^}}]*}} (\S+)$', text,
                      re.M)
    assert match, "nv_inference_pending_request_count not exported"
    return float(match.group(1))


@pytest.fixture(scope="module")
def frontend(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    logs = tmp_path_factory.mktemp("trtllm_stops")
    with frontend_on(stack, CONTRACT_MODEL, logs, MAX_IN_FLIGHT=str(2 * CLIENTS)) as url:
        yield url, logs / "frontend.log"


async def test_32_clients_leaving_a_saturated_engine_free_every_slot(stack: Stack,
                                                                     frontend: tuple[str, Path]) -> None:
    url, log = frontend
    body = {"model": stack.model, "prompt": "The lighthouse keeper", "max_tokens": 200, "ignore_eos": True,
            "stream": True}

    async def client_stream(http: httpx.AsyncClient) -> None:
        async with http.stream("POST", f"{url}/completions", json=body) as response:
            assert response.status_code == 200
            async for _ in response.aiter_lines():
                pass

    async with httpx.AsyncClient(timeout=120) as http:
        clients = [asyncio.create_task(client_stream(http)) for _ in range(CLIENTS)]
        await asyncio.to_thread(wait_engine, stack.triton_metrics_url, CONTRACT_MODEL,
                                lambda m: m["active_slots"] == BATCH and m["active_slots"] + m["queued_requests"]
                                >= CLIENTS, f"{CLIENTS} requests in a saturated engine")
        for task in clients:  # every client gone at once
            task.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
    await asyncio.to_thread(wait_engine, stack.triton_metrics_url, CONTRACT_MODEL, engine_is_idle,
                            "every slot free", FREED_WITHIN_S)
    assert pending_in_triton(stack) == 0
    assert engine_is_idle(engine_metrics(stack.triton_metrics_url, CONTRACT_MODEL))
    warnings = [line for line in log.read_text().splitlines() if " WARNING " in line]
    per_request: dict[str, int] = {}
    for line in warnings:
        for request_id in re.findall(r"\b[0-9a-f]{32}\b", line):
            per_request[request_id] = per_request.get(request_id, 0) + 1
    assert len(warnings) <= CLIENTS and all(count <= 1 for count in per_request.values()), warnings
