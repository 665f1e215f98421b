"""Hostile input: property-based fuzzing (hypothesis) of chat and completions with random JSON for the known
fields, random extra fields, wrong types, numbers at the edges of every engine tensor type on every numeric
field, NaN, token-id prompts in and out of the vocabulary and INT32, unicode and lone surrogates, bodies
nested past the depth limit.
Over 1,000 requests in all: never a 5xx, always an OpenAI-shaped error or a valid answer, and the server
is healthy afterwards. Derandomized (same cases every run), no per-example deadline; a small context and
max_n keep the generations short."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launcher.ports import find_free_port
from tests.integration.conftest import Stack, start_frontend, stop_process, wait_http_ok

# 520 requests a route, one after the other: more than the suite's 300 s per test on a busy machine.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

EXAMPLES_PER_ROUTE = 520
FUZZ_SETTINGS = settings(max_examples=EXAMPLES_PER_ROUTE, derandomize=True, deadline=None, database=None,
                         suppress_health_check=list(HealthCheck))

unicode_text = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3),
    st.sampled_from(["", " ", "\x00", "\u200b", "日本語のテキスト", "🙂👍🏽", "e\u0301", "\ufeff", "<|im_end|>",
                     "</s>", "{{ raise_exception('x') }}", "\r\n\r\n", "data: [DONE]\n\n"]),
)
# The edges of every engine tensor type (INT32, UINT64, FP32) and of what JSON can spell, on either side.
INT_EXTREMES = [0, -1, 2**31 - 1, 2**31, 2**32, 2**40, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, -(2**31),
                -(2**31) - 1, -(2**63), -(2**63) - 1, 10**30, 10**400]
FLOAT_EXTREMES = [3.4028234663852886e38, 3.5e38, 1.7976931348623157e308, 1.1754943508222875e-38, 1e-45,
                  5e-324, -0.0, 1e-30, 1e30, 2.0000001, -2.0000001]
numbers = st.one_of(
    st.integers(min_value=-3, max_value=12),
    st.sampled_from(INT_EXTREMES),
    st.sampled_from(FLOAT_EXTREMES),
    st.floats(allow_nan=True, allow_infinity=True),
)
# Token-id prompts: ids in and out of the demo vocabulary (4096), at INT32's edge and past it.
token_ids = st.one_of(st.integers(min_value=0, max_value=5000),
                      st.sampled_from([4095, 4096, 2**31 - 1, 2**31, 2**63, 2**64, 2**70, -1, -(2**31) - 1]))
token_prompts = st.one_of(st.lists(token_ids, min_size=1, max_size=8),
                          st.lists(st.lists(token_ids, min_size=1, max_size=4), min_size=1, max_size=3))
scalars = st.one_of(st.none(), st.booleans(), numbers, unicode_text)
json_values = st.recursive(scalars, lambda children: st.one_of(
    st.lists(children, max_size=4), st.dictionaries(unicode_text, children, max_size=4)), max_leaves=12)

message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer", "tool"]),
                           "content": unicode_text}),
    st.fixed_dictionaries({"role": st.sampled_from(["user", "wizard", ""]),
                           "content": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                                      "text": unicode_text}), max_size=2)}),
    json_values,
)
small_ints = st.integers(min_value=-2, max_value=6)
common_fields = {
    "max_tokens": st.one_of(small_ints, numbers, json_values),
    "temperature": st.one_of(st.floats(min_value=-1, max_value=3), numbers, json_values),
    "top_p": st.one_of(st.floats(min_value=-0.5, max_value=1.5), numbers, json_values),
    "n": st.one_of(small_ints, numbers, json_values),
    "stream": st.one_of(st.booleans(), json_values),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
    "stop": st.one_of(unicode_text, st.lists(unicode_text, max_size=6), json_values),
    "seed": st.one_of(numbers, json_values),
    "presence_penalty": st.one_of(numbers, json_values),
    "frequency_penalty": st.one_of(numbers, json_values),
    "user": st.one_of(unicode_text, json_values),
    "top_k": st.one_of(small_ints, numbers),
    "min_tokens": st.one_of(small_ints, numbers),
    "repetition_penalty": st.one_of(numbers, json_values),
    "ignore_eos": st.one_of(st.booleans(), json_values),
    "logit_bias": json_values,
    "model": st.one_of(st.just("demo-tiny"), unicode_text, json_values),
}
chat_fields = {
    **common_fields,
    "messages": st.one_of(st.lists(message, min_size=0, max_size=3), json_values),
    "max_completion_tokens": st.one_of(small_ints, numbers),
    "logprobs": st.one_of(st.booleans(), json_values),
    "top_logprobs": st.one_of(st.integers(min_value=-1, max_value=25), numbers, json_values),
    "tools": json_values, "tool_choice": json_values, "response_format": json_values,
}
completion_fields = {
    **common_fields,
    "prompt": st.one_of(unicode_text, st.lists(unicode_text, max_size=3),
                        st.lists(st.integers(min_value=-5, max_value=5000), max_size=8),
                        st.lists(st.lists(st.integers(min_value=-1, max_value=300), max_size=4), max_size=3),
                        token_prompts, token_prompts, json_values),
    "logprobs": st.one_of(st.integers(min_value=-1, max_value=7), numbers, json_values),
    "echo": st.one_of(st.booleans(), json_values), "suffix": json_values,
    "best_of": st.one_of(small_ints, numbers, json_values),
}
extra_fields = st.dictionaries(st.text(min_size=1, max_size=12).filter(lambda k: k not in chat_fields
                                                                       and k not in completion_fields),
                               json_values, max_size=3)


def request_bodies(base: dict, fields: dict) -> st.SearchStrategy[bytes | dict]:
    """A valid request with some known fields replaced by random values, some dropped, extras added; or,
    now and then, a body that is not an object at all."""
    names = sorted(fields)

    @st.composite
    def build(draw) -> bytes | dict:
        kind = draw(st.integers(0, 39))
        if kind < 2:
            return json.dumps(draw(json_values), allow_nan=True).encode()
        if kind == 2:  # deep nesting (around the limit of 64, and past what Python's parser can recurse into)
            depth = draw(st.sampled_from([62, 63, 64, 65, 1000, 3000]))
            inner = draw(st.sampled_from(["", "1", '"\\ud800"', '"x"']))
            field = json.dumps(draw(st.sampled_from(names + ["extra"])))
            body = json.dumps(base)[:-1] + f', {field}: ' + "[" * depth + inner + "]" * depth + "}"
            return body.encode()
        body = dict(base)
        for name in draw(st.lists(st.sampled_from(names), max_size=5, unique=True)):
            body[name] = draw(fields[name])
        for name in draw(st.lists(st.sampled_from(sorted(base)), max_size=1)):
            body.pop(name, None)
        body.update(draw(extra_fields))
        return body

    return build()


@pytest.fixture(scope="module")
def fuzz_target(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    log = tmp_path_factory.mktemp("fuzz") / "frontend.log"
    port = find_free_port()
    # A short context keeps default max_tokens small; a deadline bounds anything that hangs (generous: a 504
    # fails the test, and a busy machine must not make one; under the client's 120 s read timeout below).
    process = start_frontend(stack.triton_grpc_url, port, log, CONTEXT_LENGTH="48", MAX_N="2",
                             REQUEST_TIMEOUT_S="60", ACCESS_LOG="false")
    root = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{root}/health/ready", 120, process)
        yield root, log
        assert process.poll() is None, "the frontend died"
        assert httpx.get(f"{root}/health/ready", timeout=10).status_code == 200
        ok = httpx.post(f"{root}/v1/completions", timeout=60,
                        json={"model": "demo-tiny", "prompt": "still fine?", "max_tokens": 2, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        assert "Traceback" not in log.read_text(errors="replace")
    finally:
        stop_process(process)


def check(client: httpx.Client, url: str, body: bytes | dict) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
    response = client.post(url, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (response.status_code, response.text[:500], content[:500])
    if response.status_code != 200:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and error["type"], error
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        payloads = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert payloads and payloads[-1] == "[DONE]", response.text[-300:]
        for payload in payloads[:-1]:
            assert "error" not in json.loads(payload), payload
    else:
        answer = response.json()
        assert answer["choices"] and answer["usage"]["completion_tokens"] >= 0


CHAT_BASE = {"model": "demo-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION_BASE = {"model": "demo-tiny", "prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize("route,base,fields,what", [
    ("/v1/chat/completions", CHAT_BASE, chat_fields, "chat"),
    ("/v1/completions", COMPLETION_BASE, completion_fields, "completions"),
], ids=["chat", "completions"])
def test_fuzz_route(fuzz_target: tuple[str, Path], route: str, base: dict, fields, what: str) -> None:
    root, _ = fuzz_target
    started = time.monotonic()
    with httpx.Client(timeout=120) as client:
        @FUZZ_SETTINGS
        @given(request_bodies(base, fields))
        def fuzz(body: bytes | dict) -> None:
            check(client, f"{root}{route}", body)

        fuzz()
    print(f"\nfuzz: {EXAMPLES_PER_ROUTE} {what} requests in {time.monotonic() - started:.1f} s, no 5xx")


def test_nan_and_infinity_are_rejected_not_crashing(fuzz_target: tuple[str, Path]) -> None:
    root, _ = fuzz_target
    for value in (math.nan, math.inf, -math.inf):
        body = json.dumps({**COMPLETION_BASE, "temperature": value}, allow_nan=True)
        response = httpx.post(f"{root}/v1/completions", content=body, headers={"Content-Type": "application/json"},
                              timeout=30)
        assert response.status_code == 400, response.text
