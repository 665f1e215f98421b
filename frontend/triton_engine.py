"""The frontend's only way to the engine: Triton gRPC streaming, one stream per request.

Nothing here knows whether `tensorrt_llm` is the TensorRT-LLM backend or the CPU engine: both speak the
TensorRT-LLM tensor interface. Each request opens its own ModelStreamInfer call and half-closes it after
sending; Triton ends the call after the request's final response, so the end of the stream is the end
of the request. Cancelling the call (client gone, stop string found) cancels the request in Triton,
which the engine sees at its next step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from frontend.errors import OpenAIError, engine_error, service_unavailable


@dataclass(frozen=True)
class SamplingOptions:
    """Per-request generation settings, in the engine interface's terms."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    end_id: int | None = None
    pad_id: int | None = None
    logprobs: bool = False  # return the sampled tokens' log-probabilities (output_log_probs)
    top_logprobs: int = 0  # and this many most likely alternatives per token


@dataclass(frozen=True)
class TokenChunk:
    token_ids: list[int]
    logprobs: list[float] | None  # None unless asked for
    top: list[list[tuple[int, float]]]  # per token, the most likely alternatives (if asked for)


@dataclass(frozen=True)
class ModelInfo:
    served_model_name: str
    tokenizer_dir: Path
    context_length: int


def _is_unavailable(exc: BaseException) -> bool:
    if isinstance(exc, grpc.RpcError):
        return exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    status = getattr(exc, "status", lambda: None)()
    text = f"{status} {exc}"
    return "UNAVAILABLE" in text or "DEADLINE_EXCEEDED" in text or "failed to connect" in text.lower()


def _tensor(name: str, value: np.ndarray, datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(value.shape), datatype)
    tensor.set_data_from_numpy(value)
    return tensor


def build_inputs(prompt_ids: list[int], options: SamplingOptions, streaming: bool) -> list[grpcclient.InferInput]:
    """The engine request for one prompt: batch dimension 1, as the TensorRT-LLM backend expects."""

    def scalar(name: str, value: float | int | bool, dtype: type, datatype: str) -> grpcclient.InferInput:
        return _tensor(name, np.array([[value]], dtype=dtype), datatype)

    temperature = options.temperature
    top_k = options.top_k
    if temperature == 0.0:  # OpenAI's "deterministic": greedy, expressed the TensorRT-LLM way
        temperature, top_k = 1.0, 1
    inputs = [
        _tensor("input_ids", np.array([prompt_ids], dtype=np.int32), "INT32"),
        scalar("input_lengths", len(prompt_ids), np.int32, "INT32"),
        scalar("request_output_len", options.max_tokens, np.int32, "INT32"),
        scalar("streaming", streaming, np.bool_, "BOOL"),
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
    if options.end_id is not None:
        inputs.append(scalar("end_id", options.end_id, np.int32, "INT32"))
    if options.pad_id is not None:
        inputs.append(scalar("pad_id", options.pad_id, np.int32, "INT32"))
    if options.top_logprobs:
        inputs.append(scalar("top_logprobs", options.top_logprobs, np.int32, "INT32"))
    return inputs


def _top_alternatives(result: grpcclient.InferResult, count: int) -> list[list[tuple[int, float]]]:
    ids = result.as_numpy("output_top_log_prob_ids")
    values = result.as_numpy("output_top_log_probs")
    if ids is None or values is None:
        return [[] for _ in range(count)]
    ids, values = ids.reshape(count, -1).tolist(), values.reshape(count, -1).tolist()
    return [list(zip(row_ids, row_values)) for row_ids, row_values in zip(ids, values)]


class TritonEngine:
    def __init__(self, url: str, engine_model: str, metadata_timeout_s: float = 5.0):
        self.url = url
        self.engine_model = engine_model
        self._timeout = metadata_timeout_s
        # Reconnect quickly after Triton restarts, instead of gRPC's default backoff of up to minutes.
        self._client = grpcclient.InferenceServerClient(url=url, channel_args=[
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ])

    async def close(self) -> None:
        await self._client.close()

    async def is_ready(self) -> bool:
        try:
            return bool(await self._client.is_server_ready(client_timeout=self._timeout)
                        and await self._client.is_model_ready(self.engine_model, client_timeout=self._timeout))
        except Exception:
            return False

    async def model_parameters(self, model: str) -> dict[str, str]:
        try:
            config = await self._client.get_model_config(model, as_json=True, client_timeout=self._timeout)
        except InferenceServerException as exc:
            if _is_unavailable(exc):
                raise service_unavailable(f"Triton at {self.url} is unreachable") from exc
            raise service_unavailable(f"Triton has no model {model!r} ready: {exc.message()}") from exc
        params = config.get("config", {}).get("parameters", {})
        return {key: value.get("string_value", "") for key, value in params.items()}

    async def generate(self, request_id: str, prompt_ids: list[int], options: SamplingOptions,
                       streaming: bool) -> AsyncIterator[TokenChunk]:
        """Yield the engine's token chunks until the request ends. Closing the iterator early (or
        cancelling the task that runs it) cancels the request in Triton."""
        outputs = ["output_ids"]  # the engine builds only what is asked for, token after token
        if options.logprobs or options.top_logprobs:
            outputs.append("output_log_probs")
        if options.top_logprobs:
            outputs += ["output_top_log_prob_ids", "output_top_log_probs"]
        request = {
            "model_name": self.engine_model,
            "inputs": build_inputs(prompt_ids, options, streaming),
            "outputs": [grpcclient.InferRequestedOutput(name) for name in outputs],
            "request_id": request_id,
        }

        async def one_request():
            yield request

        try:
            call = self._client.stream_infer(one_request())
        except InferenceServerException as exc:
            raise service_unavailable(f"Triton at {self.url} is unreachable: {exc.message()}") from exc
        finished = False
        try:
            async for result, error in call:
                if error is not None:
                    raise engine_error(f"the engine failed the request: {error.message()}")
                ids = result.as_numpy("output_ids")
                if ids is None or ids.size == 0:
                    continue
                token_ids = ids.reshape(-1).tolist()
                logprobs = result.as_numpy("output_log_probs")
                yield TokenChunk(token_ids,
                                 logprobs.reshape(-1).tolist() if logprobs is not None else None,
                                 _top_alternatives(result, len(token_ids)))
            finished = True
        except OpenAIError:
            raise
        except (grpc.RpcError, InferenceServerException) as exc:
            if _is_unavailable(exc):
                raise service_unavailable(f"lost Triton at {self.url}: {exc}") from exc
            raise engine_error(f"Triton stream failed: {exc}") from exc
        finally:
            if not finished:
                call.cancel()
