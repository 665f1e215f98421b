"""Token-id prompts cost no per-id work on the event loop: a large body is parsed in a worker thread that
yields the GIL, and /v1/completions refuses prompts by their lengths alone (too many, longer than the
context or MAX_PROMPT_TOKENS) before pydantic validates the body id by id. Run on the real routes and edge
middleware, with a stand-in for the model registry (no Triton)."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from frontend.http import json_body, routes

from frontend.api_types import request_bodies
from frontend.api_types.errors import OpenAIError, install_error_handlers
from frontend.http.middleware import Edge, EdgeMiddleware
from frontend.models.registry import ModelContext
from frontend.api_types.request_bodies import raw_prompts
from frontend.settings import Settings

CONTEXT_LENGTH = 512
VOCAB = 8  # the route's vocabulary check answers a prompt that fits: no engine needed


class FakeModels:
    """The registry as the pre-validation check sees it: one model, `m`, with a 512-token context."""

    async def get(self, model: str | None = None) -> ModelContext:
        if model not in (None, "m"):
            raise OpenAIError(404, f"The model '{model}' does not exist", "invalid_request_error", "model",
                              "model_not_found")
        return ModelContext("m", CONTEXT_LENGTH, SimpleNamespace(vocab_size=VOCAB), 0)  # type: ignore[arg-type]

    async def all(self) -> list[ModelContext]:
        return [await self.get()]


@pytest.fixture
def client() -> TestClient:
    settings = Settings(max_prompt_tokens=0)
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(routes.router)
    app.add_middleware(EdgeMiddleware, edge=Edge(settings))
    app.state.settings, app.state.models = settings, FakeModels()
    return TestClient(app)


@pytest.fixture
def validated(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Bodies that reached pydantic's validation (its first step, the whole-body check)."""
    seen: list[Any] = []
    check = request_bodies.check_client_json
    monkeypatch.setattr(request_bodies, "check_client_json",
                        lambda value, *args: (seen.append(value), check(value, *args)))
    return seen


def post(client: TestClient, body: dict) -> tuple[int, dict]:
    response = client.post("/v1/completions", content=json.dumps(body, separators=(",", ":")).encode(),
                           headers={"Content-Type": "application/json"})
    return response.status_code, response.json()


def test_a_token_prompt_longer_than_the_context_is_refused_before_validation(client: TestClient,
                                                                             validated: list[Any]) -> None:
    status, answer = post(client, {"model": "m", "prompt": [7] * 1_000_000, "max_tokens": 1})
    assert status == 400, answer
    error = answer["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "prompt",
                                                              "context_length_exceeded")
    assert "1000000 tokens" in error["message"] and f"{CONTEXT_LENGTH} tokens" in error["message"]
    assert not validated
    # one of several prompts; and a model this server does not serve is held to the longest served context
    assert post(client, {"model": "m", "prompt": [[1], [2] * CONTEXT_LENGTH]})[1]["error"]["code"] == \
        "context_length_exceeded"
    assert post(client, {"model": "other", "prompt": [2] * 100_000})[1]["error"]["code"] == "context_length_exceeded"
    assert not validated


def test_too_many_prompts_are_refused_before_validation(client: TestClient, validated: list[Any]) -> None:
    status, answer = post(client, {"model": "m", "prompt": [[1]] * 100_000})
    assert status == 400 and answer["error"]["code"] == "too_many_generations", answer
    assert "100000" in answer["error"]["message"]
    status, answer = post(client, {"model": "m", "prompt": ["a"] * 9, "n": 2})
    assert status == 400 and answer["error"]["code"] == "too_many_generations" and "18" in answer["error"]["message"]
    assert not validated


def test_max_prompt_tokens_is_checked_before_validation_too(client: TestClient, validated: list[Any]) -> None:
    client.app.state.settings = Settings(max_prompt_tokens=100)  # type: ignore[attr-defined]
    status, answer = post(client, {"model": "m", "prompt": [3] * 101})
    assert status == 400 and answer["error"]["code"] == "prompt_too_long", answer
    assert not validated


def test_prompts_that_may_fit_are_validated_as_before(client: TestClient, validated: list[Any]) -> None:
    """Past the length check the body is validated as always (here: an id outside INT32, a 400 naming it)."""
    status, answer = post(client, {"model": "m", "prompt": [1, 2, 2**40], "max_tokens": 1})
    assert status == 400 and answer["error"]["message"].startswith("prompt.2: token ids"), answer
    assert validated
    status, answer = post(client, {"model": "m", "prompt": [[1] * 600, "text"], "max_tokens": 1})
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"


def test_large_bodies_are_parsed_in_the_parser_thread_and_small_ones_at_once(
        client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    parse = json_body.parse_json
    monkeypatch.setattr(json_body, "parse_json", lambda body: (threads.append(threading.current_thread().name),
                                                               parse(body))[1])
    assert post(client, {"model": "m", "prompt": [5] * 100_000})[1]["error"]["code"] == "context_length_exceeded"
    assert len(threads) == 1 and threads[0].startswith("json-body")  # the one parser thread
    status, answer = post(client, {"model": "m", "prompt": [5] * 10 + [VOCAB]})
    assert status == 400 and f"[0, {VOCAB})" in answer["error"]["message"]
    assert len(threads) == 1


@pytest.mark.parametrize("text", ['{"a": [1, -2, 3.5, 1e999, -0.0, 12345678901234567890], "b": [true, null, "x"]}',
                                  "[]", "3", '"s"', '{"n": NaN, "i": -Infinity}'])
def test_the_off_loop_parse_gives_what_json_loads_gives(text: str) -> None:
    assert repr(json_body.parse_json(text.encode())) == repr(json.loads(text))


@pytest.mark.parametrize("text", ["{", '{"a": 1' + "0" * 5000 + "}", '{"a": [1,]}'])
def test_the_off_loop_parse_fails_as_json_loads_does(text: str) -> None:
    with pytest.raises(ValueError) as expected:
        json.loads(text)
    with pytest.raises(type(expected.value)):
        json_body.parse_json(text.encode())


@pytest.mark.parametrize(("body", "prompts"), [
    ({"prompt": [1, 2, 3]}, [[1, 2, 3]]),
    ({"prompt": [[1, 2], [3]]}, [[1, 2], [3]]),
    ({"prompt": ["a", "b"]}, ["a", "b"]),
    ({"prompt": "text"}, []),
    ({"prompt": []}, []),
    ({}, []),
    ([1, 2], []),
])
def test_raw_prompts_tell_the_shapes_apart_by_the_first_item(body: Any, prompts: list) -> None:
    assert raw_prompts(body) == prompts


def post_to(client: TestClient, route: str, body: Any) -> tuple[int, dict]:
    response = client.post(route, content=json.dumps(body, separators=(",", ":")).encode(),
                           headers={"Content-Type": "application/json"})
    return response.status_code, response.json()


@pytest.mark.parametrize(("route", "field", "item", "limit"), [
    ("/v1/chat/completions", "messages", {"role": "user", "content": "x"}, "max_messages"),
    ("/tokenize", "messages", {"role": "user", "content": "x"}, "max_messages"),
    ("/v1/chat/completions", "tools", {"type": "function", "function": {"name": "f"}}, "max_tools"),
])
def test_too_many_items_are_refused_before_validation_naming_the_field(
        client: TestClient, validated: list[Any], route: str, field: str, item: dict, limit: str) -> None:
    """110k one-character messages (a 3.7 MB body) cost seconds of validation on the event loop: counted first."""
    most = getattr(client.app.state.settings, limit)  # type: ignore[attr-defined]
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], field: [item] * (most + 1)}
    status, answer = post_to(client, route, body)
    assert status == 400, answer
    error = answer["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", field, "array_above_max_length")
    assert f"at most {most}" in error["message"] and str(most + 1) in error["message"]
    assert not validated
    big = {"model": "m", "messages": [{"role": "user", "content": "x"}] * 110_000}
    assert post_to(client, "/v1/chat/completions", big)[1]["error"]["param"] == "messages"
    assert not validated


def test_responses_input_items_are_counted_before_validation(validated: list[Any]) -> None:
    from frontend.http import responses_routes

    settings = Settings(max_input_items=3)
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(responses_routes.router)
    app.add_middleware(EdgeMiddleware, edge=Edge(settings))
    app.state.settings = settings
    status, answer = post_to(TestClient(app), "/v1/responses",
                             {"model": "m", "input": [{"role": "user", "content": "x"}] * 4})
    assert status == 400 and answer["error"]["param"] == "input", answer
    assert not validated


def test_a_body_of_small_objects_and_no_numbers_is_parsed_yielding_the_gil(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[int] = []
    make = json_body._object
    monkeypatch.setattr(json_body, "_object", lambda pairs: (made.append(1), make(pairs))[1])
    text = json.dumps({"messages": [{"role": "user", "content": "x"}] * 3})
    assert json_body.parse_json(text.encode()) == json.loads(text)
    assert len(made) == 4  # every object through the Python-level hook, where the interpreter may switch threads
