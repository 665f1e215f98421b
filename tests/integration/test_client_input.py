"""Issue 13 against the real stack: nothing a client sends is a 500. Numbers past the engine's tensor types,
token ids past the vocabulary or INT32, a lone surrogate in front of thousands of nested arrays, and a
request the engine itself refuses all get a 400 in the OpenAI shape, and the server keeps serving."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from launcher.ports import find_free_port
from tests.integration.conftest import Stack, start_frontend, stop_process, wait_http_ok

pytestmark = pytest.mark.integration

VOCAB_SIZE = 4096  # the demo tiny model's (build_engine/demo_checkpoint.py); its tokenizer has as many


def post(url: str, body: bytes | dict) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url, content=content, headers={"Content-Type": "application/json"}, timeout=60)


def assert_400(response: httpx.Response, param: str | None = None) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_still_serves(root: str, model: str) -> None:
    response = post(f"{root}/v1/completions", {"model": model, "prompt": "still there?", "max_tokens": 2,
                                                "ignore_eos": True})  # unseeded: may sample the end token
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2, response.text


@pytest.mark.parametrize("field,value", [("top_k", 2**63), ("top_k", 2**40), ("seed", 2**64), ("seed", -1),
                                         ("max_tokens", 2**40), ("min_tokens", 2**31), ("n", 10**30)])
def test_numbers_past_the_engine_tensor_types_are_400s(stack: Stack, field: str, value: int) -> None:
    chat = {"model": stack.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    error = assert_400(post(f"{stack.base_url}/chat/completions", chat), field)
    assert field in error["message"]
    completion = {"model": stack.model, "prompt": "hi", "max_tokens": 2, field: value}
    assert_400(post(f"{stack.base_url}/completions", completion), field)
    assert_still_serves(stack.root_url, stack.model)


def test_nan_and_infinity_in_any_float_field_are_400s(stack: Stack) -> None:
    for field in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        for value in ("NaN", "Infinity", "-Infinity", "1e999"):
            body = f'{{"model": "{stack.model}", "prompt": "hi", "max_tokens": 2, "{field}": {value}}}'.encode()
            assert_400(post(f"{stack.base_url}/completions", body), field)


def test_a_lone_surrogate_in_front_of_3000_nested_arrays_is_a_400(stack: Stack) -> None:
    """Once a RecursionError (500) in the edge middleware's re-parse of the body."""
    nested = "[" * 3000 + "]" * 3000
    for prompt in ('"\\ud800"', '"fine"'):
        body = f'{{"model": "{stack.model}", "prompt": {prompt}, "max_tokens": 2, "x": {nested}}}'.encode()
        error = assert_400(post(f"{stack.base_url}/completions", body))
        assert "Traceback" not in error["message"] and "Recursion" not in error["message"]
    chat = (f'{{"model": "{stack.model}", "messages": [{{"role": "user", "content": "\\ud800"}}], '
            f'"x": {nested}}}').encode()
    assert_400(post(f"{stack.base_url}/chat/completions", chat))
    assert_still_serves(stack.root_url, stack.model)


def test_nesting_past_the_depth_limit_is_a_400_even_where_json_parses_it(stack: Stack) -> None:
    body = f'{{"model": "{stack.model}", "prompt": "hi", "max_tokens": 2, "x": {"[" * 100 + "]" * 100}}}'
    error = assert_400(post(f"{stack.base_url}/completions", body.encode()), "x")
    assert "nested" in error["message"]


def test_a_lone_surrogate_is_a_400_naming_the_field(stack: Stack) -> None:
    body = (f'{{"model": "{stack.model}", "messages": [{{"role": "user", "content": "ok"}}, '
            f'{{"role": "user", "content": [{{"type": "text", "text": "a\\udfff"}}]}}]}}').encode()
    error = assert_400(post(f"{stack.base_url}/chat/completions", body), "messages.1.content.0.text")
    assert "surrogate" in error["message"]


@pytest.mark.parametrize("prompt", [[1, VOCAB_SIZE], [VOCAB_SIZE + 1000], [[5, 6], [2**31 - 1]], [2**70],
                                    [2**63], [-1], [[1, -7]]])
def test_token_ids_outside_the_vocabulary_or_int32_are_400s(stack: Stack, prompt: list) -> None:
    """The demo model's embedding has exactly as many rows as its tokenizer has tokens, so no id is known
    to one and not the other: an id at or past 4096 is refused by the frontend before the engine."""
    response = post(f"{stack.base_url}/completions", {"model": stack.model, "prompt": prompt, "max_tokens": 2})
    assert_400(response, "prompt")
    assert_still_serves(stack.root_url, stack.model)


@pytest.fixture(scope="module")
def oversized_context(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A frontend told a context length (4096) larger than the engine's max_seq_len (512): its own
    context check lets long prompts through, so that the engine's refusal is what answers."""
    log = tmp_path_factory.mktemp("client-input") / "frontend.log"
    port = find_free_port()
    process = start_frontend(stack.triton_grpc_url, port, log, CONTEXT_LENGTH="4096", ACCESS_LOG="false")
    root = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{root}/health/ready", 120, process)
        yield root
        assert process.poll() is None, "the frontend died"
        assert "Traceback" not in Path(log).read_text(errors="replace")
    finally:
        stop_process(process)


def test_a_request_the_engine_refuses_is_a_400_with_the_engines_reason(stack: Stack, oversized_context: str) -> None:
    prompt = [7] * 600  # 600 + 10 tokens: within the frontend's 4096, past the engine's 512
    for stream in (False, True):
        response = post(f"{oversized_context}/v1/completions",
                        {"model": stack.model, "prompt": prompt, "max_tokens": 10, "stream": stream})
        error = assert_400(response)
        assert "max_seq_len" in error["message"], error
        assert stack.triton_grpc_url not in error["message"] and "127.0.0.1" not in error["message"]
    assert_still_serves(oversized_context, stack.model)
