"""Triton glue for the CPU engine: the TensorRT-LLM backend's tensor interface on the Python backend.

Decoupled: `execute()` only parses each request and hands it to the engine loop (`cpu_engine`; a request
whose guide must be compiled first, to the guide-compile pool: see below), which answers through the request's response sender: one response per new token when `streaming` is true,
one response with every token otherwise; the last response carries the FINAL flag. Shapes follow the
TensorRT-LLM backend: `output_ids` [1, beams, len], `sequence_length` [1, beams], and so on.

Guided decoding (TensorRT-LLM's inputs `guided_decoding_guide_type` and `guided_decoding_guide`): on when the
parameter `guided_decoding_backend` is "xgrammar", with the tokenizer of the `tokenizer_dir` parameter
(cpu_engine.guided). execute() looks a request's guide up in the compiler's cache: a cached guide's request
goes to the engine at once, like a request without a guide. An uncached guide is compiled on a small pool
of threads (cpu_engine.guide_pool: 2 threads, at most 16 distinct guides compiling or waiting to, at most
256 requests waiting for them; past that a request is refused at once with "the guide compile queue is
full ..."), never on Triton's execute() thread, so one client's slow schemas do not hold up other requests'
submissions, and never on the engine thread, which only ever runs the matchers. When the compile ends the
request goes to the engine from that thread (so it may start after requests that arrived later), or gets
its error response ("invalid guided_decoding_guide ..."). A client that goes away meanwhile is found by the
engine's cancellation poll once the request is in the engine; a `stop` for its id answers it at once (see
below); finalize() closes the pool, and a request whose compile ends after that gets an error response.

Cancellation: a request whose client went away (Triton's `is_cancelled()`) is cancelled by identity and
ends with a plain FINAL response; the `stop` input (TensorRT-LLM semantics: cancel the requests that
carry this request id) ends those requests with an error response, since their clients are still there
(those still waiting for their guide to compile included).

If the engine thread dies (see cpu_engine.engine), every open request gets an error response, every later
request is refused at once with an error response, and the model asks Triton to unload it, so that Triton
reports it not ready where it can. Measured with the tritonserver 2.51 of the nvidia-pytriton wheel
(tests/integration/test_engine_knobs.py; the stub-exit case with a toy decoupled Python model):
- In `--model-control-mode=explicit` (with `--load-model=*`), `pb_utils.unload_model(<own name>)` returns
  at once and the unload starts: `/v2/models/<name>/ready` is 400 (gRPC ModelReady false) from then on,
  and so is the ensemble's (Triton tracks composing models), so a readiness check built on
  is_model_ready (the frontend's /health/ready) fails; requests get "Request for unknown model: '<name>'
  has no available versions" at once; finalize() runs ~1.5 s later. `/v2/health/ready` is 400 only while
  the unload is in progress, then 200 again (strict readiness counts loaded models only). Loading the
  model again (POST /v2/repository/models/<name>/load) brings a fresh engine, and the ensemble with it.
- In the default mode (none) Triton refuses the unload ("explicit model load / unload is not allowed if
  polling is enabled"): nothing can make the model not ready. It stays READY, and the dead engine refuses
  every request at once with an error response naming the failure, until tritonserver restarts.
- This Python backend has no other way to mark a model not ready: readiness is the model's load state. A
  stub process that exits (os._exit) leaves the model and the server READY; every later request waits
  ~1 s and then gets "Stub process '<model>_0_0' is not healthy.", and the stub is not restarted. Worse
  than refusing at once, so the stub stays up.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import signal
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from cpu_engine.config import EngineConfig
from cpu_engine.engine import Engine
from cpu_engine.guide_pool import GuidePool
from cpu_engine.lora import LoraAdapter, LoraCache
from cpu_engine.sampling import SampledToken, SamplingParams
from cpu_engine.scheduler import (STOPPED_BY_ID, EngineStats, FinishReason, GenerationRequest, RequestError,
                                  new_request_id)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
STACK_DUMP_SIGNAL = signal.SIGUSR1  # launcher.tritonserver.STACK_DUMP_SIGNAL sends it


def _scalar(request, name: str, default=None):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    values = tensor.as_numpy().reshape(-1)
    return values[0].item() if values.size else default


def _string(request, name: str) -> str | None:
    """A TYPE_STRING [1] input as text (Triton hands the Python backend bytes), or None when absent or empty."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    if not values.size:
        return None
    value = values[0]
    if isinstance(value, (bytes, np.bytes_)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(f"{name} is not valid UTF-8: {exc}") from exc
    return str(value) or None


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


class TritonChannel:
    """The engine's round trips to the Triton process, made from several threads at once: a step's
    responses (queued by `send`, delivered by `flush`) and the cancellation polls.

    A decoupled Python-backend send is a synchronous round trip: the stub waits until the Triton
    process has taken the response (with the GIL released); so is `is_cancelled()`. One after another,
    16 streams' sends took ~12 ms of a ~120 ms batch-16 step here; from 8 threads, ~5 ms. `flush()`, which
    the engine calls after every step, hands the step's responses to the delivery threads and returns:
    they go out while the next step computes instead of holding it up (mostly waiting on the other
    process, not computing). Before handing over a step's responses it waits for the previous step's, so
    one request's responses go out in order, from one thread at a time, and at most one step's
    responses are in flight; `wait()` (and `close()`) wait for them.

    A thread makes several round trips in a row: a step's senders (a poll's requests) are split into at most
    `threads` parts of at least SEND_CHUNK senders (POLL_CHUNK requests), since every part handed to a thread
    costs the stub a future, a wake-up and GIL hand-overs beside the engine thread, more than a round trip.
    A poll of fewer than 2 x POLL_CHUNK requests runs on the calling thread (the engine's poll helper, beside
    the step). On 2 cores, `tiny` preset, 32 streams (benchmarks/README.md, "Overhead-bound stack"), one
    future per sender and per polled request cost the stub ~25 µs more per output token (432 against 457,
    medians of 8 interleaved rounds).
    """

    THREADS = 8
    SEND_CHUNK = 4
    POLL_CHUNK = 32

    def __init__(self, threads: int = THREADS):
        self._threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="triton-channel") if threads > 1 else None
        self._queued: dict[int, tuple[object, list[tuple[object, int]]]] = {}
        self._in_flight: list[Future] = []

    def send(self, sender, response=None, flags: int = 0) -> None:
        self._queued.setdefault(id(sender), (sender, []))[1].append((response, flags))

    def flush(self) -> None:
        self.wait()
        queued, self._queued = list(self._queued.values()), {}
        if self._pool is None:
            _log_send_errors(_deliver_all(queued))
        else:
            self._in_flight = [self._pool.submit(_deliver_all, part)
                               for part in _parts(queued, self.SEND_CHUNK, self._threads)]

    def wait(self) -> None:
        """Until the responses handed over by the last `flush()` are delivered."""
        in_flight, self._in_flight = self._in_flight, []
        _log_send_errors([error for future in in_flight for error in future.result()])

    def cancelled(self, requests: list[GenerationRequest]) -> list[bool]:
        """Whether Triton has cancelled each request (client gone): one round trip each, made together."""
        parts = _parts(requests, self.POLL_CHUNK, self._threads)
        if self._pool is None or len(parts) == 1:
            return _poll(requests)
        return [cancelled for part in self._pool.map(_poll, parts) for cancelled in part]

    def close(self) -> None:
        self.flush()
        self.wait()
        if self._pool is not None:
            self._pool.shutdown()


def _log_send_errors(errors: list[Exception | None]) -> None:
    for error in errors:
        if error is not None:  # e.g. the client went away meanwhile; the others go on
            pb_utils.Logger.log_warn(f"sending a response failed: {error}")


def _parts(items: list, at_least: int, most: int) -> list[list]:
    """`items` in order, split into at most `most` parts of at least `at_least` items (one part when fewer)."""
    count = max(1, min(most, len(items) // max(at_least, 1)))
    size = -(-len(items) // count) if items else 1
    return [items[i:i + size] for i in range(0, len(items), size)] or [[]]


def _poll(requests: list[GenerationRequest]) -> list[bool]:
    return [request.sink.sender.is_cancelled() for request in requests]


def _deliver_all(queued: list[tuple[object, list[tuple[object, int]]]]) -> list[Exception | None]:
    return [_deliver(sender, responses) for sender, responses in queued]


def _deliver(sender, responses: list[tuple[object, int]]) -> Exception | None:
    try:
        for response, flags in responses:
            sender.send(response, flags=flags)
    except Exception as error:
        return error
    return None


class TritonSink:
    """Turns the scheduler's per-token results into Triton responses for one request.

    Only the outputs the client asked for are built: Triton hands the model every output as requested
    when the client names none, and a streaming client that reads `output_ids` alone (the frontend
    without logprobs) then gets one tensor per token instead of four, which is less work on the engine
    thread, in Triton and in the client.
    """

    def __init__(self, sender, channel: TritonChannel, streaming: bool, prompt: list[int], exclude_input: bool,
                 top_logprobs: int, outputs: frozenset[str]):
        self.sender = sender
        self.channel = channel
        self.streaming = streaming
        self.prefix = [] if exclude_input else list(prompt)
        self.top_logprobs = top_logprobs
        self.outputs = outputs
        self.pending: list[SampledToken] = []
        self.cum_logprob = 0.0

    def _response(self, prefix: list[int], tokens: list[SampledToken]):
        ids = prefix + [t.token for t in tokens]
        wanted = self.outputs
        outputs = []
        if "output_ids" in wanted:
            outputs.append(pb_utils.Tensor("output_ids", np.asarray(ids, dtype=np.int32).reshape(1, 1, -1)))
        if "sequence_length" in wanted:
            outputs.append(pb_utils.Tensor("sequence_length", np.asarray([[len(ids)]], dtype=np.int32)))
        if "cum_log_probs" in wanted:
            outputs.append(pb_utils.Tensor("cum_log_probs", np.asarray([[self.cum_logprob]], dtype=np.float32)))
        if "output_log_probs" in wanted:
            logprobs = [0.0] * len(prefix) + [t.logprob for t in tokens]
            outputs.append(pb_utils.Tensor("output_log_probs",
                                           np.asarray(logprobs, dtype=np.float32).reshape(1, 1, -1)))
        if self.top_logprobs and wanted & {"output_top_log_prob_ids", "output_top_log_probs"}:
            k = self.top_logprobs
            top_ids = np.zeros((1, len(tokens), k), dtype=np.int32)
            top_values = np.full((1, len(tokens), k), -np.inf, dtype=np.float32)
            for row, token in enumerate(tokens):
                for col, (alt, value) in enumerate(token.top[:k]):
                    top_ids[0, row, col], top_values[0, row, col] = alt, value
            outputs += [pb_utils.Tensor(name, array) for name, array in
                        (("output_top_log_prob_ids", top_ids), ("output_top_log_probs", top_values)) if name in wanted]
        return pb_utils.InferenceResponse(output_tensors=outputs)

    def send(self, tokens: list[SampledToken], finish: FinishReason | None) -> None:
        self.cum_logprob += sum(t.logprob for t in tokens)
        self.pending.extend(tokens)
        if not self.streaming and finish is None:
            return
        flags = FINAL if finish is not None else 0
        if self.pending or self.prefix:
            self.channel.send(self.sender, self._response(self.prefix, self.pending), flags)
        elif finish is not None:
            self.channel.send(self.sender, flags=FINAL)
        self.prefix, self.pending = [], []

    def send_error(self, message: str) -> None:
        self.channel.send(self.sender, pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), FINAL)


def never_destroyed(*objects: object) -> None:
    """Keep Python-backend metric objects alive until the stub process ends, on purpose.

    Their teardown is broken in this Triton (2.51): destroyed by the interpreter's shutdown after finalize()
    (MetricFamily::~MetricFamily -> Metric::Clear -> SaveToSharedMemory, once the stub's shared memory is
    gone) they segfaulted the stub at every unload of this model; destroyed in finalize() instead (metrics
    first, then families) they corrupted the heap ("malloc(): unaligned fastbin chunk detected"). With a
    reference no one releases, no destructor runs: the process exits with them. What is lost was lost
    before: the stub never told Triton to drop the series, so an unloaded version's last values stay on
    Triton's metrics port. tests/integration/test_model_versions.py checks that unloads are clean."""
    for obj in objects:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


class EngineMetrics:
    """The engine's state as Triton custom metrics, served on Triton's metrics port next to nv_*."""

    GAUGES = {
        "active_slots": "KV-cache slots held by running requests",
        "max_slots": "KV-cache slots in the engine (max_batch_size)",
        "queued_requests": "requests waiting for a slot",
        "kv_cache_used_tokens": "tokens held in the KV cache by running requests",
        "kv_cache_capacity_tokens": "tokens the KV cache can hold (cpu_kv_cache_tokens, in whole blocks)",
        "kv_cache_blocks_used": "KV-cache blocks held by running requests (a block shared by several counts once)",
        "kv_cache_blocks_total": "KV-cache blocks in the engine",
        "kv_cache_usage_ratio": "KV-cache blocks used / total (0..1), for routers and autoscalers",
        "requests_running": "requests in the running batch",
        "requests_waiting": "requests waiting to run (queued or preempted)",
        "last_step_tokens": "tokens in the most recent engine step (decode tokens + prompt chunks)",
    }
    COUNTERS = {
        "steps_total": "engine steps run",
        "prompt_tokens_total": "prompt tokens prefilled",
        "generated_tokens_total": "tokens generated",
        "cancelled_requests_total": "requests that ended cancelled, waiting or running (client gone or a stop "
                                    "request)",
        "prefix_cache_queries_tokens_total": "prompt tokens looked up in the prefix cache",
        "prefix_cache_hits_tokens_total": "prompt tokens found in the prefix cache (their prefill skipped)",
        "preemptions_total": "running requests set back to wait because the KV cache was full (they resume "
                             "where they were)",
    }

    def __init__(self, model_name: str, model_version: str):
        # Two versions of a model run side by side during a rollout, each in its own stub process.
        labels = {"model": model_name, "version": model_version}
        # Triton requires each MetricFamily to outlive its Metrics, so the families are kept here.
        self._families = {
            field: pb_utils.MetricFamily(name=f"cpu_engine_{field}", description=text, kind=kind)
            for fields, kind in ((self.GAUGES, pb_utils.MetricFamily.GAUGE),
                                 (self.COUNTERS, pb_utils.MetricFamily.COUNTER))
            for field, text in fields.items()}
        self._gauges = {field: self._families[field].Metric(labels=labels) for field in self.GAUGES}
        self._counters = {field: self._families[field].Metric(labels=labels) for field in self.COUNTERS}
        never_destroyed(*self._families.values(), *self._gauges.values(), *self._counters.values())
        self._counted = dict.fromkeys(self.COUNTERS, 0)

    def publish(self, stats: EngineStats) -> None:
        for field, metric in self._gauges.items():
            metric.set(float(getattr(stats, field)))
        for field, metric in self._counters.items():
            value = getattr(stats, field)
            if value > self._counted[field]:
                metric.increment(float(value - self._counted[field]))
                self._counted[field] = value


class TritonPythonModel:
    # A named model's version reads its own directory; the TensorRT-LLM contract double turns this off, since
    # the C++ backend knows only gpt_model_path (the `live` link).
    reads_version_directory = True

    def initialize(self, args):
        # `kill -USR1 <stub pid>` writes every thread's Python stack to Triton's log, the stub's stderr: a model
        # whose load or step never ends can be read in place (the launcher does it when a load times out).
        faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(
                "the CPU engine model must be decoupled (model_transaction_policy { decoupled: true })")
        engine_dir, tokenizer_dir = Path(_param(config, "gpt_model_path", "")), _param(config, "tokenizer_dir", "")
        # A named model's version directory holds its own engine record and checkpoint (build_engine/
        # model_store.py): read those, not the paths of the shared config, which name the `live` link.
        version_dir = Path(args["model_repository"]) / args["model_version"]
        if self.reads_version_directory and (version_dir / "engine" / "engine_config.json").is_file():
            engine_dir, tokenizer_dir = version_dir / "engine", str(version_dir / "checkpoint")
        self.exclude_input_default = _param(config, "exclude_input_in_output", "false").lower() == "true"
        self.max_top_logprobs = int(_param(config, "max_top_logprobs", "20") or 0)
        engine_config = EngineConfig.from_engine_dir(
            engine_dir, num_threads=int(_param(config, "cpu_num_threads", "0") or 0),
            max_num_tokens=int(_param(config, "max_num_tokens", "0") or 0),
            prefill_step_ratio=float(_param(config, "cpu_prefill_step_ratio", "1.75") or 1.75),
            kv_cache_tokens=int(_param(config, "cpu_kv_cache_tokens", "0") or 0),
            enable_prefix_reuse=_param(config, "enable_kv_cache_reuse", "true").lower() == "true",
            cpu_dtype=_param(config, "cpu_dtype", "engine") or "engine",
            kv_cache_dtype=_param(config, "cpu_kv_cache_dtype", "auto") or "auto")
        self.model_name = args["model_name"]
        guided_backend = _param(config, "guided_decoding_backend", "")
        if guided_backend not in ("", "xgrammar"):
            raise pb_utils.TritonModelException(
                f"guided_decoding_backend must be \"\" (off) or \"xgrammar\", got {guided_backend!r}")
        # The metric families are made last, once the model has loaded: a stub whose initialize() fails with
        # Python-backend metric families alive was seen to segfault in their teardown (MetricFamily::
        # ~MetricFamily -> Metric::Clear), taking tritonserver down with it (a rollout to a corrupt version).
        self.metrics: EngineMetrics | None = None
        self.channel = self._make_channel()
        self.engine = Engine.from_config(
            engine_config, cancelled=self.channel.cancelled, on_stats=self._publish_stats,
            after_step=self._after_step, on_failure=self._engine_failed,
            max_queued=int(_param(config, "cpu_max_queue_size", "0") or 0),
            cancel_poll_s=int(_param(config, "cancellation_check_period_ms", "20") or 20) / 1000)
        self.engine.start()  # loads the weights and measures the machine, on the engine's own thread
        pb_utils.Logger.log_info(self.engine.describe())
        self.guide_compiler = None
        self.guide_pool = None  # compiles uncached guides off execute()'s thread (cpu_engine.guide_pool)
        if guided_backend == "xgrammar":
            from cpu_engine.guided import GuideCompiler  # imports xgrammar: only when guided decoding is on

            tokenizer_dir = tokenizer_dir or str(engine_config.checkpoint_dir)
            try:
                self.guide_compiler = GuideCompiler.from_tokenizer_dir(
                    tokenizer_dir, vocab_size=self.engine.scheduler.runner.vocab_size)
            except Exception:  # the model fails to load: its engine thread must not outlive it
                self.engine.stop()
                raise
            self.guide_pool = GuidePool(self.guide_compiler)
            pb_utils.Logger.log_info(f"guided decoding: xgrammar, tokenizer from {tokenizer_dir}")
        # LoRA (cpu_engine.lora): TensorRT-LLM's cache parameters; the host budget is the CPU engine's whole cache.
        self.lora_budget = int(_param(config, "lora_cache_host_memory_bytes", "") or 1 << 30)
        self.lora_max_rank = int(_param(config, "lora_cache_max_adapter_size", "") or 64)
        self.lora_cache: LoraCache | None = None  # made on the first LoRA request (it needs the loaded model)
        self.metrics = EngineMetrics(self.model_name, args["model_version"])

    def _publish_stats(self, stats: EngineStats) -> None:
        if self.metrics is not None:  # None until initialize() has succeeded
            self.metrics.publish(stats)

    def _make_channel(self) -> TritonChannel:
        """The engine's way to Triton (a subclass may hold responses back: tests/integration/engine_knobs.py)."""
        return TritonChannel()

    def _after_step(self) -> None:
        """Runs on the engine thread after every step: deliver the step's responses before the next one."""
        self.channel.flush()

    def _engine_failed(self, reason: str) -> None:
        """The engine thread died (its open requests already got their errors): take the model out of
        service. From a thread of its own, so that the unload (which runs finalize()) never waits on the
        engine thread that calls this."""
        pb_utils.Logger.log_error(f"{self.model_name}: the CPU engine failed ({reason}); unloading the model so "
                                  f"that Triton reports it not ready")
        threading.Thread(target=self._unload_self, name="cpu-engine-unload", daemon=True).start()

    def _unload_self(self) -> None:
        try:
            pb_utils.unload_model(self.model_name)  # the ensemble goes not-ready with it by itself
        except Exception as exc:  # Triton not in explicit model-control mode: readiness cannot change
            pb_utils.Logger.log_error(
                f"{self.model_name}: could not unload the failed model ({exc}); Triton keeps reporting it "
                f"ready (start tritonserver with --model-control-mode=explicit --load-model=* for readiness "
                f"to follow engine failures), and every request is refused at once until it is reloaded")

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._enqueue(request, sender)
            except (RequestError, ValueError) as exc:  # includes EngineFailedError: a dead engine refuses
                self._refuse(sender, str(exc))
        return None

    def _refuse(self, sender, message: str) -> None:
        """Answer a request the engine does not have with its error response (FINAL): refused in execute(), or
        later, when its guide compiled (or did not) on a guide-compile thread (a subclass may hook this:
        tests/integration/engine_knobs.py)."""
        sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), flags=FINAL)

    def _enqueue(self, request, sender) -> None:
        request_id = request.request_id() or new_request_id()
        if _scalar(request, "stop", False):
            # TensorRT-LLM semantics: stop=true cancels the requests that have the same request id; they
            # end with an error response ("cancelled by a stop request"), this one with an empty final one.
            # Those still waiting for their guide first: a compile that ends meanwhile submits its requests
            # before the pool's stop() returns, so the engine's cancel_by_id, after it, finds them.
            if self.guide_pool is not None:
                self.guide_pool.stop(request_id, STOPPED_BY_ID)
            self.engine.cancel_by_id(request_id)
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
        top_logprobs = max(0, min(int(_scalar(request, "top_logprobs", 0)), self.max_top_logprobs))
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
            top_logprobs=top_logprobs,
        )
        guide_inputs = self._guide_inputs(request)
        lora = self._lora(request)
        generation = GenerationRequest(
            request_id=request_id,
            prompt=prompt,
            max_new_tokens=int(output_len),
            sink=self._make_sink(sender, streaming, prompt, exclude, top_logprobs,
                                 frozenset(request.requested_output_names())),
            sampling=sampling,
            end_id=None if end_id is None else int(end_id),
            stop_words=_word_list(request, "stop_words_list"),
            lora=lora,
        )
        if guide_inputs is not None:
            # Not assigned to `generation` here: a compile may end, and submit it, before this returns.
            guide = self.guide_pool.guide(*guide_inputs, request_id,
                                          lambda guide, error: self._guide_compiled(generation, sender, guide, error))
            if guide is None:  # compiling: submitted (or refused) by _guide_compiled, on a compile thread
                return
            generation.guide = guide
        self.engine.submit(generation)

    def _lora(self, request) -> LoraAdapter | None:
        """The request's LoRA adapter (lora_task_id; lora_weights and lora_config when the cache may not hold it),
        or None for the base model; RequestError as TensorRT-LLM words it for a task the cache does not hold."""
        task_id = _scalar(request, "lora_task_id")
        weights = pb_utils.get_input_tensor_by_name(request, "lora_weights")
        config = pb_utils.get_input_tensor_by_name(request, "lora_config")
        if task_id is None:
            if weights is not None or config is not None:
                raise RequestError("lora_weights and lora_config need a lora_task_id")
            return None
        if self.lora_cache is None:
            self.lora_cache = LoraCache(self.engine.scheduler.runner.lora_shapes, self.lora_budget, self.lora_max_rank)
        return self.lora_cache.resolve(int(task_id), None if weights is None else weights.as_numpy(),
                                       None if config is None else config.as_numpy())

    def _guide_inputs(self, request) -> tuple[str | None, str | None] | None:
        """The request's (guided_decoding_guide_type, guided_decoding_guide), or None when it asks for no
        guide; RequestError when guided decoding is off."""
        guide_type = _string(request, "guided_decoding_guide_type")
        guide = _string(request, "guided_decoding_guide")
        if guide_type is None and guide is None:
            return None
        if self.guide_pool is None:
            raise RequestError("guided decoding is off on this engine (guided_decoding_backend)")
        return guide_type, guide

    def _guide_compiled(self, generation: GenerationRequest, sender, guide, error: str | None) -> None:
        """A request's guide compiled (`guide`) or did not (`error`): submit the request, or answer its error.
        Runs on a guide-compile thread (cpu_engine.guide_pool); once finalize() closed the pool, only with the
        pool's error (the engine is never given a request after it stopped)."""
        if error is None:
            generation.guide = guide
            try:
                self.engine.submit(generation)
                return
            except (RequestError, ValueError) as exc:  # as in execute()
                error = str(exc)
            except Exception as exc:  # execute() would have let Triton answer it; here nobody else would
                pb_utils.Logger.log_error(f"submitting request {generation.request_id!r} after its guide "
                                          f"compiled failed: {type(exc).__name__}: {exc}")
                error = f"internal error: {type(exc).__name__}: {exc}"
        try:
            self._refuse(sender, error)
        except Exception as exc:  # e.g. its client went away meanwhile
            pb_utils.Logger.log_warn(f"sending a response failed: {exc}")

    def _make_sink(self, sender, streaming: bool, prompt: list[int], exclude_input: bool, top_logprobs: int,
                   outputs: frozenset[str]) -> TritonSink:
        """One request's responses (a subclass may shape them otherwise: tests/trtllm_contract/double.py)."""
        return TritonSink(sender, self.channel, streaming, prompt, exclude_input, top_logprobs, outputs)

    def finalize(self):
        if self.guide_pool is not None:  # first: no request may reach the engine once it stops
            self.guide_pool.close()
        self.engine.stop()
        self.channel.close()
