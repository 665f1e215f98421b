"""A guide that does not compile, through the TensorRT-LLM contract double (tests/trtllm_contract): in the
engine it fails EVERY active request of the model (rules.GUIDE_FAILS_THE_BATCH, upstream's executor), so the
frontend compiles every guide first (frontend/planning/guide_check.py) and answers a 400 naming the field;
another client's stream runs to its end untouched, and the double never saw a guide fail."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from typing import Any

import httpx
import pytest
import tritonclient.grpc as grpcclient

from frontend.generation.engine import Guide, SamplingOptions
from frontend.generation.trtllm_tensors import build_inputs, requested_outputs
from tests.integration.conftest import CONTRACT_MODEL, Stack, read_stream
from tests.integration.test_trtllm_contract import contract_url  # noqa: F401 (a fixture: this module's own frontend)
from tests.trtllm_contract import rules

pytestmark = pytest.mark.integration

LOOK_BEHIND = {"type": "object", "properties": {"id": {"type": "string", "pattern": "(?<=x)y"}}, "required": ["id"]}
LONG_STREAM_TOKENS = 200  # the double steps at most every 20 ms: >= 4 s, while the bad guides take milliseconds


def guide_failures(stack: Stack) -> float:
    """The double's count of guides that failed to compile in the engine (rules.GUIDE_FAILURES_METRIC)."""
    text = httpx.get(stack.triton_metrics_url, timeout=10).text
    match = re.search(rf'^{rules.GUIDE_FAILURES_METRIC}{{[^}}]*model="{CONTRACT_MODEL}"[^}}]*}} (\S+)$', text, re.M)
    assert match, f"{rules.GUIDE_FAILURES_METRIC} of {CONTRACT_MODEL} not exported"
    return float(match.group(1))


class GrpcStream:
    """One request on its own Triton gRPC stream: its responses' token counts, its error, when it ended."""

    def __init__(self, stack: Stack, request_id: str, options: SamplingOptions, prompt: list[int] = [1, 2, 3, 4]):
        self.client = grpcclient.InferenceServerClient(stack.triton_grpc_url)
        self.tokens = 0
        self.error: str | None = None
        self.first_tokens, self.ended = threading.Event(), threading.Event()
        self.client.start_stream(callback=self._on_response)
        self.client.async_stream_infer(CONTRACT_MODEL, build_inputs(prompt, options), request_id=request_id,
                                       outputs=[grpcclient.InferRequestedOutput(n) for n in requested_outputs(options)],
                                       enable_empty_final_response=True)

    def _on_response(self, result: Any, error: Any) -> None:
        if error is not None:
            self.error = error.message()
            self.ended.set()
            return
        lengths = result.as_numpy("sequence_length")  # none in the empty final response
        self.tokens += int(lengths.reshape(-1)[0]) if lengths is not None else 0
        if self.tokens:
            self.first_tokens.set()
        if result.get_response().parameters["triton_final_response"].bool_param:
            self.ended.set()

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def test_a_guide_that_fails_in_the_engine_fails_every_active_request(stack: Stack) -> None:
    """The double's rule, straight over gRPC (no frontend to check the guide): what a client of the GPU engine
    would see if the frontend let one bad guide through."""
    before = guide_failures(stack)
    victim = GrpcStream(stack, "victim", SamplingOptions(max_tokens=400, ignore_eos=True))
    try:
        assert victim.first_tokens.wait(60), "the victim's stream never started"
        bad = GrpcStream(stack, "bad-guide", SamplingOptions(max_tokens=8, guide=Guide("regex", "(?<=a)b")))
        try:
            assert bad.ended.wait(60) and victim.ended.wait(60)
        finally:
            bad.close()
    finally:
        victim.close()
    for stream in (bad, victim):
        assert stream.error is not None and "Executor failed process requestId" in stream.error, stream.error
        assert rules.FORWARD_ASYNC_ERROR + "Regex parsing error" in stream.error and "Lookbehind" in stream.error
    assert victim.tokens < 400, "the victim ran to its end: the batch did not fail"
    assert guide_failures(stack) == before + 1


async def test_bad_guides_are_400s_while_another_stream_runs_to_its_end(stack: Stack, contract_url: str) -> None:  # noqa: F811
    before = guide_failures(stack)
    long = {"model": stack.model, "prompt": "The lighthouse keeper", "max_tokens": LONG_STREAM_TOKENS,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    bad = [  # endpoint, body, the field the 400 names
        ("completions", {"prompt": "x", "guided_regex": "(?<=a)b"}, "guided_regex"),
        ("completions", {"prompt": "x", "guided_grammar": 'root ::= "a" undefined_rule'}, "guided_grammar"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": LOOK_BEHIND}}}, "response_format"),
        # The CPU engine's xgrammar (0.2.9) compiles this one; the GPU image's (0.1.25) does not.
        ("completions", {"prompt": "x", "guided_regex": "yes||no"}, "guided_regex"),
    ]
    async with httpx.AsyncClient(timeout=120) as client:
        started = asyncio.Event()
        stream = asyncio.create_task(read_stream(client, f"{contract_url}/completions", long, started, 3))
        await started.wait()  # the long stream is in the engine, generating
        for endpoint, body, param in bad:
            response = await client.post(f"{contract_url}/{endpoint}", json={"model": stack.model, "max_tokens": 8,
                                                                              **body})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error", error
            assert "does not compile" in error["message"]
        assert not stream.done(), "the long stream ended before the bad guides were answered"
        payloads, _ = await stream
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert not any("error" in chunk for chunk in chunks)
    assert [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]] == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == LONG_STREAM_TOKENS
    assert guide_failures(stack) == before, "a guide reached the engine and failed there"
