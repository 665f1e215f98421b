"""TensorRT-LLM's sampler and executor queue, as the contract double learnt them (tests/trtllm_contract/rules.py
SAMPLER_SOURCES): seeds, log-probs and a full queue, at the engine's gRPC interface and through the frontend.

Two doubles: the session's (`tensorrt_llm_contract`: the template as rendered for TensorRT-LLM, so
normalize_log_probs false, no queue bound), and one rendered here with upstream's default normalize_log_probs
(true) and a queue bound of QUEUE (dynamic_batching max_queue_size, which upstream hands the executor),
loaded into the session's Triton for this module only.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import pytest

from frontend.generation.engine import SamplingOptions
from frontend.generation.trtllm_tensors import build_inputs, requested_outputs
from tests.integration.conftest import CONTRACT_MODEL, Stack, engine_settled, frontend_on, wait_engine
from tests.integration.test_triton_grpc import stream_once
from tests.integration.test_trtllm_contract import contract_url, post  # noqa: F401 (a fixture)
from tests.trtllm_contract import rules
from tests.trtllm_contract.double import add_contract_double

pytestmark = pytest.mark.integration

ENGINE_MODEL = "tensorrt_llm"  # the session's CPU engine model: the same weights as the doubles
DEFAULTS_MODEL = "tensorrt_llm_contract_defaults"
QUEUE = 2  # the defaults double's max_queue_size
BATCH = 8  # the session engine's max_batch_size (conftest built_engine)
PROMPT = [5, 6, 7, 8, 9]
CHAT = {"messages": [{"role": "user", "content": "Tell me about lighthouses."}]}


@pytest.fixture(scope="module")
def defaults_model(stack: Stack, built_engine: Path) -> Iterator[str]:
    """The double with upstream's default normalize_log_probs and a queue of QUEUE, loaded into the session's
    Triton (explicit model control) for this module; unloaded after it."""
    add_contract_double(stack.repository, DEFAULTS_MODEL, built_engine / "engine",
                        parameters={"normalize_log_probs": "true"}, max_queue_size=QUEUE, test_step_delay_s=0.05)
    triton = f"{stack.triton_http_url}/v2/repository/models/{DEFAULTS_MODEL}"
    httpx.post(f"{triton}/load", headers=stack.triton_control, timeout=300).raise_for_status()
    try:
        yield DEFAULTS_MODEL
    finally:
        httpx.post(f"{triton}/unload", headers=stack.triton_control, timeout=60)


@pytest.fixture(scope="module")
def defaults_url(stack: Stack, defaults_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with frontend_on(stack, defaults_model, tmp_path_factory.mktemp("trtllm_defaults")) as url:
        yield url


def generate(stack: Stack, model: str, **options: Any) -> tuple[list[int], list[float] | None, list[str]]:
    """One engine request as the frontend sends it (build_inputs): its tokens, their log-probs (each response's
    new tokens' are its last output_log_probs, as the frontend reads them: TensorRT-LLM sends every token's so
    far, the CPU engine the new ones') and its errors."""
    sampling = SamplingOptions(**{"max_tokens": 12, "ignore_eos": True, **options})
    responses, errors = stream_once(stack.triton_grpc_url, model, build_inputs(PROMPT, sampling),
                                    outputs=requested_outputs(sampling))
    tokens: list[int] = []
    log_probs: list[float] | None = None
    for response in responses:
        ids, lengths = response.as_numpy("output_ids"), response.as_numpy("sequence_length")
        new = ids.reshape(-1)[: int(lengths.reshape(-1)[0])].tolist() if ids is not None else []
        tokens += new
        values = response.as_numpy("output_log_probs")
        if values is not None:
            log_probs = (log_probs or []) + rules.new_log_probs(values, len(new)).tolist()
    return tokens, log_probs, errors


# ----- seeds -------------------------------------------------------------------------------------------------
def test_unseeded_requests_to_the_double_are_seeded_with_0(stack: Stack) -> None:
    """TensorRT-LLM #1000/#2411: no seed input is seed 0, so two unseeded samples of a prompt are the same (the
    CPU engine alone draws a random seed each time)."""
    first, _, errors = generate(stack, CONTRACT_MODEL, temperature=1.0, seed=None, max_tokens=16)
    second, _, more = generate(stack, CONTRACT_MODEL, temperature=1.0, seed=None, max_tokens=16)
    assert not errors and not more and len(first) == 16
    assert first == second
    assert generate(stack, CONTRACT_MODEL, temperature=1.0, seed=0, max_tokens=16)[0] == first
    assert generate(stack, ENGINE_MODEL, temperature=1.0, seed=0, max_tokens=16)[0] == first  # the same draw


def test_unseeded_choices_differ_and_seeded_requests_repeat_through_the_frontend(stack: Stack,
                                                                                 contract_url: str) -> None:
    """The frontend gives every choice a seed (random when the client gives none): against a backend that
    seeds unseeded requests with 0, n > 1 and repeated requests still differ; a seeded request repeats."""
    body = {"model": stack.model, "max_tokens": 24, "temperature": 1.0, "ignore_eos": True, **CHAT}

    def texts(answer: httpx.Response) -> list[str]:
        assert answer.status_code == 200, answer.text
        return [choice["message"]["content"] for choice in answer.json()["choices"]]

    two = texts(post(contract_url, "chat/completions", {**body, "n": 2}))
    assert len(two) == 2 and two[0] != two[1]
    assert texts(post(contract_url, "chat/completions", body)) != texts(post(contract_url, "chat/completions", body))
    seeded = {**body, "seed": 11}
    assert texts(post(contract_url, "chat/completions", seeded)) == texts(post(contract_url, "chat/completions", seeded))


# ----- log-probs ---------------------------------------------------------------------------------------------
def test_with_normalize_log_probs_on_greedy_log_probs_are_all_zero(stack: Stack, defaults_model: str) -> None:
    """Upstream's default (normalize_log_probs true): the top-k kernel renormalises over the top k, so a greedy
    request (temperature 0: top_k 1) gets 0.0 for every token (tensorrtllm_backend #276, TensorRT-LLM #2406);
    the top-p path (top_k 0) never renormalises: the model's own log-probs there."""
    tokens, zeros, errors = generate(stack, defaults_model, temperature=0.0, logprobs=True)
    reference, model_values, _ = generate(stack, ENGINE_MODEL, temperature=0.0, logprobs=True)
    assert not errors and tokens == reference and len(tokens) == 12
    assert zeros == [0.0] * 12 and min(model_values) < 0
    sampled, values, errors = generate(stack, defaults_model, temperature=1.0, seed=5, logprobs=True)
    reference, expected, _ = generate(stack, ENGINE_MODEL, temperature=1.0, seed=5, logprobs=True)
    assert not errors and sampled == reference
    assert np.allclose(values, expected, atol=1e-5) and min(values) < 0


def test_with_normalize_log_probs_off_they_are_the_models_own(stack: Stack) -> None:
    """The template's setting (values/trtllm.json: false): the full-vocabulary log-softmax, which is the model's
    own log-prob at temperature 0 or 1 without penalties: what the CPU engine reports."""
    for options in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 5}, {"temperature": 1.0, "seed": 5,
                                                                             "top_k": 4, "top_p": 0.8}):
        tokens, values, errors = generate(stack, CONTRACT_MODEL, logprobs=True, **options)
        reference, expected, _ = generate(stack, ENGINE_MODEL, logprobs=True, **options)
        assert not errors and tokens == reference, options
        assert np.allclose(values, expected, atol=1e-5) and min(values) < 0, options


@pytest.mark.parametrize("options", [{"temperature": 0.7, "seed": 5}, {"temperature": 0.0, "presence_penalty": 0.5},
                                     # min_tokens needs an end id (rules.MIN_TOKENS_WITHOUT_END_ID): seeded, so
                                     # whether id 0 ends it early is fixed
                                     {"temperature": 1.0, "seed": 5, "min_tokens": 3, "ignore_eos": False,
                                      "eos_token_id": 0}])
def test_log_probs_the_double_cannot_reproduce_are_refused(stack: Stack, options: dict[str, Any]) -> None:
    """Upstream reports log-probs after temperature and penalties there; the double does not make up numbers."""
    _, _, errors = generate(stack, CONTRACT_MODEL, logprobs=True, **options)
    assert len(errors) == 1 and rules.DOUBLE in errors[0] and "output_log_probs" in errors[0]
    tokens, values, errors = generate(stack, CONTRACT_MODEL, **options)  # without log-probs: served
    assert not errors and len(tokens) == 12 and values is None


@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 9, "top_p": 0.9}],
                         ids=["greedy", "seeded"])
def test_logprobs_are_the_same_numbers_on_both_engines(stack: Stack, contract_url: str, endpoint: str,
                                                       sampling: dict[str, Any]) -> None:
    chat = endpoint == "chat/completions"
    body = {"model": stack.model, "max_tokens": 10, **sampling,
            **({"logprobs": True, **CHAT} if chat else {"logprobs": 0, "prompt": "The lighthouse keeper"})}

    def logprobs(answer: httpx.Response) -> list[float]:
        assert answer.status_code == 200, answer.text
        found = answer.json()["choices"][0]["logprobs"]
        return [entry["logprob"] for entry in found["content"]] if chat else found["token_logprobs"]

    expected = logprobs(post(stack.base_url, endpoint, body))
    assert len(expected) == 10 and min(expected) < 0
    assert np.allclose(logprobs(post(contract_url, endpoint, body)), expected, atol=1e-5)


def test_logprobs_that_would_mean_something_else_are_a_400_on_tensorrt_llm(stack: Stack, contract_url: str,
                                                                            defaults_url: str) -> None:
    body = {"model": stack.model, "max_tokens": 4, "temperature": 0.7, "logprobs": True, **CHAT}
    assert post(stack.base_url, "chat/completions", body).status_code == 200  # the CPU engine: the model's own
    for url, request in ((contract_url, body), (defaults_url, {**body, "temperature": 0})):
        refused = post(url, "chat/completions", request)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "logprobs" and error["type"] == "invalid_request_error"
    assert post(contract_url, "chat/completions", {**body, "temperature": 0}).status_code == 200
    # min_tokens masks the end id, unless the engine gets none: ignore_eos sends min_tokens 0 (planning/sampling.py),
    # except under a guide, which keeps the end id and so min_tokens.
    greedy = {**body, "temperature": 0, "min_tokens": 3}
    assert post(contract_url, "chat/completions", greedy).status_code == 400
    assert post(contract_url, "chat/completions", {**greedy, "ignore_eos": True}).status_code == 200
    guided = {**greedy, "ignore_eos": True, "response_format": {"type": "json_object"}}
    assert post(contract_url, "chat/completions", guided).status_code == 400
    completion = {"model": stack.model, "prompt": "The lighthouse keeper", "max_tokens": 4, "temperature": 0,
                  "logprobs": 0, "min_tokens": 3}
    assert post(contract_url, "completions", completion).status_code == 400
    assert post(contract_url, "completions", {**completion, "ignore_eos": True}).status_code == 200


# ----- the executor's queue ----------------------------------------------------------------------------------
async def test_a_request_past_the_executors_queue_is_a_429_and_the_others_complete(stack: Stack,
                                                                                   defaults_url: str) -> None:
    """BATCH requests run and QUEUE wait in the executor's queue (max_queue_size); one more is refused with
    "Maximum queue size of QUEUE has been reached" (executorImpl.cpp enqueueRequests), a 429 with Retry-After,
    while the others run to their end. One at a time: Triton's own queue (the same max_queue_size) stays empty."""
    metrics, url = stack.triton_metrics_url, f"{defaults_url}/completions"
    body = {"model": stack.model, "prompt": "fill", "max_tokens": 100, "ignore_eos": True, "temperature": 0}
    before = await asyncio.to_thread(engine_settled, metrics, DEFAULTS_MODEL)
    async with httpx.AsyncClient(timeout=120) as http:
        running = []
        for count in range(1, BATCH + QUEUE + 1):
            running.append(asyncio.create_task(http.post(url, json=body)))
            await asyncio.to_thread(wait_engine, metrics, DEFAULTS_MODEL,
                                    lambda now, count=count: now["active_slots"] + now["queued_requests"] >= count,
                                    f"{count} requests in the engine")
        await asyncio.to_thread(wait_engine, metrics, DEFAULTS_MODEL,
                                lambda now: now["active_slots"] == BATCH and now["queued_requests"] == QUEUE,
                                f"{BATCH} running and {QUEUE} waiting")
        refused = await http.post(url, json={**body, "max_tokens": 1})
        answers = await asyncio.gather(*running)
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["Retry-After"]) >= 1
    error = refused.json()["error"]
    assert error["code"] == "overloaded"
    assert rules.QUEUE_FULL.format(max_queue_size=QUEUE) in error["message"]
    for leak in ("(/", "executorImpl.cpp", "throwRuntimeError"):  # the double's TLLM_THROW shape (rules.tllm_error)
        assert leak not in error["message"], error["message"]
    for answer in answers:
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["finish_reason"] == "length"
        assert answer.json()["usage"]["completion_tokens"] == 100
    after = await asyncio.to_thread(engine_settled, metrics, DEFAULTS_MODEL, before)
    assert after["cancelled_requests_total"] == before["cancelled_requests_total"]
