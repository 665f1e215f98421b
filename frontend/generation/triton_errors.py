"""How the engine's errors reach clients: Triton's and TensorRT-LLM's errors as OpenAI errors.

Triton hands a decoupled model's error response back on the stream as text only, so an engine's refusal of what
the client sent (400), a full queue (429), a model that is not loaded or a failed engine that refuses new
requests (503) and a failure (500) are told apart by their words; the engine's message reaches clients bounded
and without TensorRT-LLM's source locations or gRPC's debug details (`client_message`). Used by the engine
client (triton_engine.py, triton_control.py) and by a stream's reader (engine_stream.py).
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from tritonclient.utils import InferenceServerException

from frontend.generation.engine import SamplingOptions
from frontend.api_types.errors import OpenAIError, engine_error, invalid_request, service_unavailable, too_many_requests

log = logging.getLogger("frontend")


def is_unavailable(exc: BaseException) -> bool:
    if isinstance(exc, grpc.RpcError):
        return exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    status = getattr(exc, "status", lambda: None)()
    text = f"{status} {exc}"
    return "UNAVAILABLE" in text or "DEADLINE_EXCEEDED" in text or "failed to connect" in text.lower()


def model_gone(error: InferenceServerException) -> bool:
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
    if model_gone(error):
        return service_unavailable(f"the engine model {engine_model!r} is not loaded")
    if any(words in message for words in ENGINE_UNAVAILABLE):
        return service_unavailable(f"the engine is unavailable: {client_message(message)}")
    if any(words in message for words in QUEUE_FULL):
        return too_many_requests(f"The engine is at capacity: {client_message(message)}", ENGINE_RETRY_AFTER_S)
    if is_client_error(error):
        return invalid_request(f"the engine refused the request: {client_message(message)}",
                               code="invalid_engine_request")
    return engine_error(f"the engine failed the request: {client_message(message)}")


def about_the_guide(error: OpenAIError, options: SamplingOptions) -> OpenAIError:
    """An engine's refusal of a guide names the request field the guide came from."""
    if options.guide is not None and error.status == 400 and "guided" in error.message:
        error.param = options.guide.param
    return error


def lora_cache_miss(message: str) -> bool:
    """Whether an engine error says its LoRA cache does not hold the task (TensorRT-LLM's words, which the CPU
    engine uses too: cpu_engine/lora.py not_in_cache): the weights are sent again."""
    return "not found in cache" in message and "LoRA task" in message


def buffer_exceeded(limit: int) -> OpenAIError:
    """The error of a request whose client left its output waiting past the request's BufferBudget."""
    return OpenAIError(503, f"the client read this response too slowly: more than {limit} bytes of generated "
                            "output waited for it, so the request was ended", "server_error", None,
                       "client_too_slow")


def stream_failure(error: BaseException) -> OpenAIError:
    """The OpenAI error for a call that failed before its end."""
    if isinstance(error, asyncio.CancelledError):  # cancelled, not by the stall watch: Triton ended it
        return engine_error("the inference server cancelled the request's stream")
    if is_unavailable(error):
        return service_unavailable("lost the connection to the inference server")
    if isinstance(error, InferenceServerException) and is_client_error(error):
        return invalid_request(f"the engine refused the request: {client_message(error.message())}",
                               code="invalid_engine_request")
    return engine_error("the inference server's stream failed")
