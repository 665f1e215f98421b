"""The frontend's only way to the engine: Triton gRPC streaming, one stream per request.

Nothing here knows whether `tensorrt_llm` is the TensorRT-LLM backend or the CPU engine: both speak the
TensorRT-LLM tensor interface (trtllm_tensors.py). Each request opens its own ModelStreamInfer call and
half-closes it after sending; Triton ends the call after the request's final response, so the end of the stream
is the end of the request. A request ended early (client gone, stop string found, deadline) is stopped the
TensorRT-LLM way, by a `stop` request for its id, and its call read to the end: the call is cancelled
only when the engine does not end the request within STOP_GRACE_S (see `TritonEngine.generate` for why).

This module is generation only; the engine client's other jobs have modules of their own: the control API,
model configs and the health probe (triton_control.py, which `TritonEngine` builds on), the tensor interface
(trtllm_tensors.py), a request's stream and the stall watch (engine_stream.py), and how the engine's errors
become OpenAI errors (triton_errors.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import AsyncIterator

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from frontend.generation.engine import EngineRequest, LoraWeights, TokenChunk
from frontend.generation.engine_stream import STREAM_QUEUE, Ended, OpenStream, StallWatch
from frontend.generation.triton_control import TritonControl
from frontend.generation.triton_errors import about_the_guide, error_for, lora_cache_miss, stream_failure
from frontend.generation.trtllm_tensors import build_inputs, requested_outputs, tensor
from frontend.api_types.errors import OpenAIError, invalid_request, service_unavailable

log = logging.getLogger("frontend")

# A request ended early is stopped by id (`stop_inputs`) and its call read to the end. The TensorRT-LLM backend
# remembers a stop for a request it holds (executorImpl.cpp cancelRequest: mCancelledReqIds) and ends the request
# once the executor schedules it (terminateCancelledRequests checks only active requests, forwardSync ends only
# scheduled ones): a queued request still runs its prefill first. So the stop is sent again only for a request
# that may still be queued in Triton ahead of the backend (which a stop cannot find), after STOP_RESEND_S,
# doubling up to STOP_RESEND_MAX_S. The call is cancelled (and logged, once) only past a grace: STOP_GRACE_S for
# a request that has produced a token (scheduled), STOP_GRACE_QUEUED_S for one that has not: under saturation
# its turn may come later than 10 s, and cancelling the call would reach the same cancelRequest (WaitForCancel)
# while it risks tritonserver 2.51's cancellation race (one leaked request keeps its model from unloading).
STOP_RESEND_S = 1.0
STOP_RESEND_MAX_S = 4.0
STOP_GRACE_S = 10.0
STOP_GRACE_QUEUED_S = 60.0
CLOSE_GRACE_S = 2.0  # how long closing the engine client waits for requests being stopped


class TritonEngine(TritonControl):
    """`LLMEngine` over Triton gRPC: the engine model (TensorRT-LLM tensor interface) for generation; its
    config and the preprocessing model's config for metadata, and the control API (TritonControl)."""

    def __init__(self, url: str, engine_model: str, preprocessing_model: str = "preprocessing",
                 metadata_timeout_s: float = 5.0, control_key: str | None = None, stall_probe_s: float = 2.0,
                 stream_queue: int = STREAM_QUEUE):
        super().__init__(url, engine_model, preprocessing_model, metadata_timeout_s, control_key)
        self._stream_queue = stream_queue
        self._stalls = StallWatch(self.probe, stall_probe_s)
        self._ending: set[asyncio.Task[None]] = set()  # `_end_early` tasks, kept until done
        self._lora_sent: set[tuple[str, int]] = set()  # (engine model, task id) whose weights it has taken
        self._lora_types: dict[str, str] = {}  # engine model -> its lora_weights datatype

    async def close(self) -> None:
        """Requests being stopped get a moment to end (one engine step, as a rule); then their calls are
        cancelled."""
        if self._ending:
            _, late = await asyncio.wait(set(self._ending), timeout=CLOSE_GRACE_S)
            for ending in late:  # the call is cancelled as the task ends
                ending.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        await super().close()

    def retire(self, model: str | None, version: str, failure: OpenAIError) -> int:
        """End every request open on this model version with `failure` (a swap rollout past its grace: Triton
        would otherwise wait for each to run to its end before it unloads the version). Each is stopped by
        id and its call read to the end (`_end_early`); its consumer then gets `failure`. Returns how many."""
        streams = self._stalls.streams_of(model or self.engine_model, version)
        for stream in streams:
            if stream.failure is None:
                stream.failure = failure
                ending = asyncio.get_running_loop().create_task(self._end_early(stream))
                self._ending.add(ending)
                ending.add_done_callback(self._ending.discard)
        return len(streams)

    async def _end_early(self, stream: OpenStream) -> None:
        """Stop a request its consumer left before its end, and read its call to the end (the reader task
        does); cancel the call only when the engine has not ended the request within STOP_GRACE_S or the
        stop cannot be sent. Resends and grace: see STOP_RESEND_S."""
        assert stream.reader is not None
        grace = STOP_GRACE_S if stream.scheduled else STOP_GRACE_QUEUED_S
        deadline, resend = time.monotonic() + grace, STOP_RESEND_S
        try:
            while not stream.reader.done() and time.monotonic() < deadline:
                try:
                    await self._stop(stream.model, stream.version, stream.request_id)
                except (asyncio.TimeoutError, grpc.RpcError, InferenceServerException):
                    return  # Triton does not take the stop: cancelling the call is all that is left
                await asyncio.wait({stream.reader}, timeout=max(0.0, min(resend, deadline - time.monotonic())))
                resend = min(2 * resend, STOP_RESEND_MAX_S)
        finally:
            if not stream.reader.done():
                log.warning("engine request %s did not end within %.0f s of its stop: cancelling its call",
                            stream.request_id, grace)
                stream.call.cancel()

    async def generate(self, request: EngineRequest, model: str | None = None,
                       version: str = "") -> AsyncIterator[TokenChunk]:
        """As `_generate`; a request through a LoRA adapter names it by `lora_task_id`, and carries its weights
        only where this engine model may not hold them yet: on first use, and once more when the engine says its
        LoRA cache no longer has the task (TensorRT-LLM evicts; "LoRA task ... not found in cache")."""
        lora = request.lora
        if lora is None:
            async with contextlib.aclosing(self._generate(request, model, version)) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        key = (model or self.engine_model, lora.task_id)
        send = key not in self._lora_sent
        while True:
            inputs = await self._lora_inputs(key[0], lora, send)
            started = False
            try:
                async with contextlib.aclosing(self._generate(request, model, version, inputs)) as chunks:
                    async for chunk in chunks:
                        if send and not started:
                            self._lora_sent.add(key)  # accepted: the engine's cache holds it now
                        started = True
                        yield chunk
                return
            except OpenAIError as exc:
                if started or send or not lora_cache_miss(exc.message):
                    raise
                self._lora_sent.discard(key)
                send = True
                # Another id: the failed call may still be stopped by its id (_end_early), which must not stop this.
                request = dataclasses.replace(request, request_id=f"{request.request_id}-lora")

    async def _lora_inputs(self, model: str, lora: LoraWeights, with_weights: bool) -> list[grpcclient.InferInput]:
        """`lora_task_id`, and `lora_weights`/`lora_config` when `with_weights`, in the dtype the engine model's
        config declares for lora_weights (the engine's: float32 on the CPU engine, float16 on TensorRT-LLM)."""
        inputs = [tensor("lora_task_id", np.array([[lora.task_id]], dtype=np.uint64), "UINT64")]
        if not with_weights:
            return inputs
        if model not in self._lora_types:
            try:
                config = await self._client.get_model_config(model, as_json=True, client_timeout=self._timeout)
            except InferenceServerException as exc:
                raise service_unavailable(f"the inference server has no model {model!r} ready") from exc
            declared = {i.get("name"): i.get("data_type", "") for i in config.get("config", {}).get("input", [])}
            if "lora_weights" not in declared:
                raise invalid_request(f"the engine model {model!r} takes no LoRA adapters (no lora_weights input)",
                                      "model")
            self._lora_types[model] = declared["lora_weights"].removeprefix("TYPE_")
        datatype = self._lora_types[model]
        dtype = {"FP32": np.float32, "FP16": np.float16}.get(datatype)
        if dtype is None:
            raise invalid_request(f"the engine model {model!r} takes lora_weights as {datatype}; the frontend "
                                  "sends FP32 or FP16", "model")
        return inputs + [tensor("lora_weights", lora.weights[None].astype(dtype), datatype),
                         tensor("lora_config", lora.config[None].astype(np.int32), "INT32")]

    async def _generate(self, request: EngineRequest, model: str | None = None, version: str = "",
                        extra_inputs: list[grpcclient.InferInput] | None = None) -> AsyncIterator[TokenChunk]:
        """`model` and `version` pick a named model's version (frontend/models.py); by default the engine
        model at the version Triton picks.

        Closing this before its end (or cancelling its consumer) stops the engine request by id and reads
        its call to the end in the background (`_end_early`) instead of cancelling the call: tritonserver
        2.51 can leak a stream's state when a cancellation meets the request's end (server PR #8078, "Fix
        gRPC cancellation race condition", 2025), and a leaked request keeps its model from ever unloading.
        A consumer that knows the engine is ending the request (an end id) reads on to the end itself,
        which spares the stop."""
        options = request.options
        triton_request = {
            "model_name": model or self.engine_model,
            "model_version": version,
            "inputs": build_inputs(request.prompt_ids, options) + (extra_inputs or []),
            "outputs": [grpcclient.InferRequestedOutput(name) for name in requested_outputs(options)],
            "request_id": request.request_id,
        }

        async def one_request():
            yield triton_request

        try:
            call = self._client.stream_infer(one_request())
        except InferenceServerException as exc:
            raise service_unavailable("the inference server is unreachable") from exc
        stream = OpenStream(triton_request["model_name"], version, request.request_id, call, time.monotonic(),
                            options, request.buffer, self._stream_queue)
        stream.on_overflow = lambda: self._stop_early(stream)
        stream.start_reading()
        self._stalls.open(stream)
        try:
            while not isinstance(response := await stream.next(), Ended):
                chunk, error = response
                if error is not None:
                    raise about_the_guide(error_for(error, model or self.engine_model), options)
                yield chunk
            if stream.failure is not None:  # the watch cancelled the call, or the budget was passed
                raise stream.failure
            if response.error is not None:
                raise stream_failure(response.error) from response.error
        finally:
            self._stalls.close(stream)
            stream.leave()
            self._stop_early(stream)

    def _stop_early(self, stream: OpenStream) -> None:
        """Stop a stream's engine request (`_end_early`) unless its call has ended or is being stopped."""
        if stream.reader is None or stream.reader.done() or stream.on_overflow is None:
            return
        stream.on_overflow = None  # once
        ending = asyncio.get_running_loop().create_task(self._end_early(stream))
        self._ending.add(ending)
        ending.add_done_callback(self._ending.discard)
