"""The TensorRT-LLM tensor interface, both ways: a request's input tensors and the outputs it asks for, and the
new tokens, log-probs and alternatives read out of each streamed response.

Nothing here knows whether `tensorrt_llm` is the TensorRT-LLM backend or the CPU engine: both speak the
TensorRT-LLM tensor interface. Its conventions (batch dimension 1, end_id -1 for `ignore_eos`, stop words as
[1, 2, n], the `stop` request) stay in this module.
"""

from __future__ import annotations

import struct

import numpy as np
import tritonclient.grpc.aio as grpcclient

from frontend.generation.engine import SamplingOptions


def tensor(name: str, value: np.ndarray, datatype: str) -> grpcclient.InferInput:
    infer_input = grpcclient.InferInput(name, list(value.shape), datatype)
    infer_input.set_data_from_numpy(value)
    return infer_input


# TensorRT-LLM's executor spells "ignore the end-of-sequence token" as end_id -1
# (tensorrt_llm/executor/base_worker.py: `end_id=-1 if sampling_params.ignore_eos else ...end_id`); the CPU
# engine treats an end id outside the vocabulary the same way.
NO_END_ID = -1


def end_words(token_ids: tuple[int, ...]) -> np.ndarray:
    """End ids besides `end_id` (which takes one) as TensorRT-LLM stop words, one token each: [1, 2, n], the
    ids, then each word's end offset (utils.cc convertWordList; the CPU engine reads the same)."""
    return np.array([[list(token_ids), list(range(1, len(token_ids) + 1))]], dtype=np.int32)


def build_inputs(prompt_ids: list[int], options: SamplingOptions) -> list[grpcclient.InferInput]:
    """The engine request for one prompt: batch dimension 1, as the TensorRT-LLM backend expects. Always
    streamed (one response per step), so that the frontend sees every token as it is made and can end
    the request at a stop string or a disconnect, whether or not its own client streams."""

    def scalar(name: str, value: float | int | bool, dtype: type, datatype: str) -> grpcclient.InferInput:
        return tensor(name, np.array([[value]], dtype=dtype), datatype)

    temperature = options.temperature
    top_k = options.top_k
    if temperature == 0.0:  # OpenAI's "deterministic": greedy, expressed the TensorRT-LLM way
        temperature, top_k = 1.0, 1
    inputs = [
        tensor("input_ids", np.array([prompt_ids], dtype=np.int32), "INT32"),
        scalar("input_lengths", len(prompt_ids), np.int32, "INT32"),
        scalar("request_output_len", options.max_tokens, np.int32, "INT32"),
        scalar("streaming", True, np.bool_, "BOOL"),
        scalar("exclude_input_in_output", True, np.bool_, "BOOL"),
        scalar("temperature", temperature, np.float32, "FP32"),
        scalar("runtime_top_p", options.top_p, np.float32, "FP32"),
        scalar("runtime_top_k", top_k, np.int32, "INT32"),
        scalar("presence_penalty", options.presence_penalty, np.float32, "FP32"),
        scalar("frequency_penalty", options.frequency_penalty, np.float32, "FP32"),
        scalar("repetition_penalty", options.repetition_penalty, np.float32, "FP32"),
        scalar("min_tokens", options.min_tokens, np.int32, "INT32"),
    ]
    if options.seed is not None:
        inputs.append(scalar("seed", options.seed, np.uint64, "UINT64"))
    end_id = NO_END_ID if options.ignore_eos else options.eos_token_id
    if end_id is not None:
        inputs.append(scalar("end_id", end_id, np.int32, "INT32"))
    if options.extra_end_ids and not options.ignore_eos:
        inputs.append(tensor("stop_words_list", end_words(options.extra_end_ids), "INT32"))
    if options.pad_token_id is not None:
        inputs.append(scalar("pad_id", options.pad_token_id, np.int32, "INT32"))
    if options.logprobs or options.top_logprobs:
        # Without it the TensorRT-LLM backend sends no log-probs at all (utils.cc getOutputConfigFromTensors).
        inputs.append(scalar("return_log_probs", True, np.bool_, "BOOL"))
    if options.top_logprobs:  # only where the engine offers alternatives (the max_top_logprobs parameter)
        inputs.append(scalar("top_logprobs", options.top_logprobs, np.int32, "INT32"))
    if options.guide is not None:
        inputs += [tensor("guided_decoding_guide_type", np.array([[options.guide.type]], dtype=np.object_), "BYTES"),
                   tensor("guided_decoding_guide", np.array([[options.guide.text]], dtype=np.object_), "BYTES")]
    return inputs


def requested_outputs(options: SamplingOptions) -> list[str]:
    """Only what this request needs: the engine builds every output it is asked for, token after token.
    `sequence_length` always: the TensorRT-LLM backend refuses a request that does not ask for it
    (model_instance_state.cc: "sequence_length tensor must be present in list of output tensors")."""
    outputs = ["output_ids", "sequence_length"]
    if options.logprobs or options.top_logprobs:
        outputs.append("output_log_probs")
    if options.top_logprobs:
        outputs += ["output_top_log_prob_ids", "output_top_log_probs"]
    return outputs


_INT32 = struct.Struct("<i")


def new_tokens(result: grpcclient.InferResult) -> list[int]:
    """A response's tokens: `output_ids` [1, beams, len] cut at `sequence_length` [1, beams], which is
    how the TensorRT-LLM backend marks the end of the valid ids (it pads the rest). Read straight from the
    response's raw INT32 bytes (little-endian, as Triton sends them): this runs once per token, and the
    InferResult/numpy route costs several times more. Each protobuf field access builds a Python object,
    so the outputs' names are read once and each tensor is looked up by position."""
    response = result.get_response()
    names = [output.name for output in response.outputs]
    if "output_ids" not in names:
        return []
    contents = response.raw_output_contents
    ids = contents[names.index("output_ids")]
    count = len(ids) // 4
    if "sequence_length" in names:
        length = contents[names.index("sequence_length")]
        if length:
            count = min(count, max(0, _INT32.unpack_from(length)[0]))
    return [_INT32.unpack_from(ids)[0]] if count == 1 else list(struct.unpack_from(f"<{count}i", ids))


def new_log_probs(result: grpcclient.InferResult, count: int) -> list[float] | None:
    """The log-probs of a response's `count` new tokens: the last `count` entries of `output_log_probs`.
    A streaming TensorRT-LLM response carries the log-probs of every token generated so far, not only of
    its new ones (the executor's LlmRequest::createResult returns them all each step)."""
    values = result.as_numpy("output_log_probs")
    if values is None:
        return None
    values = values.reshape(-1)
    return values[len(values) - count:].tolist() if len(values) >= count else None


def top_alternatives(result: grpcclient.InferResult, count: int) -> list[list[tuple[int, float]]] | None:
    """Each new token's alternatives, best first. The tensors are k wide for every token, but a step may have
    fewer real alternatives (under a guide, where the grammar allows fewer than k tokens): the engine pads
    the row with -inf log-probs (the CPU engine with id 0), which are no alternatives at all and would reach
    clients as `logprob: null`. Only finite entries are kept, so a row may hold fewer than k."""
    ids = result.as_numpy("output_top_log_prob_ids")
    values = result.as_numpy("output_top_log_probs")
    if ids is None or values is None:
        return None
    ids, values = ids.reshape(count, -1), values.reshape(count, -1)
    real = np.isfinite(values)
    return [list(zip(row_ids[keep].tolist(), row_values[keep].tolist()))
            for row_ids, row_values, keep in zip(ids, values, real)]


def stop_inputs() -> list[grpcclient.InferInput]:
    """A TensorRT-LLM `stop` request (model_instance_state.cc handleStopRequest): the engine ends the requests
    that carry its request id and answers it with an empty FINAL response, running nothing. For an id nobody
    uses it is the health probe: only a dead stub answers STUB_DEAD (triton_control.py). The inputs every
    request must carry come with it."""
    def scalar(name: str, value: int | bool, dtype: type, datatype: str) -> grpcclient.InferInput:
        return tensor(name, np.array([[value]], dtype=dtype), datatype)

    return [scalar("input_ids", 0, np.int32, "INT32"), scalar("input_lengths", 1, np.int32, "INT32"),
            scalar("request_output_len", 1, np.int32, "INT32"), scalar("streaming", True, np.bool_, "BOOL"),
            scalar("stop", True, np.bool_, "BOOL")]
