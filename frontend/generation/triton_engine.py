"""The frontend's only way to the engine: Triton gRPC streaming, one stream per request.

Nothing here knows whether `tensorrt_llm` is the TensorRT-LLM backend or the CPU engine: both speak the
TensorRT-LLM tensor interface. Each request opens its own ModelStreamInfer call and half-closes it after
sending; Triton ends the call after the request's final response, so the end of the stream is the end
of the request. A request ended early (client gone, stop string found, deadline) is stopped the
TensorRT-LLM way, by a `stop` request for its id, and its call read to the end: the call is cancelled
only when the engine does not end the request within STOP_GRACE_S (see `TritonEngine.generate` for why).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import struct
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from frontend.generation.engine import (BufferBudget, EngineMetadata, EngineRequest, LoraWeights, SamplingOptions,
                                       TokenChunk)
from frontend.api_types.errors import OpenAIError, engine_error, invalid_request, service_unavailable, too_many_requests

log = logging.getLogger("frontend")


def _is_unavailable(exc: BaseException) -> bool:
    if isinstance(exc, grpc.RpcError):
        return exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    status = getattr(exc, "status", lambda: None)()
    text = f"{status} {exc}"
    return "UNAVAILABLE" in text or "DEADLINE_EXCEEDED" in text or "failed to connect" in text.lower()


def _model_gone(error: InferenceServerException) -> bool:
    """Triton's answer for a model that is not (or no longer) loaded, e.g. after a failed engine unloaded
    itself: the service is unavailable, not broken."""
    return "unknown model" in (error.message() or "").lower()


# The engines' refusals of a request that can never run: the CPU engine's (cpu_engine/scheduler.py
# `validate`, the glue's `RequestError`s in model_repository/tensorrt_llm/1/model.py) and TensorRT-LLM's
# executor's for a prompt past the engine's max_input_len (llmRequest.cpp LlmRequest::validate; a build
# with --max-input-len below max_seq_len - 1): the client's mistake, a 400. Triton
# hands a decoupled model's error response back on the stream as text only, without a status code, so
# these are told apart by their words; anything else the engine answers with stays a 500.
ENGINE_CLIENT_ERRORS = (
    "input_ids is empty",
    "request_output_len must be at least 1",
    "exceeds the engine's max_seq_len",
    "exceeds the engine's KV cache",
    "outside the vocabulary",
    "exceeds maximum input length",
    "invalid guided_decoding_guide",  # the CPU engine's grammar compiler refused the guide
    "guided decoding is off",
    "lora_config:",  # the CPU engine refused an adapter's tensors (cpu_engine/lora.py)
    "lora_weights:",
)
# gRPC / Triton statuses that say the request itself was wrong (Triton: TRITONSERVER_ERROR_INVALID_ARG).
CLIENT_ERROR_STATUSES = ("INVALID_ARGUMENT", "INVALID_ARG")
# A dead engine refuses every request with a message that may quote anything (its exception): never a 400.
ENGINE_FAILURES = ("the engine failed", "the engine has failed")
# How a failed engine refuses new requests (cpu_engine/engine.py EngineFailedError) until its glue has taken
# the model out of service (Triton then says "unknown model", a 503 too): the engine is unavailable, the
# request never ran and may be retried (another replica, a restarted engine), so a 503 and not a 500. A
# request the engine was running when it failed ("the engine failed and cannot serve requests") stays a 500.
ENGINE_UNAVAILABLE = ("the engine has failed and accepts no requests",)
MAX_ENGINE_MESSAGE = 500  # characters of an engine message passed on to clients
# A full queue: the CPU engine's (cpu_engine/engine.py QueueFullError) or Triton's own (dynamic batcher).
QUEUE_FULL = ("queue is full", "Exceeds maximum queue size", "Maximum queue size of")
ENGINE_RETRY_AFTER_S = 1.0


def is_client_error(error: InferenceServerException) -> bool:
    """Whether the engine refused the request for something the client sent (400), not failed (500)."""
    status = str(error.status() or "")
    if any(code in status for code in CLIENT_ERROR_STATUSES):
        return True
    message = error.message() or ""
    if any(words in message for words in ENGINE_FAILURES):
        return False
    return any(words in message for words in ENGINE_CLIENT_ERRORS)


# TensorRT-LLM's TLLM_THROW / TLLM_CHECK texts go on with " (<absolute source path>:<line>)" and a stack trace
# (tllmException.h): the message is what comes before (tests/trtllm_contract/rules.py tllm_error).
SOURCE_LOCATION = " (/"


def client_message(message: str | None) -> str:
    """An engine's message as clients may see it: one line, bounded, with no source location or stack trace
    (TensorRT-LLM's) and no gRPC debug details (which name peers, addresses and source files). The log keeps
    the whole text (error_for)."""
    text = " ".join((message or "").split(SOURCE_LOCATION, 1)[0].split())
    for marker in (" debug_error_string", " {created_time", " {grpc_"):
        text = text.split(marker, 1)[0]
    if len(text) > MAX_ENGINE_MESSAGE:
        text = text[: MAX_ENGINE_MESSAGE - 3] + "..."
    return text or "no details"


def error_for(error: InferenceServerException, engine_model: str) -> OpenAIError:
    """The OpenAI error for an engine's error response: 503 when the model is not loaded or the engine has
    failed and refuses new requests, 429 when its queue is full (the client may retry), 400 when it refused
    what the client sent, else 500."""
    message = error.message() or ""
    if SOURCE_LOCATION in message:  # the client gets the message only: the whole text goes to the log
        log.warning("engine error on %s: %s", engine_model, message)
    if _model_gone(error):
        return service_unavailable(f"the engine model {engine_model!r} is not loaded")
    if any(words in message for words in ENGINE_UNAVAILABLE):
        return service_unavailable(f"the engine is unavailable: {client_message(message)}")
    if any(words in message for words in QUEUE_FULL):
        return too_many_requests(f"The engine is at capacity: {client_message(message)}", ENGINE_RETRY_AFTER_S)
    if is_client_error(error):
        return invalid_request(f"the engine refused the request: {client_message(message)}",
                               code="invalid_engine_request")
    return engine_error(f"the engine failed the request: {client_message(message)}")


def _about_the_guide(error: OpenAIError, options: SamplingOptions) -> OpenAIError:
    """An engine's refusal of a guide names the request field the guide came from."""
    if options.guide is not None and error.status == 400 and "guided" in error.message:
        error.param = options.guide.param
    return error


def lora_cache_miss(message: str) -> bool:
    """Whether an engine error says its LoRA cache does not hold the task (TensorRT-LLM's words, which the CPU
    engine uses too: cpu_engine/lora.py not_in_cache): the weights are sent again."""
    return "not found in cache" in message and "LoRA task" in message


def _tensor(name: str, value: np.ndarray, datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(value.shape), datatype)
    tensor.set_data_from_numpy(value)
    return tensor


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
        return _tensor(name, np.array([[value]], dtype=dtype), datatype)

    temperature = options.temperature
    top_k = options.top_k
    if temperature == 0.0:  # OpenAI's "deterministic": greedy, expressed the TensorRT-LLM way
        temperature, top_k = 1.0, 1
    inputs = [
        _tensor("input_ids", np.array([prompt_ids], dtype=np.int32), "INT32"),
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
        inputs.append(_tensor("stop_words_list", end_words(options.extra_end_ids), "INT32"))
    if options.pad_token_id is not None:
        inputs.append(scalar("pad_id", options.pad_token_id, np.int32, "INT32"))
    if options.logprobs or options.top_logprobs:
        # Without it the TensorRT-LLM backend sends no log-probs at all (utils.cc getOutputConfigFromTensors).
        inputs.append(scalar("return_log_probs", True, np.bool_, "BOOL"))
    if options.top_logprobs:  # only where the engine offers alternatives (the max_top_logprobs parameter)
        inputs.append(scalar("top_logprobs", options.top_logprobs, np.int32, "INT32"))
    if options.guide is not None:
        inputs += [_tensor("guided_decoding_guide_type", np.array([[options.guide.type]], dtype=np.object_), "BYTES"),
                   _tensor("guided_decoding_guide", np.array([[options.guide.text]], dtype=np.object_), "BYTES")]
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


def _new_tokens(result: grpcclient.InferResult) -> list[int]:
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


def _new_log_probs(result: grpcclient.InferResult, count: int) -> list[float] | None:
    """The log-probs of a response's `count` new tokens: the last `count` entries of `output_log_probs`.
    A streaming TensorRT-LLM response carries the log-probs of every token generated so far, not only of
    its new ones (the executor's LlmRequest::createResult returns them all each step)."""
    values = result.as_numpy("output_log_probs")
    if values is None:
        return None
    values = values.reshape(-1)
    return values[len(values) - count:].tolist() if len(values) >= count else None


def _top_alternatives(result: grpcclient.InferResult, count: int) -> list[list[tuple[int, float]]] | None:
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


# Triton's gRPC server asks for a restricted protocol's key under this name: `triton-grpc-protocol-` + the
# header the launcher restricts the control API with (launcher/tritonserver.py CONTROL_HEADER).
CONTROL_KEY_METADATA = "triton-grpc-protocol-triton-control-key"
# The Python backend's answer for a model whose stub process is gone (killed, out of memory): the model stays
# READY and its open streams get nothing more, ever (launcher/engine_health.py has the measurements).
STUB_DEAD = "is not healthy"
PROBE_TIMEOUT_S = 5.0
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


def stop_inputs() -> list[grpcclient.InferInput]:
    """A TensorRT-LLM `stop` request (model_instance_state.cc handleStopRequest): the engine ends the requests
    that carry its request id and answers it with an empty FINAL response, running nothing. For an id nobody
    uses it is the health probe: only a dead stub answers STUB_DEAD. The inputs every request must carry
    come with it."""
    def scalar(name: str, value: int | bool, dtype: type, datatype: str) -> grpcclient.InferInput:
        return _tensor(name, np.array([[value]], dtype=dtype), datatype)

    return [scalar("input_ids", 0, np.int32, "INT32"), scalar("input_lengths", 1, np.int32, "INT32"),
            scalar("request_output_len", 1, np.int32, "INT32"), scalar("streaming", True, np.bool_, "BOOL"),
            scalar("stop", True, np.bool_, "BOOL")]


@dataclass(frozen=True)
class _Ended:
    """The last thing a stream's reader hands on: the call ended, normally (error None) or not."""

    error: BaseException | None = None


# What a stream's queue holds per response at most (TritonEngine's `stream_queue`): a consumer that stops
# taking (its client stopped reading) stops the reader there, and gRPC's flow control holds the rest.
STREAM_QUEUE = 64


def buffer_exceeded(limit: int) -> OpenAIError:
    """The error of a request whose client left its output waiting past the request's BufferBudget."""
    return OpenAIError(503, f"the client read this response too slowly: more than {limit} bytes of generated "
                            "output waited for it, so the request was ended", "server_error", None,
                       "client_too_slow")


def chunk_bytes(chunk: TokenChunk) -> int:
    """About what a TokenChunk holds in memory (CPython objects), for the request's BufferBudget."""
    top = sum(map(len, chunk.top)) if chunk.top is not None else 0
    return 100 + 40 * len(chunk.token_ids) + (32 * len(chunk.logprobs) if chunk.logprobs is not None else 0) \
        + 120 * top


@dataclass(eq=False)
class _OpenStream:
    """One engine request's call, read by a task of its own into `responses`.

    The consumer of `generate` awaits the queue, never the call: a consumer cancelled while it waits (a
    client gone, a deadline, a sibling choice failed) must not cancel the call, and grpc.aio cancels a call
    whose reading task is cancelled (`_StreamResponseMixin._read`).

    What waits for the consumer is bounded (a client that stops reading stops its consumer): the reader hands
    on each response as a TokenChunk, not the response itself, since a TensorRT-LLM response carries the
    log-probs of every token so far (`_new_log_probs`: O(n^2) bytes for a stream held whole); it waits while
    `limit` chunks wait, so that gRPC's flow control holds the call; and every chunk waiting is charged to the
    request's BufferBudget, past which the request ends (`failure`) and its engine request is stopped. A
    stream its consumer left (`discard`) is still read to its end, keeping nothing: the stop-by-id path."""

    model: str
    version: str
    request_id: str
    call: Any  # the gRPC call, cancelled when the engine behind it is found dead or ignores a stop
    heard_at: float  # time.monotonic() of its last response (or of its start)
    options: SamplingOptions = field(default_factory=lambda: SamplingOptions(max_tokens=1))
    buffer: BufferBudget | None = None
    limit: int = STREAM_QUEUE
    on_overflow: Callable[[], None] | None = None  # stops the engine request once the budget is passed
    scheduled: bool = False  # a response came: the engine has taken it into its batch (streamed: one per step)
    failure: OpenAIError | None = None  # why the watch (or the budget) ended it
    responses: asyncio.Queue = field(default_factory=asyncio.Queue)  # (chunk | None, error) ... then _Ended
    room: asyncio.Event = field(default_factory=asyncio.Event)  # set when the consumer took, or left
    reader: asyncio.Task | None = None
    discard: bool = False  # the consumer left, or the budget was passed: what comes is read and dropped
    waiting: bool = False  # the reader waits for room in `responses`

    def start_reading(self) -> None:
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def next(self) -> Any:
        """The consumer's next item; its bytes go back to the request's budget."""
        item = self._taken(await self.responses.get())
        self.room.set()
        return item

    def _taken(self, item: Any) -> Any:
        if self.buffer is not None and isinstance(item, tuple) and item[0] is not None:
            self.buffer.give(chunk_bytes(item[0]))
        return item

    def leave(self) -> None:
        """The consumer has left: drop what waits and all that comes (a waiting reader wakes up)."""
        self.discard = True
        while not self.responses.empty():
            self._taken(self.responses.get_nowait())
        self.room.set()

    def _chunk(self, result: grpcclient.InferResult) -> TokenChunk | None:
        """A response's new tokens with only their log-probs, or None when it has no tokens."""
        token_ids = _new_tokens(result)
        if not token_ids:
            return None
        count, options = len(token_ids), self.options
        return TokenChunk(token_ids,
                          _new_log_probs(result, count) if options.logprobs or options.top_logprobs else None,
                          _top_alternatives(result, count) if options.top_logprobs else None)

    async def _hand_on(self, chunk: TokenChunk | None, error: Any) -> None:
        while self.responses.qsize() >= self.limit and not self.discard:
            self.room.clear()
            self.waiting = True  # on its consumer, not on the engine: no stall (StallWatch)
            await self.room.wait()
            self.waiting = False
            self.heard_at = time.monotonic()
        if self.discard:
            return
        if chunk is not None and self.buffer is not None and not self.buffer.take(chunk_bytes(chunk)):
            self.failure = buffer_exceeded(self.buffer.limit)
            self.discard = True
            self.responses.put_nowait(_Ended())  # after what waits: the consumer then raises `failure`
            if self.on_overflow is not None:
                self.on_overflow()
            return
        self.responses.put_nowait((chunk, error))

    async def _read(self) -> None:
        ended = _Ended()
        try:
            async for result, error in self.call:
                self.heard_at = time.monotonic()
                self.scheduled = True
                if self.discard:
                    continue
                chunk = self._chunk(result) if error is None else None
                if chunk is not None or error is not None:
                    await self._hand_on(chunk, error)
        except asyncio.CancelledError as exc:  # the call was cancelled (grpc.aio says so this way), or this task
            self.responses.put_nowait(_Ended(exc))
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            return
        except Exception as exc:  # grpc.RpcError, InferenceServerException: handed on, raised by the consumer
            ended = _Ended(exc)
        self.responses.put_nowait(ended)


class StallWatch:
    """Ends the streams of an engine model whose process died, instead of leaving them to hang.

    Only streams that have heard nothing for `stall_s` cost anything: for each model with such a stream, one
    probe (`stop_inputs`) at a time; a dead answer fails every stream open on that model version with a 503
    at once. A probe that gets no answer proves nothing (a busy engine), so nothing is ended on a timeout.
    """

    def __init__(self, probe: Callable[[str, str], Awaitable[str | None]], stall_s: float) -> None:
        self._probe = probe
        self.stall_s = stall_s
        self._streams: set[_OpenStream] = set()
        self._task: asyncio.Task[None] | None = None

    def open(self, stream: _OpenStream) -> None:
        self._streams.add(stream)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    def close(self, stream: _OpenStream) -> None:
        self._streams.discard(stream)

    def streams_of(self, model: str, version: str) -> list[_OpenStream]:
        return [s for s in self._streams if (s.model, s.version) == (model, version)]

    async def _watch(self) -> None:
        try:
            while self._streams:
                await asyncio.sleep(self.stall_s / 2)
                now = time.monotonic()
                silent = {(s.model, s.version) for s in self._streams
                          if not s.waiting and now - s.heard_at >= self.stall_s}
                for model, version in sorted(silent):
                    dead = await self._probe(model, version)
                    if dead is not None:
                        self._fail(model, version, dead)
        finally:
            self._task = None

    def _fail(self, model: str, version: str, reason: str) -> None:
        for stream in [s for s in self._streams if (s.model, s.version) == (model, version)]:
            stream.failure = service_unavailable(
                f"the engine model {model!r} stopped serving ({client_message(reason)}); retry the request")
            stream.call.cancel()


class TritonEngine:
    """`LLMEngine` over Triton gRPC: the engine model (TensorRT-LLM tensor interface) for generation, its
    config and the preprocessing model's config for metadata."""

    def __init__(self, url: str, engine_model: str, preprocessing_model: str = "preprocessing",
                 metadata_timeout_s: float = 5.0, control_key: str | None = None, stall_probe_s: float = 2.0,
                 stream_queue: int = STREAM_QUEUE):
        self.url = url
        self._stream_queue = stream_queue
        self._control = {CONTROL_KEY_METADATA: control_key} if control_key else None
        self._stalls = StallWatch(self.probe, stall_probe_s)
        self._ending: set[asyncio.Task[None]] = set()  # `_end_early` tasks, kept until done
        self.engine_model = engine_model
        self.preprocessing_model = preprocessing_model
        self._timeout = metadata_timeout_s
        self._lora_sent: set[tuple[str, int]] = set()  # (engine model, task id) whose weights it has taken
        self._lora_types: dict[str, str] = {}  # engine model -> its lora_weights datatype
        # Reconnect quickly after Triton restarts, instead of gRPC's default backoff of up to minutes.
        self._client = grpcclient.InferenceServerClient(url=url, channel_args=[
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ])

    async def close(self) -> None:
        """Requests being stopped get a moment to end (one engine step, as a rule); then their calls are
        cancelled."""
        if self._ending:
            _, late = await asyncio.wait(set(self._ending), timeout=CLOSE_GRACE_S)
            for ending in late:  # the call is cancelled as the task ends
                ending.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        await self._client.close()

    async def is_ready(self, model: str | None = None, version: str = "") -> bool:
        """One engine model ready in Triton (version "": the one Triton picks by its version policy). Not
        Triton's server readiness: under its strict readiness (the default) a model someone else unloaded
        (another model's rollout, a test's model) makes the whole server "not ready" for good."""
        try:
            return bool(await self._client.is_model_ready(model or self.engine_model, version,
                                                          client_timeout=self._timeout))
        except Exception:
            return False

    async def load_model(self, model: str) -> None:
        """Ask Triton (explicit model control) to load `model` as its config on disk now says: versions the
        version_policy added are loaded, versions it dropped unloaded, the others left serving. Raises
        InferenceServerException with Triton's reason when a version fails to load."""
        await self._client.load_model(model, headers=self._control)

    async def unload_model(self, model: str) -> None:
        """Ask Triton to unload every version of `model`; it returns once they are unloaded (a TensorRT-LLM
        executor finishes its in-flight requests first: executorImpl.cpp executionLoop)."""
        await self._client.unload_model(model, headers=self._control)

    async def parameter(self, model: str, key: str) -> str:
        """One parameter of the model's config ("" when it has none)."""
        return (await self._parameters(model)).get(key, "")

    async def model_index(self) -> dict[str, dict[str, str]]:
        """What Triton has loaded: model name -> {version: state} from its repository index (READY, LOADING,
        UNLOADING, UNAVAILABLE; a model in the repository that was never loaded has no versions). The index is
        a control API, restricted with the launch's key. 503 when Triton does not answer."""
        try:
            index = await self._client.get_model_repository_index(headers=self._control, as_json=True,
                                                                  client_timeout=self._timeout)
        except InferenceServerException as exc:
            raise service_unavailable(f"the inference server's repository index is not answering: "
                                      f"{client_message(exc.message())}") from exc
        models: dict[str, dict[str, str]] = {}
        for entry in index.get("models", []):
            versions = models.setdefault(entry.get("name", ""), {})
            if entry.get("version"):
                versions[str(entry["version"])] = entry.get("state", "")
        return models

    async def _stop(self, model: str, version: str, request_id: str) -> InferenceServerException | None:
        """Send a `stop` for `request_id` (`stop_inputs`) and read its stream to the end, which follows the
        answer: the engine's error answer, or None. Raises asyncio.TimeoutError without an end within
        PROBE_TIMEOUT_S, grpc.RpcError / InferenceServerException when Triton does not take it."""
        async def one_request():
            yield {"model_name": model, "model_version": version, "inputs": stop_inputs(), "request_id": request_id}

        call = self._client.stream_infer(one_request())

        async def answer() -> InferenceServerException | None:
            found = None
            async for _, error in call:
                found = found or error
            return found

        try:
            return await asyncio.wait_for(answer(), PROBE_TIMEOUT_S)
        finally:
            call.cancel()  # nothing once the stream has ended (`generate`); an unanswered stop is given up on

    async def probe(self, model: str, version: str = "") -> str | None:
        """The engine's answer to a `stop` for an id nobody uses when it says the model's process is gone
        (STUB_DEAD) or the model is no longer loaded; None when it answered otherwise, or not within
        PROBE_TIMEOUT_S."""
        try:
            error = await self._stop(model, version, f"health-probe-{uuid.uuid4().hex}")
        except (asyncio.TimeoutError, grpc.RpcError, InferenceServerException):
            return None
        if error is None:
            return None
        message = error.message() or ""
        return message if STUB_DEAD in message or _model_gone(error) else None

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

    async def _end_early(self, stream: _OpenStream) -> None:
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

    async def _parameters(self, model: str) -> dict[str, str]:
        try:
            config = await self._client.get_model_config(model, as_json=True, client_timeout=self._timeout)
        except InferenceServerException as exc:
            if _is_unavailable(exc):
                raise service_unavailable("the inference server is unreachable") from exc
            raise service_unavailable(f"the inference server has no model {model!r} ready") from exc
        params = config.get("config", {}).get("parameters", {})
        return {key: value.get("string_value", "") for key, value in params.items()}

    async def metadata(self, model: str | None = None) -> EngineMetadata:
        engine = await self._parameters(model or self.engine_model)
        try:  # a repository may hold the engine model alone (the frontend is then given TOKENIZER_DIR)
            tokenizer_dir = (await self._parameters(self.preprocessing_model)).get("tokenizer_dir")
        except OpenAIError:
            tokenizer_dir = None
        max_seq_len = engine.get("max_seq_len", "")
        max_top_logprobs = engine.get("max_top_logprobs", "")
        # TensorRT-LLM reads normalize_log_probs as a C++ bool (model_state.cc GetParameter<bool>); absent or
        # unparsable, it uses its default, true. Only the CPU engine's own value says "model".
        normalize = engine.get("normalize_log_probs")
        log_probs = ("model" if normalize == "model" else "sampling" if normalize in ("False", "false", "FALSE", "0")
                     else "top_k_normalized")
        # Guided decoding (audit finding 8): off when guided_decoding_backend is empty or an unfilled "${...}", and
        # on TensorRT-LLM also when xgrammar_tokenizer_info_path is (model_instance_state.cc
        # getGuidedDecodingConfigFromParams: no error, guided requests then run unguided). The CPU engine reads
        # its tokenizer from tokenizer_dir and needs no info file.
        unset = [key for key in ("guided_decoding_backend", "xgrammar_tokenizer_info_path")
                 if engine.get(key, "") in ("", "${" + key + "}")]
        guided_decoding = not unset
        if unset == ["xgrammar_tokenizer_info_path"]:  # only TensorRT-LLM reads it: which backend is this?
            name = model or self.engine_model
            try:
                config = await self._client.get_model_config(name, as_json=True, client_timeout=self._timeout)
            except InferenceServerException as exc:
                raise service_unavailable(f"the inference server has no model {name!r} ready") from exc
            guided_decoding = config.get("config", {}).get("backend") != "tensorrtllm"
        return EngineMetadata(served_model_name=engine.get("served_model_name") or None,
                              tokenizer_dir=Path(tokenizer_dir) if tokenizer_dir else None,
                              context_length=int(max_seq_len) if max_seq_len.isdigit() else None,
                              max_top_logprobs=int(max_top_logprobs) if max_top_logprobs.isdigit() else 0,
                              log_probs=log_probs, guided_decoding=guided_decoding)

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
        inputs = [_tensor("lora_task_id", np.array([[lora.task_id]], dtype=np.uint64), "UINT64")]
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
        return inputs + [_tensor("lora_weights", lora.weights[None].astype(dtype), datatype),
                         _tensor("lora_config", lora.config[None].astype(np.int32), "INT32")]

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
        stream = _OpenStream(triton_request["model_name"], version, request.request_id, call, time.monotonic(),
                             options, request.buffer, self._stream_queue)
        stream.on_overflow = lambda: self._stop_early(stream)
        stream.start_reading()
        self._stalls.open(stream)
        try:
            while not isinstance(response := await stream.next(), _Ended):
                chunk, error = response
                if error is not None:
                    raise _about_the_guide(error_for(error, model or self.engine_model), options)
                yield chunk
            if stream.failure is not None:  # the watch cancelled the call, or the budget was passed
                raise stream.failure
            if response.error is not None:
                raise _stream_failure(response.error) from response.error
        finally:
            self._stalls.close(stream)
            stream.leave()
            self._stop_early(stream)

    def _stop_early(self, stream: _OpenStream) -> None:
        """Stop a stream's engine request (`_end_early`) unless its call has ended or is being stopped."""
        if stream.reader is None or stream.reader.done() or stream.on_overflow is None:
            return
        stream.on_overflow = None  # once
        ending = asyncio.get_running_loop().create_task(self._end_early(stream))
        self._ending.add(ending)
        ending.add_done_callback(self._ending.discard)


def _stream_failure(error: BaseException) -> OpenAIError:
    """The OpenAI error for a call that failed before its end."""
    if isinstance(error, asyncio.CancelledError):  # cancelled, not by the stall watch: Triton ended it
        return engine_error("the inference server cancelled the request's stream")
    if _is_unavailable(error):
        return service_unavailable("lost the connection to the inference server")
    if isinstance(error, InferenceServerException) and is_client_error(error):
        return invalid_request(f"the engine refused the request: {client_message(error.message())}",
                               code="invalid_engine_request")
    return engine_error("the inference server's stream failed")
