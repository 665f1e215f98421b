"""Bad input gets an OpenAI-shaped error with the right status, and the server keeps serving."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from launcher.ports import find_free_port
from tests.integration.conftest import Stack, start_frontend, stop_process, wait_http_ok

pytestmark = pytest.mark.integration


def assert_openai_error(response: httpx.Response, status: int, type_: str, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == type_
    if code is not None:
        assert error["code"] == code
    return error


def assert_still_serves(stack: Stack) -> None:
    response = httpx.post(f"{stack.base_url}/chat/completions", timeout=60, json={
        "model": stack.model, "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2,
        "ignore_eos": True})  # unseeded: may sample the end token
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 2


def chat(stack: Stack, **fields) -> dict:
    return {"model": stack.model, "messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.mark.parametrize("case,make_body,param", [
    ("messages is a string", lambda s: {"model": s.model, "messages": "hi"}, "messages"),
    ("messages empty", lambda s: {"model": s.model, "messages": []}, "messages"),
    ("messages missing", lambda s: {"model": s.model}, "messages"),
    ("bad role", lambda s: {"model": s.model, "messages": [{"role": "wizard", "content": "x"}]}, None),
    ("max_tokens zero", lambda s: chat(s, max_tokens=0), "max_tokens"),
    ("max_tokens a string", lambda s: chat(s, max_tokens="many"), "max_tokens"),
    ("temperature too high", lambda s: chat(s, temperature=5), "temperature"),
    ("stream_options without stream", lambda s: chat(s, stream_options={"include_usage": True}), "stream_options"),
    ("n above the limit", lambda s: chat(s, n=100), "n"),
    ("logit_bias", lambda s: chat(s, logit_bias={"5": 10}), "logit_bias"),
    ("top_logprobs without logprobs", lambda s: chat(s, top_logprobs=2), "top_logprobs"),
    ("tool without a name", lambda s: chat(s, tools=[{"type": "function", "function": {"name": "no spaces"}}]),
     "tools"),
    ("json_schema without a schema", lambda s: chat(s, response_format={"type": "json_schema"}), "response_format"),
])
def test_invalid_chat_requests_get_400(stack: Stack, case: str, make_body, param: str | None) -> None:
    response = httpx.post(f"{stack.base_url}/chat/completions", json=make_body(stack), timeout=30)
    error = assert_openai_error(response, 400, "invalid_request_error")
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error
    assert_still_serves(stack)


def test_malformed_json_gets_400(stack: Stack) -> None:
    response = httpx.post(f"{stack.base_url}/chat/completions", content=b'{"model": "x", "messages": [',
                          headers={"Content-Type": "application/json"}, timeout=30)
    error = assert_openai_error(response, 400, "invalid_request_error")
    assert "JSON" in error["message"]
    assert_still_serves(stack)


def test_unknown_model_gets_404_and_the_sdk_raises_not_found(stack: Stack) -> None:
    response = httpx.post(f"{stack.base_url}/chat/completions", json={**chat(stack), "model": "gpt-17"}, timeout=30)
    assert_openai_error(response, 404, "invalid_request_error", "model_not_found")
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="gpt-17", prompt="x", max_tokens=1)
    assert "gpt-17" in raised.value.message
    assert_still_serves(stack)


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_plus_max_tokens_over_the_context_gets_400_context_length_exceeded(stack: Stack, stream: bool) -> None:
    body = chat(stack, max_tokens=stack.context_length, stream=stream)
    response = httpx.post(f"{stack.base_url}/chat/completions", json=body, timeout=30)
    error = assert_openai_error(response, 400, "invalid_request_error", "context_length_exceeded")
    assert str(stack.context_length) in error["message"]
    long_prompt = {"model": stack.model, "prompt": "word " * (stack.context_length + 10), "stream": stream}
    response = httpx.post(f"{stack.base_url}/completions", json=long_prompt, timeout=30)
    assert_openai_error(response, 400, "invalid_request_error", "context_length_exceeded")
    assert_still_serves(stack)


def test_unknown_fields_are_ignored(stack: Stack) -> None:
    body = chat(stack, max_tokens=3, temperature=0, ignore_eos=True, some_future_field={"nested": [1, 2]},
                another=True)
    response = httpx.post(f"{stack.base_url}/chat/completions", json=body, timeout=60)
    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_unknown_route_and_wrong_method_use_the_openai_shape(stack: Stack) -> None:
    assert_openai_error(httpx.get(f"{stack.base_url}/nope", timeout=10), 404, "not_found_error")
    assert_openai_error(httpx.get(f"{stack.base_url}/chat/completions", timeout=10), 405, "invalid_request_error")


def test_completions_rejects_out_of_vocabulary_token_ids(stack: Stack) -> None:
    response = httpx.post(f"{stack.base_url}/completions", timeout=30,
                          json={"model": stack.model, "prompt": [1, 2, 10**9], "max_tokens": 2})
    assert_openai_error(response, 400, "invalid_request_error")
    assert_still_serves(stack)


def test_triton_unreachable_gets_503(stack: Stack, tmp_path: Path) -> None:
    dead_triton = f"127.0.0.1:{find_free_port()}"
    port = find_free_port()
    frontend = start_frontend(dead_triton, port, tmp_path / "frontend.log", TRITON_TIMEOUT_S="1")
    root = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{root}/health/live", 60, frontend)
        assert_openai_error(httpx.get(f"{root}/health/ready", timeout=30), 503, "server_error")
        response = httpx.post(f"{root}/v1/chat/completions", json=chat(stack), timeout=30)
        assert_openai_error(response, 503, "server_error", "service_unavailable")
        assert_openai_error(httpx.get(f"{root}/v1/models", timeout=30), 503, "server_error")
    finally:
        stop_process(frontend)
    assert_still_serves(stack)
