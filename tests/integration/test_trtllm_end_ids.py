"""End ids on the TensorRT-LLM path, through the contract double (audit round 3: B1, R1, R6).

- A guided request with end_id -1 (what `ignore_eos` used to send) fails EVERY active request once its document
  is complete (rules.GUIDE_WITHOUT_END_ID_SOURCE); the frontend keeps the end id under a guide
  (frontend/planning/sampling.py), so chat `response_format`, completions `guided_regex` and a Responses
  `text.format` with `ignore_eos` get answers that end, while another client's stream runs to its end.
- min_tokens with end_id -1 makes upstream write out of bounds: the double refuses it, and the frontend never
  sends it.
- The executor's errors carry a source path and a stack trace (rules.tllm_error): a client body never does.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from tritonclient.utils import InferenceServerException

from frontend.generation.engine import Guide, SamplingOptions
from frontend.generation.triton_errors import error_for
from tests.integration.conftest import CONTRACT_MODEL, Stack, read_stream
from tests.integration.test_trtllm_contract import contract_url  # noqa: F401 (a fixture: this module's own frontend)
from tests.integration.test_trtllm_guides import GrpcStream
from tests.trtllm_contract import rules

pytestmark = pytest.mark.integration

LONG_STREAM_TOKENS = 200  # the double steps at most every 20 ms: >= 4 s, while the guided answers take a few steps
CONST_SCHEMA = {"type": "object", "properties": {"answer": {"const": "yes"}, "mood": {"enum": ["calm", "busy"]}},
                "required": ["answer", "mood"], "additionalProperties": False}


def test_a_guided_request_with_end_id_minus_1_fails_every_active_request(stack: Stack) -> None:
    """The double's rule straight over gRPC (no frontend to keep the end id): what a GPU would do."""
    victim = GrpcStream(stack, "b1-victim", SamplingOptions(max_tokens=400, ignore_eos=True))
    try:
        assert victim.first_tokens.wait(60), "the victim's stream never started"
        guided = GrpcStream(stack, "b1-guided", SamplingOptions(max_tokens=16, ignore_eos=True, eos_token_id=2,
                                                                guide=Guide("regex", "ab")))
        try:
            assert guided.ended.wait(60) and victim.ended.wait(60)
        finally:
            guided.close()
    finally:
        victim.close()
    for stream in (guided, victim):
        assert stream.error is not None and rules.FORWARD_ASYNC_ERROR + rules.STOP_TOKEN_ACCEPTED in stream.error, \
            stream.error
    assert victim.tokens < 400, "the victim ran to its end: the batch did not fail"
    assert "'b1-guided': " + rules.GUIDED_WITHOUT_END_ID_LOG in stack.triton_log.read_text()


@pytest.mark.parametrize("options, refusal", [
    (SamplingOptions(max_tokens=4, ignore_eos=True, min_tokens=3),
     rules.MIN_TOKENS_WITHOUT_END_ID.format(min_tokens=3)),
    (SamplingOptions(max_tokens=4, top_k=1025), rules.TOP_K_CLIPPED.format(top_k=1025)),
], ids=["min_tokens-without-end-id", "top_k-above-1024"])
def test_the_double_refuses_what_upstream_would_corrupt_or_clip(stack: Stack, options: SamplingOptions,
                                                                refusal: str) -> None:
    stream = GrpcStream(stack, "r1-r4", options)
    try:
        assert stream.ended.wait(60)
    finally:
        stream.close()
    assert stream.error == refusal


def test_an_executor_error_reaches_the_client_without_its_path_or_trace(stack: Stack) -> None:
    """The double's TLLM_THROW-shaped error (a prompt past max_input_len, which only a raw client can send:
    the frontend refuses it first), as the frontend would turn it into a client body."""
    stream = GrpcStream(stack, "r6", SamplingOptions(max_tokens=1), prompt=[5] * stack.context_length)
    try:
        assert stream.ended.wait(60)
    finally:
        stream.close()
    assert stream.error is not None and "Prompt length (512) exceeds maximum input length (511)" in stream.error
    assert " (/" in stream.error and "throwRuntimeError" in stream.error  # what the engine says
    body = error_for(InferenceServerException(msg=stream.error), CONTRACT_MODEL).body()
    text = json.dumps(body)
    assert "Prompt length (512) exceeds maximum input length (511)" in text
    for leak in ("(/", "llmRequest.cpp", "throwRuntimeError", "0x7f", "\\n"):
        assert leak not in text, text


async def test_ignore_eos_with_a_guide_ends_while_another_stream_runs_untouched(stack: Stack,
                                                                              contract_url: str) -> None:  # noqa: F811
    log_before = stack.triton_log.read_text()
    long = {"model": stack.model, "prompt": "The lighthouse keeper", "max_tokens": LONG_STREAM_TOKENS,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    json_schema = {"name": "x", "schema": CONST_SCHEMA, "strict": True}
    guided = [  # endpoint, body, where the answer's end is read
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": json_schema}}),
        ("completions", {"prompt": "x", "guided_regex": "(yes|no)"}),
        ("responses", {"input": "x", "max_output_tokens": 60,
                       "text": {"format": {"type": "json_schema", **json_schema}}}),
        ("completions", {"prompt": "x", "min_tokens": 5, "max_tokens": 8}),  # R1: min_tokens with ignore_eos
    ]
    async with httpx.AsyncClient(timeout=120) as client:
        started = asyncio.Event()
        stream = asyncio.create_task(read_stream(client, f"{contract_url}/completions", long, started, 3))
        await started.wait()  # the long stream is in the engine, generating
        for endpoint, body in guided:
            response = await client.post(f"{contract_url}/{endpoint}", json={
                "model": stack.model, "max_tokens": 60, "temperature": 0, "ignore_eos": True, **body})
            assert response.status_code == 200, (endpoint, response.text)
            answer = response.json()
            if endpoint == "responses":
                assert answer["status"] == "completed", answer
                assert json.loads(answer["output"][-1]["content"][0]["text"])["answer"] == "yes"
            elif "min_tokens" in body:
                assert answer["choices"][0]["finish_reason"] == "length"
                assert answer["usage"]["completion_tokens"] == 8
            else:
                assert answer["choices"][0]["finish_reason"] == "stop", answer  # the document ended it
        assert not stream.done(), "the long stream ended before the guided answers"
        payloads, _ = await stream
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert not any("error" in chunk for chunk in chunks)
    assert [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]] == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == LONG_STREAM_TOKENS
    new_log = stack.triton_log.read_text()[len(log_before):]
    assert rules.GUIDED_WITHOUT_END_ID_LOG not in new_log
    assert "min_tokens" not in new_log or "with end_id -1" not in new_log
