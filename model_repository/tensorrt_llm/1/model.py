"""Triton glue for the CPU engine: the TensorRT-LLM backend's tensor interface on the Python backend.

Decoupled: `execute()` only parses each request and hands it to the engine loop (`cpu_engine`), which
answers through the request's response sender: one response per new token when `streaming` is true,
one response with every token otherwise; the last response carries the FINAL flag. Shapes follow the
TensorRT-LLM backend: `output_ids` [1, beams, len], `sequence_length` [1, beams], and so on.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from cpu_engine.config import EngineConfig
from cpu_engine.engine import Engine
from cpu_engine.sampling import SamplingParams
from cpu_engine.scheduler import FinishReason, GenerationRequest, RequestError, new_request_id

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _scalar(request, name: str, default=None):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    values = tensor.as_numpy().reshape(-1)
    return values[0].item() if values.size else default


def _word_list(request, name: str) -> list[list[int]]:
    """Decode the TensorRT-LLM word-list format: [2, L] = flat ids, then end offsets padded with -1."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return []
    array = tensor.as_numpy()
    array = array.reshape(2, -1) if array.ndim != 3 else array[0]
    ids, offsets = array[0].tolist(), [o for o in array[1].tolist() if o >= 0]
    words, start = [], 0
    for end in offsets:
        words.append(ids[start:end])
        start = end
    return [w for w in words if w]


def _param(config: dict, key: str, default: str) -> str:
    value = config.get("parameters", {}).get(key, {}).get("string_value", default)
    return default if value.startswith("${") else value


class TritonSink:
    """Turns the scheduler's per-token results into Triton responses for one request."""

    def __init__(self, sender, streaming: bool, prompt: list[int], exclude_input: bool):
        self.sender = sender
        self.streaming = streaming
        self.prefix = [] if exclude_input else list(prompt)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.cum_logprob = 0.0

    def _response(self, tokens: list[int], logprobs: list[float]):
        ids = np.asarray(tokens, dtype=np.int32).reshape(1, 1, -1)
        outputs = [
            pb_utils.Tensor("output_ids", ids),
            pb_utils.Tensor("sequence_length", np.asarray([[len(tokens)]], dtype=np.int32)),
            pb_utils.Tensor("cum_log_probs", np.asarray([[self.cum_logprob]], dtype=np.float32)),
            pb_utils.Tensor("output_log_probs", np.asarray(logprobs, dtype=np.float32).reshape(1, 1, -1)),
        ]
        return pb_utils.InferenceResponse(output_tensors=outputs)

    def send(self, tokens: list[int], logprobs: list[float], finish: FinishReason | None) -> None:
        self.cum_logprob += float(sum(logprobs))
        flags = FINAL if finish is not None else 0
        if self.streaming:
            first = self.prefix
            self.prefix = []
            if tokens or first:
                self.sender.send(self._response(first + tokens, [0.0] * len(first) + logprobs), flags=flags)
            elif finish is not None:
                self.sender.send(flags=FINAL)
            return
        self.tokens.extend(tokens)
        self.logprobs.extend(logprobs)
        if finish is not None:
            self.sender.send(self._response(self.prefix + self.tokens,
                                            [0.0] * len(self.prefix) + self.logprobs), flags=FINAL)

    def send_error(self, message: str) -> None:
        self.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), flags=FINAL)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(
                "the CPU engine model must be decoupled (model_transaction_policy { decoupled: true })")
        engine_dir = Path(_param(config, "gpt_model_path", ""))
        self.exclude_input_default = _param(config, "exclude_input_in_output", "false").lower() == "true"
        engine_config = EngineConfig.from_engine_dir(
            engine_dir, num_threads=int(_param(config, "cpu_num_threads", "0") or 0))
        self.engine = Engine.from_config(
            engine_config, is_cancelled=lambda request: request.sink.sender.is_cancelled())
        self.engine.start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._enqueue(request, sender)
            except (RequestError, ValueError) as exc:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))), flags=FINAL)
        return None

    def _enqueue(self, request, sender) -> None:
        request_id = request.request_id() or new_request_id()
        if _scalar(request, "stop", False):
            # TensorRT-LLM semantics: stop=true cancels the request that has the same request id.
            self.engine.cancel(request_id)
            sender.send(flags=FINAL)
            return
        input_ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
        if input_ids is None:
            raise RequestError("input_ids is required")
        ids = input_ids.as_numpy()
        if ids.ndim == 2 and ids.shape[0] != 1:
            raise RequestError("one prompt per request: batch size must be 1 (send one request per prompt)")
        output_len = _scalar(request, "request_output_len")
        if output_len is None:
            raise RequestError("request_output_len is not present in the request")
        input_len = _scalar(request, "input_lengths", ids.shape[-1])
        prompt = ids.reshape(-1)[: int(input_len)].tolist()
        streaming = bool(_scalar(request, "streaming", False))
        exclude = bool(_scalar(request, "exclude_input_in_output", self.exclude_input_default))
        end_id = _scalar(request, "end_id")
        seed = _scalar(request, "seed")
        sampling = SamplingParams(
            temperature=float(_scalar(request, "temperature", 1.0)),
            top_k=int(_scalar(request, "runtime_top_k", 0)),
            top_p=float(_scalar(request, "runtime_top_p", 0.0)),
            seed=None if seed is None else int(seed),
            repetition_penalty=float(_scalar(request, "repetition_penalty", 1.0)),
            presence_penalty=float(_scalar(request, "presence_penalty", 0.0)),
            frequency_penalty=float(_scalar(request, "frequency_penalty", 0.0)),
            min_tokens=int(_scalar(request, "min_tokens", 0)),
            bad_words=_word_list(request, "bad_words_list"),
        )
        self.engine.submit(GenerationRequest(
            request_id=request_id,
            prompt=prompt,
            max_new_tokens=int(output_len),
            sink=TritonSink(sender, streaming, prompt, exclude),
            sampling=sampling,
            end_id=None if end_id is None else int(end_id),
            stop_words=_word_list(request, "stop_words_list"),
        ))

    def finalize(self):
        self.engine.stop()
