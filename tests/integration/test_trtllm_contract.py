"""The core of the OpenAI surface through the TensorRT-LLM contract double (tests/trtllm_contract): the
TensorRT-LLM template rendered with the TensorRT-LLM values, served by a Python model on the CPU engine
that refuses whatever the real C++ backend refuses and shapes its responses as that backend does.

The double runs the same weights as the session's real CPU engine model, so every answer through it must
equal the answer through the plain CPU stack: greedy and seeded, streamed and not, n > 1, stop strings,
log-probabilities, usage. What differs is what TensorRT-LLM cannot do: top-log-prob alternatives are a
clear 400. And a frontend that broke the contract (no `sequence_length` asked for) is refused with the
backend's own message.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from frontend.generation.engine import SamplingOptions
from frontend.generation.trtllm_tensors import build_inputs
from tests.integration.conftest import (CONTRACT_MODEL, Stack, engine_is_idle, engine_settled, frontend_on,
                                        wait_engine, wait_until)
from tests.trtllm_contract import rules

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def contract_url(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A frontend over the contract double: its base URL (http://.../v1)."""
    with frontend_on(stack, CONTRACT_MODEL, tmp_path_factory.mktemp("trtllm_contract")) as url:
        yield url


def post(base_url: str, endpoint: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base_url}/{endpoint}", json=body, timeout=120)


def streamed(base_url: str, endpoint: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every chunk of an SSE stream, which must end with [DONE]."""
    response = post(base_url, endpoint, {**body, "stream": True})
    assert response.status_code == 200, response.text
    payloads = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    return [json.loads(payload) for payload in payloads[:-1]]


def texts_by_choice(chunks: list[dict[str, Any]], chat: bool) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            piece = (choice["delta"].get("content") or "") if chat else choice["text"]
            texts[choice["index"]] = texts.get(choice["index"], "") + piece
    return texts


def finishes_by_choice(chunks: list[dict[str, Any]]) -> dict[int, str]:
    return {c["index"]: c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]}


def comparable(body: dict[str, Any], chat: bool) -> tuple[dict[int, str], dict[int, str], dict[str, int]]:
    """A non-streamed answer as (texts, finish reasons, usage) per choice index."""
    choices = body["choices"]
    texts = {c["index"]: (c["message"]["content"] or "") if chat else c["text"] for c in choices}
    return texts, {c["index"]: c["finish_reason"] for c in choices}, body["usage"]


CHAT = {"messages": [{"role": "user", "content": "Tell me about lighthouses."}]}
COMPLETION = {"prompt": "The lighthouse keeper"}


@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7, "n": 2}],
                         ids=["greedy", "seeded-n2"])
def test_answers_equal_the_cpu_engines_streamed_or_not(stack: Stack, contract_url: str, endpoint: str,
                                                       sampling: dict[str, Any]) -> None:
    chat = endpoint == "chat/completions"
    body = {"model": stack.model, "max_tokens": 24, **sampling, **(CHAT if chat else COMPLETION)}
    reference = post(stack.base_url, endpoint, body)
    assert reference.status_code == 200, reference.text
    expected = comparable(reference.json(), chat)
    answer = post(contract_url, endpoint, body)
    assert answer.status_code == 200, answer.text
    assert comparable(answer.json(), chat) == expected
    assert len(expected[0]) == sampling.get("n", 1) and all(expected[0].values())

    chunks = streamed(contract_url, endpoint, {**body, "stream_options": {"include_usage": True}})
    assert texts_by_choice(chunks, chat) == expected[0]
    assert finishes_by_choice(chunks) == expected[1]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == expected[2]


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_answer_as_on_the_cpu_engine(stack: Stack, contract_url: str, stream: bool) -> None:
    body = {"model": stack.model, "max_tokens": 32, "temperature": 0, **COMPLETION}
    full = post(contract_url, "completions", body).json()["choices"][0]["text"]
    assert len(full) > 8
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = full[: full.index(stop)]
    stopped = {**body, "stop": [stop]}
    reference = post(stack.base_url, "completions", stopped).json()
    assert reference["choices"][0]["text"] == cut and reference["choices"][0]["finish_reason"] == "stop"
    if stream:
        chunks = streamed(contract_url, "completions", {**stopped, "stream_options": {"include_usage": True}})
        assert texts_by_choice(chunks, chat=False) == {0: cut}
        assert finishes_by_choice(chunks) == {0: "stop"}
        assert chunks[-1]["usage"] == reference["usage"]
    else:
        assert comparable(post(contract_url, "completions", stopped).json(), chat=False) == \
            comparable(reference, chat=False)


def test_sampled_token_logprobs_come_through_return_log_probs(stack: Stack, contract_url: str) -> None:
    body = {"model": stack.model, "max_tokens": 12, "temperature": 0, "logprobs": True, **CHAT}
    reference = post(stack.base_url, "chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    answer = post(contract_url, "chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in answer] == [e["token"] for e in reference] and len(answer) == 12
    assert np.allclose([e["logprob"] for e in answer], [e["logprob"] for e in reference], atol=1e-5)
    assert all(e["logprob"] <= 0 for e in answer)
    completion = post(contract_url, "completions", {"model": stack.model, "max_tokens": 6, "temperature": 0,
                                                    "logprobs": 0, **COMPLETION}).json()
    token_logprobs = completion["choices"][0]["logprobs"]["token_logprobs"]
    assert len(token_logprobs) == 6 and all(value <= 0 for value in token_logprobs)


@pytest.mark.parametrize(("endpoint", "extra", "param"), [
    ("chat/completions", {"logprobs": True, "top_logprobs": 2, **CHAT}, "top_logprobs"),
    ("completions", {"logprobs": 1, **COMPLETION}, "logprobs"),
])
def test_top_logprob_alternatives_are_a_clear_400(stack: Stack, contract_url: str, endpoint: str,
                                                  extra: dict[str, Any], param: str) -> None:
    body = {"model": stack.model, "max_tokens": 4, **extra}
    refused = post(contract_url, endpoint, body)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert "alternatives" in error["message"]
    assert post(stack.base_url, endpoint, body).status_code == 200  # the CPU engine has them


def test_a_client_that_leaves_cancels_its_engine_request(stack: Stack, contract_url: str) -> None:
    metrics = stack.triton_metrics_url
    before = engine_settled(metrics, CONTRACT_MODEL)
    body = {"model": stack.model, "prompt": "long", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{contract_url}/completions", json=body, timeout=60) as response:
        received = 0
        for line in response.iter_lines():
            received += line.startswith("data: {")
            if received == 3:  # the double steps at most every 20 ms: 400 tokens take >= 8 s
                # what the engine shows now can only be this request (its slot gauge alone could lag behind)
                wait_engine(metrics, CONTRACT_MODEL, lambda now: now["active_slots"] >= 1
                            and now["generated_tokens_total"] > before["generated_tokens_total"], "the request to run")
                break
    after = wait_engine(metrics, CONTRACT_MODEL, lambda now: engine_is_idle(now) and now["cancelled_requests_total"]
                        == before["cancelled_requests_total"] + 1, "the engine to cancel the request")
    assert after["generated_tokens_total"] - before["generated_tokens_total"] < 400, "the engine kept generating"


def test_a_request_without_sequence_length_is_refused_with_the_backends_message(stack: Stack) -> None:
    """What the frontend did before: only `output_ids` asked for. The real backend refuses it; so does
    the double, with the backend's own words."""
    client = grpcclient.InferenceServerClient(stack.triton_grpc_url)
    errors: list[InferenceServerException] = []
    results: list[Any] = []
    client.start_stream(callback=lambda result, error: errors.append(error) if error else results.append(result))
    try:
        inputs = build_inputs([1, 2, 3], SamplingOptions(max_tokens=4))
        client.async_stream_infer(CONTRACT_MODEL, inputs, request_id="no-sequence-length",
                                  outputs=[grpcclient.InferRequestedOutput("output_ids")])
        assert wait_until(lambda: bool(errors or results), 60)
    finally:
        client.stop_stream()
        client.close()
    assert not results
    assert rules.SEQUENCE_LENGTH_REQUIRED in errors[0].message()


def test_guided_decoding_through_the_backends_own_inputs(stack: Stack, contract_url: str) -> None:
    """response_format and a named tool reach the double as guided_decoding_guide_type/_guide, with the
    TensorRT-LLM config's guided decoding on (xgrammar, the tokenizer-info file the double checks)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    body = {"model": stack.model, "max_tokens": 40, "temperature": 1.0, "seed": 3, "n": 2, **CHAT,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    reference = post(stack.base_url, "chat/completions", body)
    answer = post(contract_url, "chat/completions", body)
    assert answer.status_code == 200, answer.text
    assert comparable(answer.json(), chat=True) == comparable(reference.json(), chat=True)
    for text in comparable(answer.json(), chat=True)[0].values():
        assert set(json.loads(text)) == {"n", "ok"}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    called = post(contract_url, "chat/completions", {**body, "response_format": None, "tools": [tool],
                                                     "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert called.status_code == 200, called.text
    for choice in called.json()["choices"]:
        assert choice["finish_reason"] == "tool_calls"
        assert set(json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])) == {"n", "ok"}
