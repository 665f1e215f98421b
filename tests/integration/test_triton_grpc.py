"""Raw Triton clients, without the frontend: the ensemble (text in, text out) and the engine model's
TensorRT-LLM interface over gRPC streaming."""

from __future__ import annotations

import queue
import time
import uuid

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.integration.conftest import SLOW_MODEL, Stack

pytestmark = pytest.mark.integration


def tensor(name: str, value: np.ndarray, datatype: str) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, list(value.shape), datatype)
    t.set_data_from_numpy(value)
    return t


def stream_once(url: str, model: str, inputs: list[grpcclient.InferInput], request_id: str = "",
                timeout_s: float = 60, outputs: list[str] | None = None,
                ) -> tuple[list[grpcclient.InferResult], list[str]]:
    """Send one request on a gRPC stream; collect its responses until the final one. `outputs`
    names the outputs wanted (None: all, as Triton does when a request names none)."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        requested = None if outputs is None else [grpcclient.InferRequestedOutput(name) for name in outputs]
        client.async_stream_infer(model, inputs, outputs=requested, request_id=request_id,
                                  enable_empty_final_response=True)
        responses, errors = [], []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            result, error = results.get(timeout=timeout_s)
            if error is not None:
                errors.append(str(error))
                break
            responses.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        return responses, errors
    finally:
        client.stop_stream()
        client.close()


def engine_inputs(prompt: list[int], output_len: int, streaming: bool, **extra: int) -> list:
    inputs = [
        tensor("input_ids", np.array([prompt], dtype=np.int32), "INT32"),
        tensor("input_lengths", np.array([[len(prompt)]], dtype=np.int32), "INT32"),
        tensor("request_output_len", np.array([[output_len]], dtype=np.int32), "INT32"),
        tensor("streaming", np.array([[streaming]], dtype=bool), "BOOL"),
    ]
    for name, value in extra.items():
        inputs.append(tensor(name, np.array([[value]], dtype=np.int32), "INT32"))
    return inputs


def tokens_of(responses: list[grpcclient.InferResult]) -> list[int]:
    out: list[int] = []
    for r in responses:
        ids = r.as_numpy("output_ids")
        if ids is not None:
            out.extend(ids.reshape(-1).tolist())
    return out


def test_ensemble_answers_a_raw_streaming_grpc_call(stack: Stack) -> None:
    inputs = [
        tensor("text_input", np.array([["Hello from a raw client"]], dtype=object), "BYTES"),
        tensor("max_tokens", np.array([[6]], dtype=np.int32), "INT32"),
        tensor("stream", np.array([[True]], dtype=bool), "BOOL"),
    ]
    responses, errors = stream_once(stack.triton_grpc_url, "ensemble", inputs)
    assert not errors
    texts = [r.as_numpy("text_output") for r in responses if r.as_numpy("text_output") is not None]
    assert len(texts) == 6  # one response per generated token
    assert all(t.dtype == object and isinstance(t.reshape(-1)[0], bytes) for t in texts)


def test_engine_streams_one_token_per_response_and_non_streaming_sends_all_at_once(stack: Stack) -> None:
    prompt = [10, 20, 30, 40, 50]
    streamed, errors = stream_once(stack.triton_grpc_url, "tensorrt_llm", engine_inputs(prompt, 8, True))
    assert not errors
    per_response = [r.as_numpy("output_ids").shape for r in streamed if r.as_numpy("output_ids") is not None]
    assert per_response == [(1, 1, 1)] * 8
    whole, errors = stream_once(stack.triton_grpc_url, "tensorrt_llm", engine_inputs(prompt, 8, False))
    assert not errors and len(whole) == 1
    assert whole[0].as_numpy("output_ids").shape == (1, 1, 8)
    assert whole[0].as_numpy("sequence_length").tolist() == [[8]]
    assert tokens_of(whole) == tokens_of(streamed)  # greedy by default, like TensorRT-LLM


def test_engine_sends_only_the_outputs_asked_for(stack: Stack) -> None:
    def names(responses: list[grpcclient.InferResult]) -> set[str]:
        return {o.name for r in responses for o in r.get_response().outputs}

    inputs = engine_inputs([10, 20, 30], 3, True)
    everything, errors = stream_once(stack.triton_grpc_url, "tensorrt_llm", inputs)
    assert not errors
    assert names(everything) == {"output_ids", "sequence_length", "cum_log_probs", "output_log_probs"}
    ids_only, errors = stream_once(stack.triton_grpc_url, "tensorrt_llm", inputs, outputs=["output_ids"])
    assert not errors and names(ids_only) == {"output_ids"}
    assert tokens_of(ids_only) == tokens_of(everything)


def test_engine_stops_at_end_id(stack: Stack) -> None:
    prompt = [5, 6, 7, 8]
    free_run = tokens_of(stream_once(stack.triton_grpc_url, "tensorrt_llm", engine_inputs(prompt, 10, True))[0])
    end_id = free_run[4]
    stopped = tokens_of(stream_once(stack.triton_grpc_url, "tensorrt_llm",
                                    engine_inputs(prompt, 10, True, end_id=end_id))[0])
    assert stopped == free_run[: free_run.index(end_id)]


def test_engine_refuses_a_request_that_can_never_fit(stack: Stack) -> None:
    responses, errors = stream_once(stack.triton_grpc_url, "tensorrt_llm",
                                    engine_inputs([1] * 500, 100, True))
    assert errors and "max_seq_len" in errors[0]
    responses, errors = stream_once(stack.triton_grpc_url, "tensorrt_llm", engine_inputs([1, 2], 3, True))
    assert not errors and len(tokens_of(responses)) == 3


def test_stop_request_with_the_same_id_cancels_a_running_generation(stack: Stack) -> None:
    # On the slow test copy of the engine model (>= 50 ms a step): 400 tokens take >= 20 s, so the target still
    # runs when the stop comes however fast this machine is.
    request_id = f"cancel-me-{uuid.uuid4().hex}"
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(stack.triton_grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(SLOW_MODEL, engine_inputs([3, 4, 5], 400, True),
                                  request_id=request_id, enable_empty_final_response=True)
        first, error = results.get(timeout=60)
        assert error is None
        stop_inputs = engine_inputs([0], 1, True) + [tensor("stop", np.array([[True]], dtype=bool), "BOOL")]
        stop_responses, stop_errors = stream_once(stack.triton_grpc_url, SLOW_MODEL, stop_inputs,
                                                  request_id=request_id)
        assert not stop_errors
        received = 1
        while True:  # the stopped request ends with an error (never like a natural end), before its 400 tokens
            result, error = results.get(timeout=60)
            if error is not None:
                assert "cancelled by a stop request" in str(error)
                break
            received += 1
            assert not result.get_response().parameters["triton_final_response"].bool_param, "ended normally"
        assert received < 400
    finally:
        client.stop_stream()
        client.close()

