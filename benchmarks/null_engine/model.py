"""A zero-cost engine for `make bench-frontend`: the TensorRT-LLM tensor interface, no model behind it.

Decoupled Python-backend model. Per request it sends `request_output_len` responses of one token each
(`streaming` true; one response with every token otherwise) as fast as the Python backend carries them,
the last one with the FINAL flag (as the TensorRT-LLM backend and the CPU engine do: no separate empty
final response). The tokens cycle through the `null_engine_token_ids` parameter (ids of plain words
under the served tokenizer, written by benchmarks/null_engine/__init__.py), never the request's `end_id`,
so the frontend detokenizes ordinary text and never sees an end of sequence.

One thread serves every open request round-robin (one token per request per round, as an in-flight
batching engine's step would), so concurrent streams interleave. Cancellation (`is_cancelled()`, a
round trip to the Triton process) is looked at every CANCEL_CHECK_EVERY tokens of a request; a cancelled
request ends with a plain FINAL response. `stop` (TensorRT-LLM's cancel-by-id) is answered with an empty
FINAL response and cancels nothing: the benchmark never sends it.

Needs numpy and triton_python_backend_utils only (no torch), so its stub costs what the Python backend
costs and nothing else.
"""

from __future__ import annotations

import json
import queue
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CANCEL_CHECK_EVERY = 16
TOKEN_IDS_PARAMETER = "null_engine_token_ids"
ALL_OUTPUTS = frozenset({"output_ids", "sequence_length", "cum_log_probs", "output_log_probs"})


def _scalar(request, name: str, default=None):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    values = tensor.as_numpy().reshape(-1)
    return values[0].item() if values.size else default


def _param(config: dict, key: str, default: str) -> str:
    value = config.get("parameters", {}).get(key, {}).get("string_value", default)
    return default if value.startswith("${") else value


class _Stream:
    __slots__ = ("sender", "tokens", "position", "remaining", "sent", "prefix", "streaming", "outputs")

    def __init__(self, sender, tokens: list[int], position: int, remaining: int, prefix: list[int],
                 streaming: bool, outputs: frozenset[str]):
        self.sender = sender
        self.tokens = tokens
        self.position = position
        self.remaining = remaining
        self.sent = 0
        self.prefix = prefix
        self.streaming = streaming
        self.outputs = outputs

    def next_ids(self, count: int) -> list[int]:
        n = len(self.tokens)
        ids = [self.tokens[(self.position + i) % n] for i in range(count)]
        self.position = (self.position + count) % n
        return ids


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("the null engine must be decoupled")
        self.model_name = args["model_name"]
        ids = [int(t) for t in _param(config, TOKEN_IDS_PARAMETER, "").split(",") if t.strip()]
        if not ids:
            raise pb_utils.TritonModelException(f"parameter {TOKEN_IDS_PARAMETER} (comma-separated token ids) "
                                                "is empty")
        self.token_ids = ids
        self.token_set = frozenset(ids)
        self.exclude_input_default = _param(config, "exclude_input_in_output", "true").lower() == "true"
        # One token's tensors, made once: a response only wraps them (numpy arrays, not pb_utils.Tensors,
        # which the backend moves into shared memory when a response is sent).
        self.one_id = {t: np.array([[[t]]], dtype=np.int32) for t in ids}
        self.length_one = np.array([[1]], dtype=np.int32)
        self.zero_cum = np.array([[0.0]], dtype=np.float32)
        self.zero_logprob = np.array([[[0.0]]], dtype=np.float32)
        self.started = 0
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="null-engine", daemon=True)
        self.thread.start()

    # ----- Triton's thread: parse and hand over ---------------------------------------------------------
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                stream = self._stream(request, sender)
            except Exception as exc:  # a malformed request gets its error, the others go on
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))), flags=FINAL)
                continue
            if stream is not None:
                self.queue.put(stream)
        return None

    def _stream(self, request, sender) -> _Stream | None:
        if _scalar(request, "stop", False):
            sender.send(flags=FINAL)
            return None
        output_len = _scalar(request, "request_output_len")
        if output_len is None:
            raise ValueError("request_output_len is not present in the request")
        if int(output_len) <= 0:
            sender.send(flags=FINAL)
            return None
        end_id = _scalar(request, "end_id")
        tokens = self.token_ids
        if end_id is not None and int(end_id) in self.token_set:
            tokens = [t for t in tokens if t != int(end_id)] or [t + 1 for t in tokens[:1]]
        prefix: list[int] = []
        if not bool(_scalar(request, "exclude_input_in_output", self.exclude_input_default)):
            input_ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
            if input_ids is not None:
                ids = input_ids.as_numpy().reshape(-1)
                prefix = ids[: int(_scalar(request, "input_lengths", ids.size))].tolist()
        outputs = frozenset(request.requested_output_names()) or ALL_OUTPUTS
        self.started += 1
        return _Stream(sender, tokens, self.started % len(tokens), int(output_len), prefix,
                       bool(_scalar(request, "streaming", False)), outputs)

    # ----- the engine thread: one token per open request per round ---------------------------------------
    def _loop(self) -> None:
        active: list[_Stream] = []
        while True:
            if not active:
                item = self.queue.get()
                if item is None:
                    return
                active.append(item)
            while True:
                try:
                    item = self.queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    for stream in active:
                        self._send(stream, None, FINAL)
                    return
                active.append(item)
            active = [stream for stream in active if self._step(stream)]

    def _step(self, stream: _Stream) -> bool:
        """Send the stream's next response; False when it has ended."""
        if stream.sent and stream.sent % CANCEL_CHECK_EVERY == 0:
            try:
                cancelled = stream.sender.is_cancelled()
            except Exception:
                cancelled = True
            if cancelled:
                self._send(stream, None, FINAL)
                return False
        count = 1 if stream.streaming else stream.remaining
        stream.remaining -= count
        stream.sent += count
        flags = FINAL if stream.remaining <= 0 else 0
        ok = self._send(stream, self._response(stream, count), flags)
        return ok and not flags

    def _response(self, stream: _Stream, count: int):
        wanted = stream.outputs
        if count == 1 and not stream.prefix:
            token = stream.tokens[stream.position]
            stream.position = (stream.position + 1) % len(stream.tokens)
            ids, length, logprobs = self.one_id[token], self.length_one, self.zero_logprob
        else:
            values = stream.prefix + stream.next_ids(count)
            stream.prefix = []
            ids = np.asarray(values, dtype=np.int32).reshape(1, 1, -1)
            length = np.array([[len(values)]], dtype=np.int32)
            logprobs = np.zeros((1, 1, len(values)), dtype=np.float32)
        tensors = []
        if "output_ids" in wanted:
            tensors.append(pb_utils.Tensor("output_ids", ids))
        if "sequence_length" in wanted:
            tensors.append(pb_utils.Tensor("sequence_length", length))
        if "cum_log_probs" in wanted:
            tensors.append(pb_utils.Tensor("cum_log_probs", self.zero_cum))
        if "output_log_probs" in wanted:
            tensors.append(pb_utils.Tensor("output_log_probs", logprobs))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _send(self, stream: _Stream, response, flags: int) -> bool:
        try:
            if response is None:
                stream.sender.send(flags=flags)
            else:
                stream.sender.send(response, flags=flags)
            return True
        except Exception as exc:  # e.g. the client went away meanwhile: drop this stream, serve the others
            pb_utils.Logger.log_warn(f"{self.model_name}: sending a response failed: {exc}")
            return False

    def finalize(self):
        self.queue.put(None)
        self.thread.join(timeout=10)
