"""Nothing a client sends is a 500: numbers bounded by the engine tensor they become, strings that UTF-8
can carry, bodies of bounded depth, token ids within INT32, and the engine's refusals of a request passed
on as 400s. The HTTP checks run the request models behind FastAPI and the app's own error handlers (no
edge middleware), so that they show what the schemas cover on their own."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from tritonclient.utils import InferenceServerException

from frontend.generation import triton_errors
from frontend.generation.engine import EngineRequest, SamplingOptions
from frontend.api_types.client_json import MAX_JSON_DEPTH, check_client_json
from frontend.api_types.errors import OpenAIError, install_error_handlers
from frontend.api_types.request_bodies import (INT32_MAX, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                               DetokenizeRequest, TokenizeRequest)
from frontend.generation.triton_engine import TritonEngine
from frontend.generation.triton_errors import client_message, is_client_error
from frontend.generation.trtllm_tensors import build_inputs

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/chat")
    async def chat(req: ChatCompletionRequest) -> dict[str, Any]:
        return {"ok": True}

    @app.post("/completions")
    async def completions(req: CompletionRequest) -> dict[str, Any]:
        return {"prompts": req.prompts}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        return {"ok": True}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        return {"ok": True}

    return TestClient(app, raise_server_exceptions=False)


def post(client: TestClient, path: str, body: bytes | dict) -> tuple[int, dict]:
    content = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
    response = client.post(path, content=content, headers={"Content-Type": "application/json"})
    return response.status_code, json.loads(response.content.decode("utf-8"))  # valid UTF-8 JSON, always


def assert_400(client: TestClient, path: str, body: bytes | dict, param: str | None) -> dict:
    status, answer = post(client, path, body)
    assert status == 400, (status, answer, body)
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error
    if param is not None:
        assert error["param"] == param and param in error["message"], error
    return error


# ----- numbers ---------------------------------------------------------------------------------------
INT_FIELDS = ["max_tokens", "n", "seed", "top_k", "min_tokens"]
FLOAT_FIELDS = ["temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]


OUT_OF_RANGE = [(field, value) for field in INT_FIELDS + ["max_completion_tokens", "top_logprobs"]
                for value in (2**31, 2**40, 2**63, 2**64, 2**70, 10**30, -(2**63), -1)
                if not (field == "seed" and 0 <= value < 2**63)]  # a seed below 2**63 is valid


@pytest.mark.parametrize(("field", "value"), OUT_OF_RANGE)
def test_integers_past_their_tensor_type_are_400s_naming_the_field(client: TestClient, field: str,
                                                                    value: int) -> None:
    body = {**CHAT, field: value, "logprobs": True} if field == "top_logprobs" else {**CHAT, field: value}
    assert_400(client, "/chat", body, field)
    if field not in ("max_completion_tokens", "top_logprobs"):
        assert_400(client, "/completions", {**COMPLETION, field: value}, field)


def test_integer_bounds_admit_the_largest_valid_values(client: TestClient) -> None:
    body = {**CHAT, "seed": 2**63 - 1, "top_k": INT32_MAX, "min_tokens": INT32_MAX, "max_tokens": INT32_MAX,
            "max_completion_tokens": INT32_MAX, "n": 128}
    assert post(client, "/chat", body)[0] == 200
    assert_400(client, "/chat", {**CHAT, "n": 129}, "n")
    assert_400(client, "/completions", {**COMPLETION, "logprobs": 6}, "logprobs")


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 1e300, -1e300])
def test_floats_must_be_finite_and_fit_fp32(client: TestClient, field: str, value: float) -> None:
    assert_400(client, "/chat", {**CHAT, field: value}, field)
    assert_400(client, "/completions", {**COMPLETION, field: value}, field)


def test_repetition_penalty_that_fp32_would_round_to_zero_is_refused(client: TestClient) -> None:
    assert_400(client, "/chat", {**CHAT, "repetition_penalty": 1e-300}, "repetition_penalty")
    assert post(client, "/chat", {**CHAT, "repetition_penalty": 1.3})[0] == 200


def test_numbers_json_itself_cannot_hold_are_400s(client: TestClient) -> None:
    """A 5,000-digit integer (Python refuses to parse it) and 1e999 (inf) never reach the engine."""
    assert post(client, "/chat", b'{"model": "m", "messages": [], "seed": 1' + b"0" * 5000 + b"}")[0] == 400
    assert_400(client, "/chat", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], '
                                b'"temperature": 1e999}', "temperature")


# ----- token-id prompts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", [[2**70], [1, 2**31], [-1], [[1, 2], [3, 2**63]], [[-5]], [1, 2**64, 3], [1e20],
                                    [[3.0, -2.0]]])
def test_token_ids_outside_int32_or_negative_are_400s(client: TestClient, prompt: list) -> None:
    error = assert_400(client, "/completions", {**COMPLETION, "prompt": prompt}, "prompt")
    assert "token ids" in error["message"]


def test_token_id_prompts_within_int32_pass_the_schema(client: TestClient) -> None:
    """Whether an id is in the vocabulary is the route's check (it knows the tokenizer)."""
    status, answer = post(client, "/completions", {**COMPLETION, "prompt": [[0, INT32_MAX], [5]]})
    assert status == 200 and answer["prompts"] == [[0, INT32_MAX], [5]]
    assert_400(client, "/detokenize", {"tokens": [1, 2**40]}, None)


def test_token_id_prompt_becomes_an_int32_tensor_without_overflow() -> None:
    inputs = build_inputs([0, INT32_MAX], SamplingOptions(max_tokens=INT32_MAX, top_k=INT32_MAX,
                                                          seed=2**63 - 1, min_tokens=INT32_MAX))
    assert inputs[0].name() == "input_ids"


# ----- strings: lone surrogates ---------------------------------------------------------------------------
SURROGATE = "\\ud800"  # as the JSON escape a client sends
SURROGATE_CASES = [
    ("/chat", '{"model": "m", "messages": [{"role": "user", "content": "a\\ud800"}]}', "messages.0.content"),
    ("/chat", '{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages.0.content.0.text"),
    ("/chat", '{"model": "m", "messages": [{"role": "user", "content": "x", "name": "\\udc00"}]}',
     "messages.0.name"),
    ("/chat", '{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}', "model"),
    ("/chat", '{"model": "m", "messages": [{"role": "user", "content": "x"}], "user": "\\ud800"}', "user"),
    ("/chat", '{"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": "\\ud800"}', "stop"),
    ("/chat", '{"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["ok", "\\ud800"]}',
     "stop.1"),
    ("/chat", '{"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "\\ud800"}',
     "tool_choice"),
    ("/chat", '{"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"\\ud800": 1}}',
     "logit_bias"),
    ("/chat", '{"model": "m", "messages": [{"role": "user", "content": "x"}], "unknown_extra": ["\\ud800"]}',
     "unknown_extra.0"),
    ("/completions", '{"model": "m", "prompt": "\\ud800"}', "prompt"),
    ("/completions", '{"model": "m", "prompt": ["fine", "\\udbff"]}', "prompt.1"),
    ("/completions", '{"model": "m", "prompt": "x", "suffix": "\\ud800"}', "suffix"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    ("/detokenize", '{"model": "\\ud800", "tokens": [1]}', "model"),
]


@pytest.mark.parametrize("path,body,param", SURROGATE_CASES)
def test_lone_surrogates_are_400s_naming_the_field(client: TestClient, path: str, body: str, param: str) -> None:
    error = assert_400(client, path, body.encode(), param)
    assert "surrogate" in error["message"]


def test_a_lone_surrogate_in_a_key_is_refused_without_echoing_it(client: TestClient) -> None:
    error = assert_400(client, "/chat", b'{"model": "m", "messages": [], "\\ud800": 1}', None)
    assert "surrogate" in error["message"] and error["param"] is None


def test_surrogate_pairs_and_plain_text_pass(client: TestClient) -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude42 \xe6\x97\xa5\xe6\x9c\xac"}]}'
    assert post(client, "/chat", body)[0] == 200


def test_models_built_in_python_refuse_lone_surrogates_too() -> None:
    with pytest.raises(ValueError, match="surrogate"):
        ChatMessage(role="user", content="\ud800")


# ----- depth ----------------------------------------------------------------------------------------------
def nested(depth: int, inner: str = "") -> bytes:
    return ("[" * depth + inner + "]" * depth).encode()


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH, 200, 3000, 100_000])
def test_deeply_nested_bodies_are_400s(client: TestClient, depth: int) -> None:
    for inner in ("", f'"{SURROGATE}"'):
        body = b'{"model": "m", "prompt": "x", "extra": ' + nested(depth, inner) + b"}"
        assert_400(client, "/completions", body, None)
        assert_400(client, "/completions", nested(depth, inner), None)


def test_the_surrogate_in_front_of_3000_nested_arrays_is_a_400(client: TestClient) -> None:
    """Issue 13: the middleware's re-parse of such a body was a RecursionError (500)."""
    body = b'{"model": "m", "prompt": "' + SURROGATE.encode() + b'", "x": ' + nested(3000) + b"}"
    assert_400(client, "/completions", body, None)


def test_nesting_up_to_the_limit_is_accepted(client: TestClient) -> None:
    # The body object is one level: an extra field holding MAX_JSON_DEPTH - 1 arrays makes MAX_JSON_DEPTH.
    body = b'{"model": "m", "prompt": "x", "extra": ' + nested(MAX_JSON_DEPTH - 1) + b"}"
    assert post(client, "/completions", body)[0] == 200
    deeper = b'{"model": "m", "prompt": "x", "extra": ' + nested(MAX_JSON_DEPTH) + b"}"
    assert_400(client, "/completions", deeper, "extra")


def test_check_client_json_is_iterative_and_fast_on_long_flat_lists() -> None:
    check_client_json({"prompt": list(range(200_000)), "stop": ["a"] * 1000})
    value: Any = []
    for _ in range(50_000):  # far past Python's recursion limit: only an iterative walk gets through
        value = [value]
    with pytest.raises(OpenAIError) as raised:
        check_client_json({"x": value})
    assert raised.value.status == 400 and raised.value.param == "x"


# ----- engine errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("message", [
    "input_ids holds token id 5000, outside the vocabulary [0, 4096)",
    "prompt length (600) + request_output_len (10) exceeds the engine's max_seq_len (512)",
    "input_ids is empty: the prompt needs at least one token",
    "request_output_len must be at least 1, got 0",
])
def test_engine_refusals_of_a_request_are_client_errors(message: str) -> None:
    assert is_client_error(InferenceServerException(msg=message))


@pytest.mark.parametrize("message,status", [
    ("the engine failed and cannot serve requests (RuntimeError: boom)", None),
    ("the engine has failed and accepts no requests (RuntimeError: boom)", None),
    ("injected failure", None),
    ("Socket closed", "StatusCode.INTERNAL"),
])
def test_engine_failures_are_not_client_errors(message: str, status: str | None) -> None:
    assert not is_client_error(InferenceServerException(msg=message, status=status))


def test_triton_invalid_argument_status_is_a_client_error() -> None:
    assert is_client_error(InferenceServerException(msg="unexpected shape for input 'x'",
                                                    status="StatusCode.INVALID_ARGUMENT"))


def test_client_messages_carry_no_grpc_debug_details() -> None:
    text = client_message("bad thing\n debug_error_string = {created_time: ..., peer: ipv4:10.0.0.5:8001}")
    assert text == "bad thing" and "10.0.0.5" not in text
    assert len(client_message("x" * 10_000)) <= triton_errors.MAX_ENGINE_MESSAGE
    assert client_message(None) == "no details"


class FakeStreamClient:
    """Stands in for the Triton gRPC client: the stream answers with one error response."""

    def __init__(self, error: InferenceServerException):
        self.error = error

    def stream_infer(self, requests: Any) -> "FakeCall":
        return FakeCall(self.error)

    async def close(self) -> None:
        pass


class FakeCall:
    def __init__(self, error: InferenceServerException):
        self.error = error

    def __aiter__(self) -> AsyncIterator[tuple[None, InferenceServerException]]:
        async def responses() -> AsyncIterator[tuple[None, InferenceServerException]]:
            yield None, self.error
        return responses()

    def cancel(self) -> None:
        pass


@pytest.mark.parametrize("message,status", [
    ("input_ids holds token id 9999, outside the vocabulary [0, 4096)", 400),
    ("prompt length (600) + request_output_len (10) exceeds the engine's max_seq_len (512)", 400),
    ("the engine failed and cannot serve requests (RuntimeError: boom)", 500),
])
async def test_engine_error_responses_map_to_400_or_500(message: str, status: int) -> None:
    engine = TritonEngine("127.0.0.1:1", "tensorrt_llm")
    await engine.close()
    engine._client = FakeStreamClient(InferenceServerException(msg=message))  # type: ignore[assignment]
    request = EngineRequest("r1", [1, 2, 3], SamplingOptions(max_tokens=2))
    with pytest.raises(OpenAIError) as raised:
        async for _ in engine.generate(request):
            pass
    error = raised.value
    assert error.status == status and message in error.message
    assert "127.0.0.1:1" not in error.message
    assert error.type == ("invalid_request_error" if status == 400 else "server_error")


def test_a_dead_engine_quoting_a_client_error_is_still_a_failure() -> None:
    error = InferenceServerException(msg="the engine failed and cannot serve requests (RequestError: input_ids "
                                         "holds token id 9, outside the vocabulary [0, 4))")
    assert not is_client_error(error)
