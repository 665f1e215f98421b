"""The TensorRT-LLM contract double: the production CPU engine model (model_repository/tensorrt_llm/1/model.py,
imported by file path) behind the rules of TensorRT-LLM's C++ backend (rules.py).

`add_contract_double(repository, "tensorrt_llm_contract", engine_dir)` (before tritonserver starts) renders
the production template with the TensorRT-LLM values (values/trtllm.json + the build's values), swaps
`backend: "tensorrtllm"` for `backend: "python"` and sets the model name: nothing else of the config
changes, so a template the real backend would refuse makes the double refuse to load, with upstream's
message. The only optional addition is the test knob `test_step_delay_s` (as in engine_knobs.py: the engine
thread sleeps that long after every step), appended as a parameter upstream ignores.

What the model does (each rule and its upstream source: rules.py):
- initialize: rules.check_model_config() (upstream's load errors, the first as upstream's load error text)
  and rules.check_interface() (the template's tensors as upstream declares them) before anything else;
  then the production model loads.
- execute: a `stop` request is answered as upstream answers it (an error without a request id; else the
  request with that id is cancelled, once it has been scheduled: rules.STOP_TAKES_EFFECT_WHEN_SCHEDULED, and
  the stop request gets an empty FINAL response). Any other request
  is checked (rules.request_violation()); what upstream refuses at enqueue gets upstream's error at once;
  the rest goes to the production `_enqueue`, with a response sink that shapes responses as upstream does
  (rules.ResponseShaper), refuses a request that did not ask for output_ids / sequence_length in place of
  its first response, reports engine errors in the executor's words, and ends a cancelled request (client
  gone, or stop) with a plain FINAL response.
- the engine: request_output_len clamped to max_seq_len - prompt (upstream clamps; the CPU engine would
  refuse), end_id and prompt length validated as the executor does, cancellation polled every
  cancellation_check_period_ms (default 100).
- the sampler and the executor's queue (rules.SAMPLER_SOURCES): a request without a seed is seeded with 0;
  output_log_probs as normalize_log_probs makes them (all 0.0 for a greedy request with it on; the CPU
  engine's own values where upstream's equal them; a request with return_log_probs whose upstream values the
  double cannot compute is refused, rules.log_prob_rule); with dynamic_batching's max_queue_size > 0, a
  request past that many waiting gets the executor's "Maximum queue size of N has been reached" at once.

- a guide that fails to compile in the engine (rules.GUIDE_FAILS_THE_BATCH): every active request ends with
  upstream's "Encountered an error in forwardAsync function: <reason>", this one included; the double logs
  each such guide (rules.GUIDE_FAILED_LOG) and counts it (metric rules.GUIDE_FAILURES_METRIC).
- a guided request with end_id -1 (rules.GUIDE_WITHOUT_END_ID_SOURCE) is logged when it arrives
  (rules.GUIDED_WITHOUT_END_ID_LOG), and fails every active request the same way once its document is
  complete; min_tokens with end_id -1 and top_k above 1024 are refused (the double's words, logged).
- the executor's TLLM_THROW / TLLM_CHECK errors carry a build path, line and stack trace (rules.tllm_error).

The production model builds each request's response sink through its `_make_sink` hook, which the
double overrides; it also wraps its engine's `submit` (the executor's checks) and sets how often the engine
polls Triton's cancellations (`Engine.cancel_poll_s`).

This module is imported in two places: by the test process (add_contract_double; no Triton there) and inside
the Python-backend stub (TritonPythonModel, built on first access as in engine_knobs.py).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
PRODUCTION_MODEL = REPO_ROOT / "model_repository" / "tensorrt_llm" / "1" / "model.py"
ENGINE_MODEL = "tensorrt_llm"
# test_lora_cache_tasks: how many LoRA tasks the emulated PEFT cache holds (rules.PeftCache; 0: unbounded).
KNOB_TYPES: dict[str, type] = {"test_step_delay_s": float, "test_lora_cache_tasks": int}
_BACKEND_LINE = re.compile(r'^backend:\s*"tensorrtllm"\s*$', re.MULTILINE)
_NAME_LINE = re.compile(r'^name:\s*"[^"]*"\s*$', re.MULTILINE)


def _load_by_path(name: str, path: Path) -> ModuleType:
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


if __package__:
    from . import rules
else:  # loaded by file path inside the Triton stub, where tests/ is no package
    rules = _load_by_path("trtllm_contract_rules", Path(__file__).resolve().with_name("rules.py"))


# ----- the test side: adding the double to a model repository ---------------------------------------------
def add_contract_double(repository: Path, name: str, engine_dir: Path,
                        template_dir: Path = REPO_ROOT / "model_repository", *,
                        parameters: dict[str, str] | None = None, max_queue_size: int | None = None,
                        **knobs: float) -> None:
    """Write `repository/<name>`: the production template rendered with the TensorRT-LLM values for the
    CPU engine build in `engine_dir` (its engine_config.json), as a Python model running this file's
    TritonPythonModel. `parameters` and `max_queue_size` change what a deployment may change in the rendered
    config (see contract_config). Raises ValueError for a name that is not a plain model name or is taken, an
    unknown knob, or a rendered config that does not hold exactly one `backend: "tensorrtllm"` line."""
    from build_engine.render import render_repository  # test process only: no build_engine in the stub
    from build_engine.values import repository_values
    from build_engine.xgrammar_info import write_tokenizer_info

    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name) or name == ENGINE_MODEL:
        raise ValueError(f"not a usable model name for the contract double: {name!r}")
    target = Path(repository) / name
    if target.exists():
        raise ValueError(f"{target} already exists")
    engine_dir = Path(engine_dir)
    engine_config = json.loads((engine_dir / "engine_config.json").read_text())
    # A TensorRT-LLM build writes the guided-decoding tokenizer info beside its engine; a CPU build has none.
    tokenizer_info = target / "xgrammar_tokenizer_info.json"
    write_tokenizer_info(Path(engine_config["checkpoint_dir"]), tokenizer_info)
    engine_config = {**engine_config, "xgrammar_tokenizer_info": str(tokenizer_info)}
    values = repository_values(Path(template_dir), "trtllm", engine_config, engine_dir)
    with tempfile.TemporaryDirectory(prefix="trtllm_contract_") as scratch:
        rendered = Path(scratch) / "model_repository"
        render_repository(Path(template_dir), values, rendered)
        text = (rendered / ENGINE_MODEL / "config.pbtxt").read_text()
    config = contract_config(text, name, knobs, parameters, max_queue_size)
    (target / "1").mkdir(parents=True, exist_ok=True)
    (target / "config.pbtxt").write_text(config)
    (target / "1" / "model.py").write_text(_loader_source(name))


def make_named_contract_doubles(repository: Path, template_dir: Path = REPO_ROOT / "model_repository",
                                **knobs: float) -> None:
    """Turn a repository of CPU-engine named models (`build_engine --name`, build_engine/model_store.py) into
    the TensorRT-LLM layout, each model run by the double: the shared config rendered with the TensorRT-LLM
    values (paths through the `live` link, as a TensorRT-LLM named build renders them) and each version's
    model.py the double's loader. The double reads its engine through gpt_model_path only, as upstream does,
    so a rollout works here only if the link points at the version being loaded. `knobs` as for
    add_contract_double (the step delay), for every model."""
    from build_engine import model_store  # test process only
    from build_engine.pipeline import BuildRequest, XGRAMMAR_INFO_FILE, version_config
    from build_engine.xgrammar_info import write_tokenizer_info

    for model in model_store.managed_models(Path(repository)):
        for version in model.versions():
            write_tokenizer_info(model.checkpoint_dir(version), model.engine_dir(version) / XGRAMMAR_INFO_FILE)
            (model.version_dir(version) / "model.py").write_text(_loader_source(model.name))
        live = model.live_version
        engine_config = {**model.record(live), "xgrammar_tokenizer_info": str(model.engine_dir(live) / XGRAMMAR_INFO_FILE)}
        rendered = version_config(Path(template_dir), BuildRequest(output_dir=Path(repository).parent, backend="trtllm"),
                                  engine_config, model, live)
        model.config_path.write_text(contract_config(rendered, model.name, knobs))


def contract_config(rendered: str, name: str, knobs: dict[str, float] | None = None,
                    parameters: dict[str, str] | None = None, max_queue_size: int | None = None) -> str:
    """The rendered TensorRT-LLM config with exactly two changes: the backend line and the model name (plus
    the knobs, appended as parameters, if any). A test that needs another deployment's setting may also set
    the value of parameters the rendered config holds (`parameters`, e.g. normalize_log_probs) and
    dynamic_batching's max_queue_size (the executor's queue bound: rules.max_queue_size)."""
    knobs = dict(knobs or {})
    unknown = sorted(set(knobs) - set(KNOB_TYPES))
    if unknown:
        raise ValueError(f"unknown knob(s) {unknown}; known: {sorted(KNOB_TYPES)}")
    backends = _BACKEND_LINE.findall(rendered)
    if len(backends) != 1:
        raise ValueError(f'expected exactly one line `backend: "tensorrtllm"` in the rendered TensorRT-LLM '
                         f"config, found {len(backends)}: the template or values/trtllm.json changed")
    if len(_NAME_LINE.findall(rendered)) != 1:
        raise ValueError("expected exactly one top-level name line in the rendered TensorRT-LLM config")
    text = _BACKEND_LINE.sub('backend: "python"', rendered)
    text = _NAME_LINE.sub(f'name: "{name}"', text)
    for key, value in (parameters or {}).items():
        text, count = re.subn(rf'(key: "{re.escape(key)}"\s*value: {{ string_value: )"[^"]*"',
                              lambda match: f'{match.group(1)}"{value}"', text)
        if count != 1:
            raise ValueError(f"the rendered TensorRT-LLM config holds parameter {key!r} {count} times, not once")
    if max_queue_size is not None:
        text, count = re.subn(r"(default_queue_policy:\s*\{\s*max_queue_size:\s*)\d+",
                              lambda match: f"{match.group(1)}{int(max_queue_size)}", text)
        if count != 1:
            raise ValueError("the rendered TensorRT-LLM config has no dynamic_batching default_queue_policy")
    if knobs:
        parameters = "".join(
            f'parameters: {{\n  key: "{key}"\n  value: {{ string_value: "{KNOB_TYPES[key](value)}" }}\n}}\n'
            for key, value in knobs.items())
        comment = "# Test knobs (tests/trtllm_contract/double.py); TensorRT-LLM ignores them."
        text = f"{text.rstrip()}\n{comment}\n{parameters}"
    return text


def _loader_source(name: str) -> str:
    """The double's model.py: loads this file by path (tests/ is not an installed package)."""
    return (f'"""Test-only model {name!r}: the TensorRT-LLM contract double (generated by '
            f'tests/trtllm_contract/double.py)."""\n'
            "import importlib.util\n"
            "import sys\n\n"
            f"_spec = importlib.util.spec_from_file_location('trtllm_contract_double', "
            f"{str(Path(__file__).resolve())!r})\n"
            "_module = importlib.util.module_from_spec(_spec)\n"
            "sys.modules['trtllm_contract_double'] = _module\n"
            "_spec.loader.exec_module(_module)\n"
            "TritonPythonModel = _module.TritonPythonModel\n")


# ----- the Triton side ---------------------------------------------------------------------------------------
class FinishableSender:
    """A request's response sender that answers `is_cancelled()` itself once the double has sent the request's
    final response ahead of the engine (an error in place of the first response, a stopped request): the
    engine polls its live requests, and asking Triton about a finished one crashes tritonserver 2.51
    (SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled, seen here). As finished, it reads as cancelled, so
    the engine drops the request at its next step."""

    def __init__(self, sender: Any):
        self._sender = sender
        self.finished = False
        self.scheduled = False  # the request has had a step (rules.STOP_TAKES_EFFECT_WHEN_SCHEDULED)

    def send(self, *args: Any, **kwargs: Any) -> Any:
        return self._sender.send(*args, **kwargs)

    def is_cancelled(self) -> bool:
        """Triton's cancellation reaches the executor's cancelRequest() (WaitForCancel), which ends a request
        only once it is scheduled (rules.STOP_TAKES_EFFECT_WHEN_SCHEDULED): not asked before then."""
        return self.finished or (self.scheduled and self._sender.is_cancelled())


@dataclass(frozen=True)
class _Pending:
    """What the double learnt of the request the production `_enqueue` is turning into an engine request."""
    triton_id: str
    return_log_probs: bool
    response_error: str | None  # upstream's error in place of the first response
    zero_log_probs: bool = False  # rules.log_prob_rule(): every output_log_probs value 0.0
    guided_without_end_id: bool = False  # rules.guided_without_end_id(): its complete document fails the batch


def _build_model_class() -> type:
    production = _load_by_path("trtllm_contract_production_model", PRODUCTION_MODEL)
    pb_utils = production.pb_utils
    from cpu_engine.engine import QueueFullError
    from cpu_engine.scheduler import STOPPED_BY_ID, FinishReason, RequestError

    FINAL = production.FINAL
    ProductionSink = production.TritonSink

    class ContractSink(ProductionSink):
        """One request's responses as upstream shapes them (rules.ResponseShaper). Runs on the engine thread."""

        def __init__(self, model, pending: _Pending, sender, channel, streaming, prompt, exclude_input,
                     top_logprobs, outputs):
            super().__init__(FinishableSender(sender), channel, streaming, prompt, exclude_input, top_logprobs,
                             outputs)
            self.model = model
            self.triton_id = pending.triton_id
            self.response_error = pending.response_error
            self.shaper = rules.ResponseShaper(prompt, streaming, exclude_input, outputs, pending.return_log_probs,
                                               pending.zero_log_probs)
            self.request = None  # the engine request, set by the double's submit
            self.executor_id = 0
            self.done = False
            self.terminated: str | None = None  # rules.GUIDE_FAILS_THE_BATCH: the batch's error, sent next
            self.guided_without_end_id = pending.guided_without_end_id
            self.stop_pending = False  # a stop arrived before the request was scheduled
            self.stopping = False  # cancelled in the engine: what it still sends is dropped (clearGeneratedTokens)

        def stop(self) -> None:
            """A stop request for this request (rules.STOP_TAKES_EFFECT_WHEN_SCHEDULED): ends it at once when
            it has been scheduled, else after its first step (its prefill runs first). Runs in execute()."""
            if self.sender.scheduled:
                self.model.engine.cancel(self.request)
            else:
                self.stop_pending = True

        def send(self, tokens, finish) -> None:
            if self.done:
                return
            self.sender.scheduled = True
            if self.stop_pending and not self.stopping:  # its first step ran: the stop now ends it, tokens dropped
                self.stopping = True
                self.model.engine.cancel(self.request)
            if self.stopping:  # kCANCELLED: clearGeneratedTokens(), the FINAL response carries none
                if finish is None:
                    return
                tokens = []
            if self.terminated is not None:  # the batch failed (a guide): no token after it, only the error
                self.send_error(self.terminated)
                return
            if finish == FinishReason.END_ID and self.guided_without_end_id:
                # rules.GUIDE_WITHOUT_END_ID_SOURCE: the document is complete but end_id -1 does not end the
                # request; its tokens go out, and the step after next throws for the whole batch.
                self.send(tokens, None)
                self.model._fail_batch(self, rules.FORWARD_ASYNC_ERROR + rules.STOP_TOKEN_ACCEPTED,
                                       f"{rules.GUIDED_WITHOUT_END_ID_LOG}: its document is complete")
                return
            arrays = self.shaper.step([t.token for t in tokens], [float(t.logprob) for t in tokens],
                                      finished=finish is not None)
            if arrays is None:
                return
            if self.response_error is not None:
                # model_instance_state.cc fillTritonResponse(): this response becomes the FINAL error. The
                # executor would go on generating for nobody; the double frees the engine instead.
                self._end(pb_utils.InferenceResponse(error=pb_utils.TritonError(self.response_error)))
                if finish is None and self.request is not None:
                    self.model.engine.cancel(self.request)
                return
            response = pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(name, array) for name, array in arrays.items()])
            if finish is None:
                self.channel.send(self.sender, response, 0)
            else:
                self._end(response)

        def send_error(self, message: str) -> None:
            if self.done:
                return
            if message == STOPPED_BY_ID:  # upstream ends a stopped request like any other, without an error
                self.send([], FinishReason.CANCELLED)
                return
            # model_instance_state.cc fillTritonResponse(): an executor response with an error.
            text = rules.EXECUTOR_ERROR.format(request_id=self.executor_id, message=message)
            self._end(pb_utils.InferenceResponse(error=pb_utils.TritonError(text)))

        def _end(self, response) -> None:
            self.done = True
            self.sender.finished = True  # before the engine's next cancellation poll can ask Triton about it
            self.channel.send(self.sender, response, FINAL)
            self.model._forget(self)

    class TritonPythonModel(production.TritonPythonModel):
        """The production CPU engine model behind the rules of TensorRT-LLM's C++ backend."""

        # model_instance_state.cc: the executor is built from the gpt_model_path parameter alone; the backend
        # never looks at the model version's directory.
        reads_version_directory = False

        def initialize(self, args):
            config = json.loads(args["model_config"])
            errors = rules.check_model_config(config)
            interface = rules.check_interface(config)
            if errors or interface:
                message = rules.load_error(errors) if errors else interface[0]
                also = errors[1:] + interface if errors else interface[1:]
                if also:
                    message += " [the contract double also found: " + "; ".join(also) + "]"
                raise pb_utils.TritonModelException(message)
            for warning in rules.defaulted_parameter_warnings(config):
                pb_utils.Logger.log_warn(f"{args['model_name']}: {warning}")
            parameters = config.get("parameters", {})
            self.step_delay_s = float(parameters.get("test_step_delay_s", {}).get("string_value") or 0.0)
            # rules.PeftCache: which LoRA tasks upstream's cache would hold (the CPU engine's own cache forgets the
            # ones it evicts, so a task upstream no longer holds is not served from it either).
            tasks = int(parameters.get("test_lora_cache_tasks", {}).get("string_value") or 0)
            self.peft_cache = rules.PeftCache(tasks or 1 << 30)
            self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
            self._lock = threading.Lock()  # _latest: execute() and the engine thread
            self._latest: dict[str, ContractSink] = {}  # Triton request id -> its latest request (upstream's map)
            self._active: set[ContractSink] = set()  # in the engine (the executor's active requests)
            self._executor_ids = itertools.count(1)
            self._pending: _Pending | None = None
            engine_dir = Path(rules.get_parameter(config, "gpt_model_path"))
            engine_config = json.loads((engine_dir / "engine_config.json").read_text())
            pb_utils.Logger.log_warn(f"{args['model_name']}: TEST MODEL, the TensorRT-LLM contract double")
            # rules.log_prob_rule(): what output_log_probs hold (getExecutorConfigFromParams(), default true).
            self.normalize_log_probs = bool(rules.parameter_value(config, "normalize_log_probs"))
            # rules.max_queue_size(): the executor's queue is the CPU engine's queue of requests waiting for a
            # batch row, which the production model bounds by cpu_max_queue_size (a key upstream never reads):
            # the double hands it max_queue_size instead, and answers a full queue in upstream's words (_submit).
            self.max_queue_size = rules.max_queue_size(config)
            config["parameters"]["cpu_max_queue_size"] = {"string_value": str(self.max_queue_size)}
            super().initialize({**args, "model_config": json.dumps(config)})

            # model_instance_state.cc WaitForCancel(): Triton's cancellation is polled every this many ms.
            self.engine.cancel_poll_s = rules.cancellation_check_period_s(config)
            runner = self.engine.scheduler.runner
            self.max_seq_len, self.vocab_size = runner.max_seq_len, runner.vocab_size
            # A TensorRT-LLM build here takes max_input_len = max_seq_len - 1 unless told (build_engine).
            self.max_input_len = int(engine_config.get("max_input_len") or self.max_seq_len - 1)
            self._production_submit = self.engine.submit
            self.engine.submit = self._submit
            # rules.GUIDE_FAILS_THE_BATCH: the guides that failed to compile in the engine, for tests to read (made
            # last: metric families must not outlive a failed initialize(), see the production model).
            self._guide_failures_family = pb_utils.MetricFamily(
                name=rules.GUIDE_FAILURES_METRIC, kind=pb_utils.MetricFamily.COUNTER,
                description="contract double: guides that failed to compile in the engine (each failed the batch)")
            self.guide_failures = self._guide_failures_family.Metric(
                labels={"model": args["model_name"], "version": args["model_version"]})
            production.never_destroyed(self._guide_failures_family, self.guide_failures)

        def _lora(self, request):
            """rules.PeftCache: a task upstream's cache does not hold needs its weights (upstream's error
            otherwise); making room evicts the least recently used task no request is using."""
            task_id = production._scalar(request, "lora_task_id")
            if task_id is not None:
                has_weights = pb_utils.get_input_tensor_by_name(request, "lora_weights") is not None
                with self._lock:
                    error, evicted = self.peft_cache.admit(int(task_id), has_weights)
                for task in evicted:
                    if self.lora_cache is not None:
                        self.lora_cache.drop(task)
                if error is not None:
                    raise RequestError(error)
            return super()._lora(request)

        def _make_sink(self, sender, streaming, prompt, exclude_input, top_logprobs, outputs):
            if self._pending is None:
                raise RuntimeError("contract double: a response sink was built outside execute()")
            return ContractSink(self, self._pending, sender, self.channel, streaming, prompt, exclude_input,
                                top_logprobs, outputs)

        def execute(self, requests):
            for request in requests:
                sender = request.get_response_sender()
                try:
                    self._enqueue(request, sender)
                except (RequestError, ValueError) as exc:
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))), flags=FINAL)
                except Exception as exc:  # the double broke, not the request: say so
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                        f"contract double: internal error: {type(exc).__name__}: {exc}")), flags=FINAL)
            return None

        def _enqueue(self, request, sender) -> None:
            triton_id = request.request_id() or ""
            inputs = {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}
            if rules.is_stop_request(inputs):  # model_instance_state.cc handleStopRequest()
                error = rules.stop_request_error(triton_id)
                if error:
                    raise RequestError(error)
                with self._lock:
                    target = self._latest.get(triton_id)
                if target is not None and target.request is not None:
                    target.stop()  # ends with a plain FINAL response, once it has been scheduled
                sender.send(pb_utils.InferenceResponse(output_tensors=[]), flags=FINAL)
                return
            violation = rules.request_violation(inputs, request.requested_output_names(), self.decoupled)
            if violation is not None and violation.when == rules.ENQUEUE_TIME:
                if not violation.upstream:  # what a test through the frontend asserts never happens
                    pb_utils.Logger.log_warn(f"{self.model_name}: request {triton_id!r}: {violation.message}")
                raise RequestError(violation.message)
            guided_without_end_id = rules.guided_without_end_id(rules.batch_items(inputs)[0])
            if guided_without_end_id:
                pb_utils.Logger.log_warn(f"{self.model_name}: request {triton_id!r}: {rules.GUIDED_WITHOUT_END_ID_LOG}")
            return_log_probs = rules.first_flag(inputs, "return_log_probs")
            zero_log_probs = False
            if return_log_probs:  # the sampler's log-probs (rules.log_prob_rule); refused where not modelled
                log_probs = rules.log_prob_rule(inputs, request.requested_output_names(), self.normalize_log_probs)
                if log_probs.refusal is not None:
                    raise RequestError(log_probs.refusal)
                zero_log_probs = log_probs.output == rules.LOG_PROBS_ZERO
            self._pending = _Pending(triton_id, return_log_probs,
                                     violation.message if violation is not None else None, zero_log_probs,
                                     guided_without_end_id)
            try:
                super()._enqueue(request, sender)
            finally:
                self._pending = None

        def _submit(self, request) -> None:
            """The engine's submit, as the executor takes a request (runs inside the production _enqueue)."""
            sink = request.sink
            if not isinstance(sink, ContractSink):
                raise RuntimeError("contract double: the production _enqueue no longer builds its response sink "
                                   "through _make_sink; the double cannot shape responses")
            sink.executor_id = next(self._executor_ids)
            error = rules.executor_violation(len(request.prompt), request.end_id, self.max_input_len,
                                             self.vocab_size)
            if error:  # TLLM_CHECK / TLLM_THROW in llmRequest.cpp: their file, line and trace after the text
                raise RequestError(rules.EXECUTOR_ERROR.format(
                    request_id=sink.executor_id, message=rules.tllm_error(error, "batch_manager/llmRequest.cpp", 0)))
            request.max_new_tokens = rules.clamped_output_len(len(request.prompt), request.max_new_tokens,
                                                              self.max_seq_len)
            # rules.effective_seed(): no seed input is seed 0 (the CPU engine would draw a random one).
            request.sampling.seed = rules.effective_seed(request.sampling.seed)
            sink.request = request
            try:
                self._production_submit(request)
            except QueueFullError:  # executorImpl.cpp enqueueRequests(): an error response at once
                raise RequestError(rules.tllm_error(rules.QUEUE_FULL.format(max_queue_size=self.max_queue_size),
                                                    "executor/executorImpl.cpp", 0)) from None
            with self._lock:  # rules.GUIDE_FAILS_THE_BATCH fails these
                if not sink.done:
                    self._active.add(sink)
                    if request.lora is not None:  # rules.PeftCache: in use until the request ends (_forget)
                        self.peft_cache.use(request.lora.task_id)
                        sink.lora_task = request.lora.task_id
            if sink.triton_id:  # model_instance_state.cc enqueue(): the latest request with an id wins
                with self._lock:
                    if not sink.done:
                        self._latest[sink.triton_id] = sink

        def _forget(self, sink) -> None:
            with self._lock:
                if getattr(sink, "lora_task", None) is not None:
                    self.peft_cache.release(sink.lora_task)
                    sink.lora_task = None
                self._active.discard(sink)
                if self._latest.get(sink.triton_id) is sink:
                    del self._latest[sink.triton_id]

        def _guide_compiled(self, generation, sender, guide, error) -> None:
            """rules.GUIDE_FAILS_THE_BATCH: upstream compiles a request's guide in the executor loop, and a guide
            that does not compile fails every active request with the executor's error, this one included (which
            the executor had taken, so it has an executor id). Runs on a guide-compile thread: the other requests
            get the error from the engine thread (ContractSink.send), their cancellation ending them."""
            reason = rules.engine_guide_failure(error)
            if reason is None:  # compiled, or refused for another reason (the model unloading)
                super()._guide_compiled(generation, sender, guide, error)
                return
            failed = generation.sink
            failed.executor_id = next(self._executor_ids)
            self._fail_batch(failed, rules.FORWARD_ASYNC_ERROR + reason, f"{rules.GUIDE_FAILED_LOG}{error}")

        def _fail_batch(self, failed, message: str, why: str) -> None:
            """executorImpl.cpp forwardAsync() -> terminateActiveRequests(): every active request ends with
            `message`, `failed` (whose step threw) at once, the others at their next step (their
            cancellation ends them). Logged with `why` and counted (rules.GUIDE_FAILURES_METRIC)."""
            with self._lock:
                active = [sink for sink in self._active if not sink.done and sink is not failed]
            pb_utils.Logger.log_error(f"{self.model_name}: {why} (request {failed.triton_id!r}; {len(active)} other "
                                      "active requests fail too)")
            self.guide_failures.increment(1)
            for sink in active:
                sink.terminated = message
                self.engine.cancel(sink.request)
            failed.send_error(message)

        def _after_step(self) -> None:
            super()._after_step()
            if self.step_delay_s > 0:
                time.sleep(self.step_delay_s)

    return TritonPythonModel


def __getattr__(name: str) -> Any:
    """Build TritonPythonModel on first access (PEP 562): only inside the Triton stub is pb_utils there."""
    if name == "TritonPythonModel":
        model_class = _build_model_class()
        globals()[name] = model_class
        return model_class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
