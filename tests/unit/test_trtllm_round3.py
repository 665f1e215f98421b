"""Audit round 3 (TensorRT-LLM): the double's rules for end ids, top_k and TLLM-shaped errors
(tests/trtllm_contract/rules.py), and the frontend's side of each (frontend/planning/sampling.py, the client
message of an engine error)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from frontend.generation.engine import EngineMetadata, Guide, SamplingOptions
from frontend.generation.triton_errors import client_message, error_for
from frontend.api_types.errors import OpenAIError
from frontend.api_types.request_bodies import SamplingFields
from frontend.planning.guide_budget import NewGuideBudget
from frontend.planning.guide_check import check_guides
from frontend.planning.sampling import TRTLLM_TOP_K_MAX, check_top_k, engine_sampling
from tests.trtllm_contract import rules
from tests.unit.test_trtllm_contract import FRONTEND_OUTPUTS, backend_inputs, frontend_request

GUIDE = Guide("json", "")


def engine_options(req: SamplingFields, guide: Guide | None) -> SamplingOptions:
    """As frontend/generation/serving.py choice_jobs builds one choice's options from the planned request."""
    return SamplingOptions(max_tokens=8, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, eos_token_id=2,
                           top_k=req.top_k, seed=1, guide=guide)


def planned_inputs(guide: Guide | None = None, **fields: Any) -> dict[str, np.ndarray]:
    req = engine_sampling(SamplingFields(model="m", **fields), guide)
    return backend_inputs(engine_options(req, guide))


# ----- B1: ignore_eos with a guide -------------------------------------------------------------------------------
def test_a_guided_request_with_end_id_minus_1_is_what_fails_the_batch() -> None:
    guided = frontend_request(end_id=np.array([-1], dtype=np.int32),
                              guided_decoding_guide_type=np.array([[b"json"]], dtype=object),
                              guided_decoding_guide=np.array([[b""]], dtype=object))
    assert rules.guided_without_end_id(rules.batch_items(guided)[0])
    # accepted at enqueue (upstream refuses nothing): the double fails the batch when the document completes
    assert rules.check_request(guided, FRONTEND_OUTPUTS, decoupled=True) is None
    kept = {**guided, "end_id": np.array([2], dtype=np.int32)}
    assert not rules.guided_without_end_id(rules.batch_items(kept)[0])
    assert not rules.guided_without_end_id(rules.batch_items(frontend_request(end_id=np.array([-1], np.int32)))[0])


def test_the_frontend_keeps_the_end_id_under_a_guide() -> None:
    inputs = planned_inputs(GUIDE, ignore_eos=True, min_tokens=3)
    assert int(inputs["end_id"].reshape(-1)[0]) == 2
    assert int(inputs["min_tokens"].reshape(-1)[0]) == 3  # with the end id kept, min_tokens is harmless (audit R1 note)
    assert not rules.guided_without_end_id(rules.batch_items(inputs)[0])
    unguided = planned_inputs(None, ignore_eos=True)
    assert int(unguided["end_id"].reshape(-1)[0]) == -1  # ignore_eos still means it without a guide


# ----- R1: ignore_eos with min_tokens ------------------------------------------------------------------------
def test_the_double_refuses_min_tokens_with_end_id_minus_1() -> None:
    request = frontend_request(end_id=np.array([-1], dtype=np.int32), min_tokens=np.array([4], dtype=np.int32))
    message = rules.check_request(request, FRONTEND_OUTPUTS, decoupled=True)
    assert message == rules.MIN_TOKENS_WITHOUT_END_ID.format(min_tokens=4)
    assert "penaltyKernels.cu" in message
    for fine in ({"end_id": np.array([2], np.int32), "min_tokens": np.array([4], np.int32)},
                 {"end_id": np.array([-1], np.int32), "min_tokens": np.array([0], np.int32)}):
        assert rules.check_request(frontend_request(**fine), FRONTEND_OUTPUTS, decoupled=True) is None


def test_the_frontend_never_sends_min_tokens_with_ignore_eos() -> None:
    inputs = planned_inputs(None, ignore_eos=True, min_tokens=5)
    assert int(inputs["end_id"].reshape(-1)[0]) == -1 and int(inputs["min_tokens"].reshape(-1)[0]) == 0
    assert rules.check_request(inputs, FRONTEND_OUTPUTS, decoupled=True) is None
    req = SamplingFields(model="m", min_tokens=5)
    assert engine_sampling(req, None) is req  # nothing to change


# ----- R4: top_k above 1024 ----------------------------------------------------------------------------------
def test_the_double_refuses_top_k_above_1024() -> None:
    assert rules.TOP_K_MAX == TRTLLM_TOP_K_MAX
    top_k = lambda k: frontend_request(runtime_top_k=np.array([k], dtype=np.int32))  # noqa: E731
    assert rules.check_request(top_k(1024), FRONTEND_OUTPUTS, True) is None
    assert rules.check_request(top_k(1025), FRONTEND_OUTPUTS, True) == rules.TOP_K_CLIPPED.format(top_k=1025)


@pytest.mark.parametrize("log_probs", ["top_k_normalized", "sampling"])
def test_top_k_above_1024_is_a_400_on_tensorrt_llm(log_probs: str) -> None:
    check_top_k(TRTLLM_TOP_K_MAX, log_probs)
    with pytest.raises(OpenAIError) as caught:
        check_top_k(TRTLLM_TOP_K_MAX + 1, log_probs)
    assert caught.value.status == 400 and caught.value.param == "top_k" and "1024" in caught.value.message


def test_the_cpu_engine_honours_any_top_k() -> None:
    check_top_k(2**31 - 1, "model")


# ----- R6: engine errors without source paths or stack traces ----------------------------------------------------
def tllm_shaped(message: str) -> str:
    return rules.EXECUTOR_ERROR.format(request_id=3, message=rules.tllm_error(
        rules.FETCH_ERROR_PREFIX + message, "batch_manager/llmRequest.cpp", 0))


def test_the_doubles_tllm_errors_carry_a_path_and_a_trace() -> None:
    text = rules.tllm_error("Maximum queue size of 2 has been reached", "executor/executorImpl.cpp", 612)
    assert text.startswith("Maximum queue size of 2 has been reached (/") and "executorImpl.cpp:612)\n" in text
    assert "throwRuntimeError" in text


@pytest.mark.parametrize("message, status", [
    (rules.PROMPT_TOO_LONG.format(prompt_len=64, max_input_len=63), 400),
    (rules.END_ID_OUT_OF_RANGE.format(end_id=100, vocab_size=100), 500),
])
def test_a_client_body_holds_the_message_only_and_the_log_the_whole_text(message: str, status: int,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    text = tllm_shaped(message)
    with caplog.at_level(logging.WARNING, logger="frontend"):
        error = error_for(InferenceServerException(msg=text), "tensorrt_llm")
    assert error.status == status
    assert message in error.message
    for leak in ("(/", "llmRequest.cpp", "0x7f", "throwRuntimeError", "\n"):
        assert leak not in error.message, error.message
    assert any(text in record.getMessage() for record in caplog.records), "the log lost the whole text"
    assert client_message(text).endswith(message)


def test_the_queue_full_error_keeps_its_429_without_the_trace() -> None:
    text = rules.tllm_error(rules.QUEUE_FULL.format(max_queue_size=2), "executor/executorImpl.cpp", 0)
    error = error_for(InferenceServerException(msg=text), "tensorrt_llm")
    assert error.status == 429 and "(/" not in error.message and "executorImpl" not in error.message


def test_planning_changes_only_ignore_eos_and_min_tokens() -> None:
    """engine_sampling changes only ignore_eos and min_tokens (the rest of the request reaches the engine)."""
    req = SamplingFields(model="m", ignore_eos=True, min_tokens=2, top_k=7, temperature=0.5, seed=3)
    planned = engine_sampling(req, GUIDE)
    assert planned.model_dump() == replace_dump(req, ignore_eos=False)


def replace_dump(req: SamplingFields, **changes: Any) -> dict[str, Any]:
    return {**req.model_dump(), **changes}



# ----- R3: new guides per TensorRT-LLM model per minute ----------------------------------------------------------
def test_only_new_guides_count_against_the_budget() -> None:
    now = [0.0]
    budget = NewGuideBudget(limit=2, window_s=60, clock=lambda: now[0])
    assert budget.admit("m", "a") is None and budget.admit("m", "b") is None
    assert budget.admit("m", "a") is None  # seen: the engine has it compiled, nothing more to pay
    assert budget.admit("m", "c") == 60  # a third new one within the minute
    assert budget.admit("other", "c") is None  # per model
    now[0] = 30.0
    assert budget.admit("m", "c") == 30
    now[0] = 60.0
    assert budget.admit("m", "c") is None  # the first two have left the window
    assert NewGuideBudget(limit=0).admit("m", "x") is None  # 0: off


class TrtllmEngine:
    model = "tensorrt_llm"

    def __init__(self, log_probs: str):
        self.log_probs = log_probs

    async def metadata(self) -> EngineMetadata:
        return EngineMetadata("fake", None, 512, log_probs=self.log_probs)


async def test_past_the_budget_a_new_guide_is_a_429_on_tensorrt_llm_only() -> None:
    state = SimpleNamespace(settings=SimpleNamespace(guides_per_minute=1, guide_compile_threads=1,
                                                     guide_compile_timeout_s=2.0))
    first, second = Guide("regex", "a+", "guided_regex"), Guide("regex", "b+", "guided_regex")
    gpu = TrtllmEngine("sampling")
    await check_guides(state, gpu, first)
    await check_guides(state, gpu, first)  # seen before
    with pytest.raises(OpenAIError) as caught:
        await check_guides(state, gpu, second)
    error = caught.value
    assert error.status == 429 and error.param == "guided_regex" and error.code == "guide_rate_exceeded"
    assert int(error.headers["Retry-After"]) >= 1 and "GUIDES_PER_MINUTE" in error.message
    cpu = TrtllmEngine("model")
    for text in ("c+", "d+", "e+"):  # the CPU engine compiles on threads of its own: no budget
        await check_guides(state, cpu, Guide("regex", text, "guided_regex"))


def test_no_end_id_input_is_end_id_minus_1_for_min_tokens() -> None:
    """createNewDecoderRequests.cpp: mEndId.value_or(-1)."""
    request = frontend_request(min_tokens=np.array([2], dtype=np.int32))  # no end_id input at all
    assert rules.check_request(request, FRONTEND_OUTPUTS, True) == rules.MIN_TOKENS_WITHOUT_END_ID.format(min_tokens=2)


def test_without_an_eos_min_tokens_is_not_sent() -> None:
    """A tokenizer without an eos: no end_id goes out, which TensorRT-LLM reads as -1 (R1)."""
    from frontend.generation.serving import choice_jobs
    from frontend.api_types.request_bodies import CompletionRequest
    from tests.unit.test_serving import TOKENIZER

    req = CompletionRequest(model="m", prompt="p", max_tokens=5, min_tokens=3)
    [job] = choice_jobs(req, [[1]], 512, SimpleNamespace(**{**vars(TOKENIZER), "eos_token_id": None,
                                                            "end_token_ids": (), "pad_token_id": None}), None, "p")
    assert job.request.options.min_tokens == 0
    [job] = choice_jobs(req, [[1]], 512, TOKENIZER, None, "p")
    assert job.request.options.min_tokens == 3 and job.request.options.eos_token_id is not None
