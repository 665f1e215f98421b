"""What the frontend asks of the engine model: the TensorRT-LLM backend's rules for a request, checked on
the tensors `TritonEngine` builds (the contract double, tests/trtllm_contract, checks them end to end)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from tritonclient.grpc import service_pb2
from tritonclient.grpc._infer_result import InferResult
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from frontend.generation.engine import SamplingOptions
from frontend.generation.triton_errors import error_for
from frontend.generation.trtllm_tensors import (build_inputs, end_words, new_log_probs, new_tokens, requested_outputs,
                                                 top_alternatives)


def input_names(options: SamplingOptions) -> set[str]:
    return {tensor.name() for tensor in build_inputs([1, 2, 3], options)}


@pytest.mark.parametrize("options", [SamplingOptions(max_tokens=4), SamplingOptions(max_tokens=4, logprobs=True),
                                     SamplingOptions(max_tokens=4, logprobs=True, top_logprobs=2)])
def test_sequence_length_is_always_requested(options: SamplingOptions) -> None:
    assert {"output_ids", "sequence_length"} <= set(requested_outputs(options))


def test_log_probs_are_asked_for_with_return_log_probs_only_when_wanted() -> None:
    plain = SamplingOptions(max_tokens=4)
    assert "return_log_probs" not in input_names(plain)
    assert "output_log_probs" not in requested_outputs(plain)
    sampled = SamplingOptions(max_tokens=4, logprobs=True)
    assert "return_log_probs" in input_names(sampled) and "top_logprobs" not in input_names(sampled)
    assert "output_log_probs" in requested_outputs(sampled)
    assert not {"output_top_log_prob_ids", "output_top_log_probs"} & set(requested_outputs(sampled))
    alternatives = SamplingOptions(max_tokens=4, logprobs=True, top_logprobs=3)
    assert {"return_log_probs", "top_logprobs"} <= input_names(alternatives)


def test_end_ids_besides_end_id_go_as_one_token_stop_words_unless_eos_is_ignored() -> None:
    inputs = {t.name(): t for t in build_inputs([1], SamplingOptions(max_tokens=4, eos_token_id=2,
                                                                     extra_end_ids=(7, 9)))}
    assert inputs["stop_words_list"].shape() == [1, 2, 2]
    assert end_words((7, 9)).tolist() == [[[7, 9], [1, 2]]]  # ids, then each word's end offset
    ignoring = SamplingOptions(max_tokens=4, eos_token_id=2, extra_end_ids=(7,), ignore_eos=True)
    assert "stop_words_list" not in input_names(ignoring)


def Result(**arrays: np.ndarray) -> InferResult:
    """A real gRPC response (raw little-endian contents, as Triton sends them) holding `arrays`."""
    response = service_pb2.ModelInferResponse()
    for name, array in arrays.items():
        output = response.outputs.add()
        output.name, output.datatype = name, np_to_triton_dtype(array.dtype)
        output.shape.extend(array.shape)
        response.raw_output_contents.append(array.astype(array.dtype.newbyteorder("<")).tobytes())
    return InferResult(response)


def test_new_tokens_end_at_sequence_length() -> None:
    padded = np.array([[[5, 6, -1, -1]]], dtype=np.int32)  # [1, beams, len], padded past the valid ids
    assert new_tokens(Result(output_ids=padded, sequence_length=np.array([[2]], dtype=np.int32))) == [5, 6]
    assert new_tokens(Result(output_ids=np.array([[[7]]], dtype=np.int32))) == [7]  # no length: all of it
    assert new_tokens(Result(output_ids=np.zeros((1, 1, 0), dtype=np.int32),
                             sequence_length=np.array([[0]], dtype=np.int32))) == []
    assert new_tokens(Result()) == []
    # Outputs come in whatever order the backend made them; one token (the usual response) and its length.
    assert new_tokens(Result(sequence_length=np.array([[1]], dtype=np.int32),
                             output_ids=np.array([[[-9, 3]]], dtype=np.int32))) == [-9]


def test_new_log_probs_are_the_last_ones_of_a_growing_list() -> None:
    """TensorRT-LLM streams every generated token's log-prob so far with each response; the CPU engine
    only the new ones: either way the new tokens' are the last."""
    growing = Result(output_ids=np.array([[[9]]], dtype=np.int32), sequence_length=np.array([[1]], dtype=np.int32),
                     output_log_probs=np.array([[[-0.5, -1.5, -2.5]]], dtype=np.float32))
    assert new_log_probs(growing, 1) == [-2.5]
    only_new = Result(output_log_probs=np.array([[[-0.25, -0.75]]], dtype=np.float32))
    assert new_log_probs(only_new, 2) == [-0.25, -0.75]
    assert new_log_probs(Result(), 1) is None
    assert new_log_probs(Result(output_log_probs=np.zeros((1, 1, 0), dtype=np.float32)), 1) is None


def test_padded_top_alternatives_are_dropped_so_every_one_is_a_real_token() -> None:
    """A guided step where the grammar allows fewer than k tokens: the engine pads its k-wide row with id 0 and
    -inf (TensorRT-LLM's tensor shape is fixed); those are no alternatives, and -inf would reach clients as
    `logprob: null`."""
    ids = np.array([[[7, 3, 0, 0], [5, 9, 2, 11]]], dtype=np.int32)  # [1, tokens, k]
    values = np.array([[[-0.1, -2.5, -np.inf, -np.inf], [-0.5, -1.0, -3.0, -4.0]]], dtype=np.float32)
    top = top_alternatives(Result(output_top_log_prob_ids=ids, output_top_log_probs=values), 2)
    assert top == [[(7, pytest.approx(-0.1)), (3, -2.5)], [(5, -0.5), (9, -1.0), (2, -3.0), (11, -4.0)]]
    assert all(math.isfinite(value) for row in top for _, value in row)
    only_one = np.array([[[4, 0, 0]]], dtype=np.int32), np.array([[[0.0, -np.inf, np.nan]]], dtype=np.float32)
    assert top_alternatives(Result(output_top_log_prob_ids=only_one[0], output_top_log_probs=only_one[1]),
                            1) == [[(4, 0.0)]]
    assert top_alternatives(Result(), 1) is None


def test_a_failed_engine_refusing_new_requests_is_a_503_not_a_500() -> None:
    """The engine is unavailable (the request never ran; a retry may reach a restarted engine); a request it
    was running when it failed is still a 500."""
    refused = error_for(InferenceServerException("the engine has failed and accepts no requests "
                                                 "(RuntimeError: boom)"), "tensorrt_llm")
    assert (refused.status, refused.type, refused.code) == (503, "server_error", "service_unavailable")
    assert "accepts no requests" in refused.message
    running = error_for(InferenceServerException("the engine failed and cannot serve requests (RuntimeError: boom)"),
                        "tensorrt_llm")
    assert (running.status, running.code) == (500, "engine_error")
