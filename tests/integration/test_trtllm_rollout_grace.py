"""A swap rollout (the TensorRT-LLM layout, run by the contract double) while a generation outlives the grace
period (audit round 3, R5): Triton unloads a version only once every request to it has ended, so without
more the held requests would wait for the longest generation. The frontend stops what is still on the old
version once the grace is over (frontend/models/registry.py VersionEngine.drain_or_retire): the long request
ends with an error event and [DONE], and the rollout goes on within the grace plus the stop's own grace."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from frontend.generation.triton_engine import STOP_GRACE_S
from tests.integration.conftest import Stack
from tests.integration.scripted_model import CHAT_MESSAGES
from tests.integration.test_model_versions import (ASSISTANT, CODER, V1_TEXT, V2_TEXT, build, build_two_models,
                                                   launched, make, scripted_checkpoint)
from tests.trtllm_contract.double import make_named_contract_doubles

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

GRACE_S = 1.0
STEP_DELAY_S = 0.1  # per engine step: the long request below needs >= 20 s, far past GRACE_S + STOP_GRACE_S
LONG_TOKENS = 200


async def long_stream(root: str, started: asyncio.Event) -> tuple[list[dict], bool, float]:
    """One long chat stream on the assistant: its chunks, whether it ended with [DONE], and when it ended."""
    body = {"model": ASSISTANT, "messages": CHAT_MESSAGES, "temperature": 0, "max_tokens": LONG_TOKENS,
            "ignore_eos": True, "stream": True}
    chunks, done = [], False
    async with httpx.AsyncClient(timeout=300) as client:
        async with client.stream("POST", f"{root}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunks.append(json.loads(line[len("data: "):]))
                    if len(chunks) >= 3:
                        started.set()
    return chunks, done, time.monotonic()


async def test_a_swap_stops_what_outlives_the_grace(stack: Stack, tmp_path_factory: pytest.TempPathFactory,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    out, checkpoints = tmp_path_factory.mktemp("named_grace"), tmp_path_factory.mktemp("checkpoints_grace")
    build_two_models(stack, out, checkpoints)
    demo_dir = stack.scripted.demo.tokenizer_dir
    build(out, ASSISTANT, scripted_checkpoint(demo_dir, demo_dir, V2_TEXT, checkpoints / "assistant-v2"))
    make_named_contract_doubles(out / "models", test_step_delay_s=STEP_DELAY_S)
    monkeypatch.setenv("ROLLOUT_GRACE_S", str(GRACE_S))
    with launched(out, frontend_workers=1) as served:
        started = asyncio.Event()
        stream = asyncio.create_task(long_stream(served.root, started))
        await asyncio.wait_for(started.wait(), 120)  # generating on version 1
        began = time.monotonic()
        result = await asyncio.to_thread(make, served, "rollout", f"NAME={ASSISTANT}", "VERSION=2")
        chunks, done, ended = await stream
        assert result.returncode == 0, result.stdout + result.stderr
        assert done, "the long stream ended without [DONE]"
        errors = [chunk["error"] for chunk in chunks if "error" in chunk]
        assert len(errors) == 1 and "retired by a rollout" in errors[0]["message"], chunks[-3:]
        assert errors[0]["code"] == "service_unavailable"
        generated = sum(1 for chunk in chunks if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"))
        assert generated < LONG_TOKENS, "the long request ran to its end"
        assert ended - began <= GRACE_S + STOP_GRACE_S, f"stopped {ended - began:.1f} s after the rollout began"
        client = httpx.Client(timeout=120)
        answer = client.post(f"{served.root}/v1/chat/completions", json={
            "model": ASSISTANT, "messages": CHAT_MESSAGES, "temperature": 0, "max_tokens": 32}).json()
        assert answer["choices"][0]["message"]["content"] == V2_TEXT
        assert V1_TEXT != V2_TEXT and CODER  # the build's other model is untouched (test_model_versions covers it)
    log = Path(out / "logs" / "tritonserver.log").read_text()
    assert "successfully unloaded 'assistant' version 1" in log
