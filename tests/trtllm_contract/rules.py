"""What TensorRT-LLM's C++ Triton backend (inflight_batcher_llm) checks and how it shapes its responses, as
data and pure functions (numpy only), so that unit tests run them without Triton and the contract double
(double.py) enforces them inside tritonserver.

Every rule cites the upstream file and function it was read from. Upstream code was read, never copied;
these functions restate its behaviour. Sources (`NVIDIA/TensorRT-LLM`, `triton_backend/...` unless noted):

- `inflight_batcher_llm/src/model_instance_state.cc` at 0c8de69a1ca6213eebb20a51873890ff128666c2 (its
  `tensorrt_llm/version.py` says 1.2.0rc8, the stored copy nearest release 1.1.0 = 9bab773c, which the index
  does not hold); a second stored copy (c8c6df08) differs by 26 characters.
- `inflight_batcher_llm/src/model_state.cc` at 5cdd69218f8815d6c8c101ca1facf2ec4ac4b622 (the only stored copy).
- `inflight_batcher_llm/src/utils.cc` at 192908136e53ddfc2f282e81e6ecdb76af06eb50; `utils.h` at
  89fd9b74ab7ae753b4c6b3db25a400dca7ea54a0 (the input names below: `seed`, `min_tokens`; upstream's older
  `random_seed` / `min_length` are gone there).
- `all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt` at 0c8de69a (the upstream tensor interface).
- The executor the backend drives (`cpp/...`, stored copies read through the index; the commits of the
  copies read are not named by it): `batch_manager/llmRequest.cpp` `LlmRequest::createResult` and
  `LlmRequest::validate`; `batch_manager/trtGptModelInflightBatching.cpp` (where `setLogProbs` is called
  with every generated token's log-prob); `executor/executorImpl.cpp` `terminateCancelledRequests`,
  `fetchNewRequests`; `include/tensorrt_llm/common/tllmException.h` (`TLLM_THROW`, `throwRuntimeError`).
- Cross-check: tensorrtllm_backend tag v0.19.0 (`inflight_batcher_llm/src/*`, local mirror): the same logic
  for every rule here, apart from the two input names above and the token-count outputs it lacks.

Message texts. `std::runtime_error` texts reach the client verbatim. `TLLM_THROW(msg)` texts carry
" (<file>:<line>)\\n<stack trace>" after the message, and `TLLM_CHECK_WITH_INFO(cond, info)` texts read
"[TensorRT-LLM][ERROR] Assertion failed: <info> (<file>:<line>)\\n<stack trace>". The double cannot know the
file, line and trace of a build it never ran, so each message here is upstream's text up to where that
suffix starts: the real message starts with it (tests should match with `in` or `startswith`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import numpy as np

UPSTREAM_REPO = "NVIDIA/TensorRT-LLM"
COMMITS = {
    "model_instance_state.cc": "0c8de69a1ca6213eebb20a51873890ff128666c2",
    "model_state.cc": "5cdd69218f8815d6c8c101ca1facf2ec4ac4b622",
    "utils.cc": "192908136e53ddfc2f282e81e6ecdb76af06eb50",
    "utils.h": "89fd9b74ab7ae753b4c6b3db25a400dca7ea54a0",
    "config.pbtxt": "0c8de69a1ca6213eebb20a51873890ff128666c2",
}
MIS = "model_instance_state.cc"
MS = "model_state.cc"
UT = "utils.cc"

ASSERTION = "[TensorRT-LLM][ERROR] Assertion failed: "  # tllmException.h throwRuntimeError()

# ----- messages (upstream's words) -------------------------------------------------------------------------
# model_instance_state.cc ModelInstanceState::Create(): every exception of the constructor becomes the load error.
LOAD_ERROR_PREFIX = "unexpected error when creating modelInstanceState: "
# model_state.cc ModelState::GetParameter<std::string>()
PARAMETERS_SECTION_MISSING = "Model config doesn't have a parameters section"
PARAMETER_MISSING = "Cannot find parameter with name: {name}"
BOOL_UNPARSABLE = "Cannot convert {value} to a boolean."
# model_instance_state.cc getBatchingTypeFromParams()
GPT_MODEL_TYPE_INVALID = "Invalid gpt_model_type. Must be v1/inflight_batching/inflight_fused_batching."
# model_instance_state.cc getExecutorConfigFromParams() (TLLM_THROW)
LOOKAHEAD_PARAMETERS_MISSING = (
    "Decoding mode is set to lookahead but lookahead parameters are not specified. Please set parameters "
    "lookahead_window_size, lookahead_ngram_size, and lookahead_verification_set_size.")
# model_instance_state.cc getGuidedDecodingConfigFromParams()
XGRAMMAR_INFO_MISSING = ASSERTION + "Xgrammar's tokenizer info path at {path} does not exist."
GUIDED_BACKEND_INVALID = ("Guided decoding is currently supported with 'xgrammar' backend. Invalid "
                          "guided_decoding_backend parameter provided.")
# The tokenizer-info JSON is read with nlohmann::json; a file that does not parse or lacks a key fails there
# with nlohmann's own text, which the double does not imitate (it names the problem in its own words).
XGRAMMAR_INFO_UNREADABLE = "contract double: {path} is not the tokenizer-info JSON upstream reads ({problem})"
XGRAMMAR_INFO_KEYS = ("encoded_vocab", "tokenizer_str", "stop_token_ids")
# model_instance_state.cc ModelInstanceState::ModelInstanceState() (TLLM_CHECK_WITH_INFO)
MODEL_PATHS_EMPTY = ASSERTION + "Both encoder and decoder model paths are empty"

# model_instance_state.cc handleStopRequest()
STOP_WITHOUT_REQUEST_ID = "Trying to stop a request but request ID is not provided"
# utils.cc splitBatchInputsTensors()
INPUT_TOKENS_MISSING = "inputTokens or encoderInputFeatures tensor not provided"  # TLLM_THROW
INPUT_TOKENS_NOT_2D = ASSERTION + "Expected inputTokens tensors to have 2 dimensions"
INPUT_LENGTHS_MISSING = ASSERTION + "input lengths tensor not provided"
INPUT_LENGTHS_NOT_1D = ASSERTION + "Expected inputLengths tensors to have 1 dimension"
# utils.cc createRequestsFromInputTensors() (TLLM_THROW, runtime_error)
BATCH_NEEDS_DECOUPLED = "Batch size > 1 requires the tensorrt_llm backend to be using decoupled transaction policy"
STREAMING_NEEDS_DECOUPLED = "Streaming is only supported if model is deployed using decoupled mode."
OUTPUT_LEN_MISSING = "request_output_len is not present in the request"
# utils.h extractSingleton()
INVALID_SIZE = ASSERTION + "Invalid size for tensor {name}"
# utils.cc convertWordList()
WORDS_ODD_LENGTH = ASSERTION + "Sparse list must not have odd length: {words}"
WORDS_EXTRA_END = ASSERTION + "Sparse list must not have additional -1s: {words}"
WORDS_OUT_OF_BOUNDS = ASSERTION + "Sparse list must not have out-of-bound offsets: {words}"
WORDS_NOT_INCREASING = ASSERTION + "Sparse list must not have non-increasing offsets: {words}"
# model_instance_state.cc fillTritonResponse(): checked when the first response is filled, not at enqueue;
# the exception is caught there and the response goes out FINAL with this error.
RESPONSE_ERROR_PREFIX = "Error encountered while populating response: "
OUTPUT_IDS_REQUIRED = "output_ids tensor must be present in list of output tensors"  # TLLM_THROW
SEQUENCE_LENGTH_REQUIRED = "sequence_length tensor must be present in list of output tensors"  # TLLM_THROW
# model_instance_state.cc fillTritonResponse(): an executor response with an error.
EXECUTOR_ERROR = "Executor failed process requestId {request_id} due to the following error: {message}"
# executorImpl.cpp fetchNewRequests(): what LlmRequest::validate() throws becomes the request's error response.
FETCH_ERROR_PREFIX = "Encountered an error when fetching new request: "
# llmRequest.cpp LlmRequest::validate()
END_ID_OUT_OF_RANGE = ASSERTION + "EndId ({end_id}) is not within acceptable range [-1, {vocab_size})."
PROMPT_TOO_LONG = ("Prompt length ({prompt_len}) exceeds maximum input length ({max_input_len}). Set log level "
                   "to info and check TRTGptModel logs for how maximum input length is set")  # TLLM_THROW

DOUBLE = "contract double: "  # the double's own words, for what upstream does not refuse but handles differently
INPUT_LENGTHS_IGNORED = (DOUBLE + "input_lengths ({input_lengths}) differs from the {ids} ids in input_ids; "
                         "the TensorRT-LLM backend ignores input_lengths for a one-row request and would read "
                         "all {ids} (utils.cc splitBatchInputsTensors), the CPU engine only {input_lengths}")

# ----- parameters --------------------------------------------------------------------------------------------
# Read with GetParameter and NO fallback: a missing key fails the load with PARAMETER_MISSING.
REQUIRED_PARAMETERS: dict[str, str] = {
    "gpt_model_type": f"{MIS} getBatchingTypeFromParams() @{COMMITS[MIS][:8]}: GetParameter<std::string> "
                      "outside any try; value must be V1, v1, inflight_batching or inflight_fused_batching",
    "tokenizer_dir": f"{MIS} getGuidedDecodingConfigFromParams() @{COMMITS[MIS][:8]}: read first, value unused "
                     "(logged as ignored)",
    "xgrammar_tokenizer_info_path": f"{MIS} getGuidedDecodingConfigFromParams() @{COMMITS[MIS][:8]}",
    "guided_decoding_backend": f"{MIS} getGuidedDecodingConfigFromParams() @{COMMITS[MIS][:8]}",
}
# Required only when another parameter asks for them.
CONDITIONALLY_REQUIRED_PARAMETERS: dict[str, str] = {
    name: f"{MIS} getExecutorConfigFromParams() @{COMMITS[MIS][:8]}: read (as uint32) only when "
          "decoding_mode is lookahead; missing or unparsable: LOOKAHEAD_PARAMETERS_MISSING"
    for name in ("lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size")
}

_WHERE = {
    "kv": f"{MIS} getKvCacheConfigFromParams()", "perf": f"{MIS} getExtendedRuntimePerfKnobConfigFromParams()",
    "par": f"{MIS} getParallelConfigFromParams()", "peft": f"{MIS} getPeftCacheConfigFromParams()",
    "sched": f"{MIS} getSchedulerConfigFromParams()", "spec": f"{MIS} getSpeculativeDecodingConfigFromParams()",
    "exec": f"{MIS} getExecutorConfigFromParams()", "ctor": f"{MIS} ModelInstanceState::ModelInstanceState()",
    "ms": f"{MS} ModelState::LoadParameters()", "worker": f"{MS} ModelState::GetExecutorWorkerPath()",
}


@dataclass(frozen=True)
class Param:
    """A parameter read inside try/catch: missing or unparsable, upstream logs a warning and uses `default`
    (None: left unset, the executor's own default applies; `note` says which)."""
    type: str  # how GetParameter<T> parses it: str, bool, int32, uint64, float, int32_csv
    default: Any
    where: str
    note: str = ""


_PARAMS: dict[str, Param] = {
    "max_tokens_in_paged_kv_cache": Param("int32", None, "kv", "unset: the KV cache is sized by the memory fraction"),
    "kv_cache_free_gpu_mem_fraction": Param("float", None, "kv", "unset: 0.9 (executor default)"),
    "cross_kv_cache_fraction": Param("float", None, "kv", "encoder-decoder models only"),
    "kv_cache_host_memory_bytes": Param("uint64", None, "kv", "unset: 0"),
    "kv_cache_onboard_blocks": Param("bool", True, "kv"),
    "max_attention_window_size": Param("int32_csv", None, "kv", "unset: max_sequence_length"),
    "sink_token_length": Param("int32", None, "kv"),
    "enable_kv_cache_reuse": Param("bool", True, "kv"),
    "multi_block_mode": Param("bool", True, "perf"),
    "enable_context_fmha_fp32_acc": Param("bool", False, "perf"),
    "cuda_graph_mode": Param("bool", False, "perf"),
    "cuda_graph_cache_size": Param("int32", 0, "perf"),
    "num_nodes": Param("int32", 1, "par"),
    "lora_cache_max_adapter_size": Param("int32", 64, "peft"),
    "lora_cache_optimal_adapter_size": Param("int32", 8, "peft"),
    "lora_cache_gpu_memory_fraction": Param("float", None, "peft", "unset: 0.05"),
    "lora_cache_host_memory_bytes": Param("uint64", None, "peft", "unset: 1 GB"),
    "lora_prefetch_dir": Param("str", None, "peft"),
    "batch_scheduler_policy": Param("str", "guaranteed_no_evict", "sched",
                                    "max_utilization or guaranteed_no_evict; anything else: a warning and the default"),
    "speculative_decoding_fast_logits": Param("bool", False, "spec"),
    "max_beam_width": Param("int32", 1, "exec"),
    "iter_stats_max_iterations": Param("int32", None, "exec", "unset: ExecutorConfig::kDefaultIterStatsMaxIterations"),
    "request_stats_max_iterations": Param("int32", None, "exec",
                                          "unset: ExecutorConfig::kDefaultRequestStatsMaxIterations"),
    "enable_trt_overlap": Param("bool", False, "exec"),
    "normalize_log_probs": Param("bool", True, "exec"),
    "enable_chunked_context": Param("bool", False, "exec"),
    "decoding_mode": Param("str", None, "exec", "top_k, top_p, top_k_top_p, beam_search, medusa, redrafter, "
                           "lookahead or eagle; unset or other: top_k_top_p if max_beam_width == 1, else beam_search"),
    "medusa_choices": Param("str", None, "exec"),
    "eagle_choices": Param("str", None, "exec"),
    "gpu_weights_percent": Param("float", 1.0, "exec"),
    "recv_poll_period_ms": Param("int32", 0, "exec", "0: busy loop"),
    "gpt_model_path": Param("str", "", "ctor", "missing, or a path that does not exist: a warning and '' "
                            "(not 'Cannot find parameter'); then, without encoder_model_path, MODEL_PATHS_EMPTY"),
    "encoder_model_path": Param("str", "", "ctor", "same as gpt_model_path"),
    "exclude_input_in_output": Param("bool", False, "ctor", "a request's exclude_input_in_output input wins"),
    "cancellation_check_period_ms": Param("int32", 100, "ctor", "how often WaitForCancel() polls Triton"),
    "stats_check_period_ms": Param("int32", 100, "ctor"),
    "gpu_device_ids": Param("str", None, "ms"),
    "participant_ids": Param("str", None, "ms"),
    "executor_worker_path": Param("str", "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker", "worker",
                                  "orchestrator mode only"),
}
# Read inside try/catch: missing or unparsable means a warning and the default, never a load error.
DEFAULTED_PARAMETERS: dict[str, tuple[Any, str]] = {
    name: (p.default, f"{_WHERE[p.where]} @{COMMITS[MS if p.where in ('ms', 'worker') else MIS][:8]}"
                      f" ({p.type}{'; ' + p.note if p.note else ''})")
    for name, p in _PARAMS.items()
}
GPT_MODEL_TYPES = frozenset({"V1", "v1", "inflight_batching", "inflight_fused_batching"})
DECODING_MODES = frozenset({"top_k", "top_p", "top_k_top_p", "beam_search", "medusa", "redrafter", "lookahead",
                            "eagle"})
SCHEDULER_POLICIES = frozenset({"max_utilization", "guaranteed_no_evict"})
BOOL_TRUE = ("True", "true", "TRUE", "1")  # model_state.cc GetParameter<bool>()
BOOL_FALSE = ("False", "false", "FALSE", "0")


class ContractViolation(ValueError):
    """Upstream would throw here; the message is upstream's (see the module docstring on suffixes)."""


def _parameters(config: Mapping[str, Any]) -> Mapping[str, Any]:
    if "parameters" not in config:
        raise ContractViolation(PARAMETERS_SECTION_MISSING)
    return config["parameters"] or {}


def get_parameter(config: Mapping[str, Any], name: str) -> str:
    """model_state.cc GetParameter<std::string>(): the string_value, "" when the entry has none."""
    parameters = _parameters(config)
    if name not in parameters:
        raise ContractViolation(PARAMETER_MISSING.format(name=name))
    entry = parameters[name]
    return str(entry.get("string_value", "")) if isinstance(entry, Mapping) else ""


_INT_PREFIX = re.compile(r"\s*[+-]?\d+")
_FLOAT_PREFIX = re.compile(r"\s*[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|inf(?:inity)?|nan)", re.IGNORECASE)


def parse_like_cpp(kind: str, text: str) -> Any:
    """What model_state.cc GetParameter<T>() makes of `text`: std::stoi / stoull / stof read the longest
    numeric prefix after whitespace ("12ms" is 12) and throw when there is none; bool takes eight spellings."""
    if kind == "str":
        return text
    if kind == "bool":
        if text in BOOL_TRUE:
            return True
        if text in BOOL_FALSE:
            return False
        raise ContractViolation(BOOL_UNPARSABLE.format(value=text))
    if kind in ("int32", "uint64"):
        match = _INT_PREFIX.match(text)
        if not match:
            raise ContractViolation(f"std::invalid_argument: {'stoi' if kind == 'int32' else 'stoull'}: {text!r}")
        value = int(match.group())
        if kind == "int32" and not -2**31 <= value < 2**31:
            raise ContractViolation(f"std::out_of_range: stoi: {text!r}")
        return value
    if kind == "float":
        match = _FLOAT_PREFIX.match(text)
        if not match:
            raise ContractViolation(f"std::invalid_argument: stof: {text!r}")
        return float(match.group())
    if kind == "int32_csv":  # utils.cc csvStrToVecInt()
        if not text:
            raise ContractViolation(ASSERTION + "Cannot convert empty string to vector of vector of ints")
        values = [parse_like_cpp("int32", item) for item in text.split(",") if item.strip()]
        if not values:
            raise ContractViolation(ASSERTION + "Empty vector")
        return values
    raise ValueError(f"unknown parameter type {kind!r}")


def parameter_value(config: Mapping[str, Any], name: str) -> Any:
    """The value upstream uses for a defaulted parameter: parsed as it parses it, or its default."""
    spec = _PARAMS[name]
    try:
        return parse_like_cpp(spec.type, get_parameter(config, name))
    except ContractViolation:
        return spec.default


def defaulted_parameter_warnings(config: Mapping[str, Any]) -> list[str]:
    """The defaulted parameters that are present but that upstream cannot parse (it logs a warning and
    uses the default; the real backend then behaves unlike what the template says)."""
    warnings = []
    for name, spec in _PARAMS.items():
        try:
            text = get_parameter(config, name)
        except ContractViolation:
            continue
        try:
            value = parse_like_cpp(spec.type, text)
        except ContractViolation as exc:
            warnings.append(f"parameter {name}={text!r}: {exc}; upstream uses the default {spec.default!r}")
            continue
        if name == "batch_scheduler_policy" and value not in SCHEDULER_POLICIES:
            warnings.append(f"parameter {name}={text!r}: batch_scheduler_policy parameter was not found or is "
                            "invalid (must be max_utilization or guaranteed_no_evict); upstream uses the default")
        if name == "decoding_mode" and value not in DECODING_MODES:
            warnings.append(f"parameter {name}={text!r}: decoding_mode parameter is invalid or not specified; "
                            "upstream picks top_k_top_p (beam 1) or beam_search")
    return warnings


def _unset(value: str, name: str) -> bool:
    """getGuidedDecodingConfigFromParams(): empty, or the template's own unfilled placeholder."""
    return value == "" or value == "${" + name + "}"


def check_model_config(config: Mapping[str, Any], path_exists: Callable[[str], bool] = os.path.exists) -> list[str]:
    """Upstream's load errors for this model config (the JSON Triton hands a model), in the order upstream
    meets them; empty if upstream would load it (as far as a config can tell: the engine itself is not
    checked). Upstream stops at the first: that is the one its load error names (with LOAD_ERROR_PREFIX);
    the others are what a fix of the first would run into next."""
    try:
        _parameters(config)
    except ContractViolation as exc:
        return [str(exc)]
    errors: list[str] = []

    # model_instance_state.cc getExecutorConfigFromParams() -> getBatchingTypeFromParams(): first of all.
    try:
        if get_parameter(config, "gpt_model_type") not in GPT_MODEL_TYPES:
            errors.append(GPT_MODEL_TYPE_INVALID)
    except ContractViolation as exc:
        errors.append(str(exc))

    # getExecutorConfigFromParams(): lookahead decoding needs its three sizes (uint32, std::stoul).
    try:
        decoding_mode = get_parameter(config, "decoding_mode")
    except ContractViolation:
        decoding_mode = ""
    if decoding_mode == "lookahead":
        try:
            for name in CONDITIONALLY_REQUIRED_PARAMETERS:
                parse_like_cpp("uint64", get_parameter(config, name))
        except ContractViolation:
            errors.append(LOOKAHEAD_PARAMETERS_MISSING)

    # getExecutorConfigFromParams() -> getGuidedDecodingConfigFromParams(), last of the executor config.
    guided_error = _guided_decoding_error(config, path_exists)
    if guided_error:
        errors.append(guided_error)

    # ModelInstanceState::ModelInstanceState(): an engine path that exists (decoder or encoder).
    paths = []
    for name in ("gpt_model_path", "encoder_model_path"):
        try:
            paths.append(get_parameter(config, name))
        except ContractViolation:
            paths.append("")
    if not any(path and path_exists(path) for path in paths):
        errors.append(MODEL_PATHS_EMPTY)
    return errors


def _guided_decoding_error(config: Mapping[str, Any], path_exists: Callable[[str], bool]) -> str | None:
    try:  # the three reads, in upstream's order; the first missing one throws
        get_parameter(config, "tokenizer_dir")
        info_path = get_parameter(config, "xgrammar_tokenizer_info_path")
        backend = get_parameter(config, "guided_decoding_backend")
    except ContractViolation as exc:
        return str(exc)
    # Off when either the backend or the tokenizer-info path is empty/unfilled: no error, whatever the other.
    if _unset(backend, "guided_decoding_backend") or _unset(info_path, "xgrammar_tokenizer_info_path"):
        return None
    if not path_exists(info_path):
        return XGRAMMAR_INFO_MISSING.format(path=info_path)
    problem = _tokenizer_info_problem(info_path)  # upstream parses the file before it looks at the backend
    if problem:
        return XGRAMMAR_INFO_UNREADABLE.format(path=info_path, problem=problem)
    if backend != "xgrammar":
        return GUIDED_BACKEND_INVALID
    return None


def _tokenizer_info_problem(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            info = json.load(handle)
    except (OSError, ValueError) as exc:
        return f"not JSON: {exc}"
    if not isinstance(info, dict):
        return "not a JSON object"
    kinds = {"encoded_vocab": list, "tokenizer_str": str, "stop_token_ids": list}
    for key in XGRAMMAR_INFO_KEYS:
        if not isinstance(info.get(key), kinds[key]):
            return f"{key} missing or not a {kinds[key].__name__}"
    if not all(isinstance(t, int) for t in info["stop_token_ids"]):
        return "stop_token_ids holds non-integers"
    return None


def load_error(messages: list[str]) -> str:
    """The load error upstream would give (its first error), as Triton reports the failed load."""
    return LOAD_ERROR_PREFIX + messages[0]


def cancellation_check_period_s(config: Mapping[str, Any]) -> float:
    return parameter_value(config, "cancellation_check_period_ms") / 1000.0


def exclude_input_default(config: Mapping[str, Any]) -> bool:
    return bool(parameter_value(config, "exclude_input_in_output"))


# ----- the tensor interface (upstream config.pbtxt @0c8de69a) -------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    data_type: str
    dims: tuple[int, ...]
    scalar_reshape: bool = False  # reshape: { shape: [ ] }
    optional: bool = True


UPSTREAM_INPUTS: dict[str, TensorSpec] = {
    "input_ids": TensorSpec("TYPE_INT32", (-1,)),
    "input_lengths": TensorSpec("TYPE_INT32", (1,), True, optional=False),
    "request_output_len": TensorSpec("TYPE_INT32", (1,), True, optional=False),
    "end_id": TensorSpec("TYPE_INT32", (1,), True),
    "pad_id": TensorSpec("TYPE_INT32", (1,), True),
    "stop_words_list": TensorSpec("TYPE_INT32", (2, -1)),
    "bad_words_list": TensorSpec("TYPE_INT32", (2, -1)),
    "embedding_bias": TensorSpec("TYPE_FP32", (-1,)),
    "beam_width": TensorSpec("TYPE_INT32", (1,), True),
    "num_return_sequences": TensorSpec("TYPE_INT32", (1,), True),
    "temperature": TensorSpec("TYPE_FP32", (1,), True),
    "runtime_top_k": TensorSpec("TYPE_INT32", (1,), True),
    "runtime_top_p": TensorSpec("TYPE_FP32", (1,), True),
    "runtime_top_p_min": TensorSpec("TYPE_FP32", (1,), True),
    "runtime_top_p_decay": TensorSpec("TYPE_FP32", (1,), True),
    "runtime_top_p_reset_ids": TensorSpec("TYPE_INT32", (1,), True),
    "len_penalty": TensorSpec("TYPE_FP32", (1,), True),
    "early_stopping": TensorSpec("TYPE_BOOL", (1,), True),
    "repetition_penalty": TensorSpec("TYPE_FP32", (1,), True),
    "min_tokens": TensorSpec("TYPE_INT32", (1,), True),
    "beam_search_diversity_rate": TensorSpec("TYPE_FP32", (1,), True),
    "presence_penalty": TensorSpec("TYPE_FP32", (1,), True),
    "frequency_penalty": TensorSpec("TYPE_FP32", (1,), True),
    "seed": TensorSpec("TYPE_UINT64", (1,), True),
    "return_log_probs": TensorSpec("TYPE_BOOL", (1,), True),
    "return_context_logits": TensorSpec("TYPE_BOOL", (1,), True),
    "return_generation_logits": TensorSpec("TYPE_BOOL", (1,), True),
    "return_perf_metrics": TensorSpec("TYPE_BOOL", (1,), True),
    "return_num_input_tokens": TensorSpec("TYPE_BOOL", (1,), True),
    "return_num_output_tokens": TensorSpec("TYPE_BOOL", (1,), True),
    "exclude_input_in_output": TensorSpec("TYPE_BOOL", (1,), True),
    "stop": TensorSpec("TYPE_BOOL", (1,), True),
    "streaming": TensorSpec("TYPE_BOOL", (1,), True),
    "guided_decoding_guide_type": TensorSpec("TYPE_STRING", (1,)),
    "guided_decoding_guide": TensorSpec("TYPE_STRING", (1,)),
    # LoRA (config.pbtxt): the weights in the engine's dtype, declared FP16 upstream (edited for bfloat16 engines).
    "lora_task_id": TensorSpec("TYPE_UINT64", (1,), True),
    "lora_weights": TensorSpec("TYPE_FP16", (-1, -1)),
    "lora_config": TensorSpec("TYPE_INT32", (-1, 3)),
}
# Read with getRequestBooleanInputTensor() (model_instance_state.cc / utils.cc): the first byte of the buffer,
# whatever the shape, so a template without upstream's scalar reshape for them is harmless.
FIRST_BYTE_FLAGS = frozenset({"stop", "streaming"})
UPSTREAM_OUTPUTS: dict[str, TensorSpec] = {
    "output_ids": TensorSpec("TYPE_INT32", (-1, -1)),
    "sequence_length": TensorSpec("TYPE_INT32", (-1,)),
    "cum_log_probs": TensorSpec("TYPE_FP32", (-1,)),
    "output_log_probs": TensorSpec("TYPE_FP32", (-1, -1)),
    "batch_index": TensorSpec("TYPE_INT32", (1,)),
    "sequence_index": TensorSpec("TYPE_INT32", (1,)),
    "num_input_tokens": TensorSpec("TYPE_INT32", (1,)),
    "num_output_tokens": TensorSpec("TYPE_INT32", (1,)),
}
# Upstream inputs and outputs beyond the two tables above (logits, LoRA, prompt tables, multimodal,
# speculative decoding, KV-cache retention, guided decoding, perf metrics ...) exist upstream; the double
# knows only the names, so that a template declaring one is recognised as upstream's and not as unknown.
OTHER_UPSTREAM_INPUTS = frozenset({
    "encoder_input_features", "encoder_output_lengths", "draft_input_ids", "decoder_input_ids",
    "decoder_input_lengths", "draft_logits", "draft_acceptance_threshold", "prompt_embedding_table",
    "prompt_table_extra_ids", "prompt_vocab_size", "cross_attention_mask", "mrope_rotary_cos_sin",
    "mrope_position_deltas", "context_phase_params",
    "skip_cross_attn_blocks", "retention_token_range_starts", "retention_token_range_ends",
    "retention_token_range_priorities", "retention_token_range_durations_ms", "retention_decode_priority",
    "retention_decode_duration_ms", "lookahead_window_size",
    "lookahead_ngram_size", "lookahead_verification_set_size", "no_repeat_ngram_size", "multimodal_embedding",
})
OTHER_UPSTREAM_OUTPUTS = frozenset({
    "context_logits", "generation_logits", "context_phase_params", "kv_cache_alloc_new_blocks",
    "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks", "arrival_time_ns", "first_scheduled_time_ns",
    "first_token_time_ns", "last_token_time_ns", "acceptance_rate", "total_accepted_draft_tokens",
    "total_draft_tokens",
})
# What the backend fills only with a flag (model_instance_state.cc fillTritonResponse(); the flags are read
# by utils.cc getOutputConfigFromTensors()): without the flag the output is absent from the response, even
# when requested, and no error is raised.
LOG_PROB_OUTPUTS = frozenset({"output_log_probs", "cum_log_probs"})


def unknown_inputs(config: Mapping[str, Any]) -> list[str]:
    """Inputs the template declares that upstream never reads (utils.cc readInputsTensors() reads every input
    into a map, and nothing looks these up): accepted and ignored."""
    names = [i["name"] for i in config.get("input", [])]
    return [n for n in names if n not in UPSTREAM_INPUTS and n not in OTHER_UPSTREAM_INPUTS]


def unknown_outputs(config: Mapping[str, Any]) -> list[str]:
    """Outputs the template declares that upstream never fills: absent from every response."""
    names = [o["name"] for o in config.get("output", [])]
    return [n for n in names if n not in UPSTREAM_OUTPUTS and n not in OTHER_UPSTREAM_OUTPUTS]


def _dims(entry: Mapping[str, Any], key: str = "dims") -> tuple[int, ...]:
    return tuple(int(d) for d in entry.get(key, []) or [])


def check_interface(config: Mapping[str, Any]) -> list[str]:
    """The double's own check (upstream has none: its C++ reads each known input as the type upstream's
    config.pbtxt declares, and a template that declares another type or shape is misread silently, or
    refused by Triton before the backend sees it): every input and output of the template that upstream
    knows must be declared as upstream declares it; upstream's required inputs must be required; output_ids
    and sequence_length must exist (else no request can succeed)."""
    problems = []
    inputs = {i["name"]: i for i in config.get("input", [])}
    for name, spec in UPSTREAM_INPUTS.items():
        entry = inputs.get(name)
        if entry is None:
            if not spec.optional:
                problems.append(f"{DOUBLE}input {name} is required upstream but the template does not declare it")
            continue
        problems += _spec_problems("input", name, entry, spec)
        if not spec.optional and entry.get("optional", False):
            problems.append(f"{DOUBLE}input {name} is required upstream but optional in the template")
        reshape = entry.get("reshape")
        scalar = reshape is not None and _dims(reshape, "shape") == ()
        if name not in FIRST_BYTE_FLAGS and scalar != spec.scalar_reshape:
            problems.append(f"{DOUBLE}input {name}: reshape {'[ ]' if scalar else 'none'} in the template, "
                            f"{'[ ]' if spec.scalar_reshape else 'none'} upstream")
    outputs = {o["name"]: o for o in config.get("output", [])}
    for name in ("output_ids", "sequence_length"):
        if name not in outputs:
            problems.append(f"{DOUBLE}output {name} is not declared; upstream fails every request without it")
    for name, entry in outputs.items():
        if name in UPSTREAM_OUTPUTS:
            problems += _spec_problems("output", name, entry, UPSTREAM_OUTPUTS[name])
    return problems


def _spec_problems(kind: str, name: str, entry: Mapping[str, Any], spec: TensorSpec) -> list[str]:
    problems = []
    if entry.get("data_type") != spec.data_type:
        problems.append(f"{DOUBLE}{kind} {name} is {entry.get('data_type')} in the template, {spec.data_type} upstream")
    if _dims(entry) != spec.dims:
        problems.append(f"{DOUBLE}{kind} {name} has dims {list(_dims(entry))} in the template, "
                        f"{list(spec.dims)} upstream")
    return problems


# ----- requests ----------------------------------------------------------------------------------------------
RESPONSE_TIME = "first_response"
ENQUEUE_TIME = "enqueue"


@dataclass(frozen=True)
class Violation:
    message: str
    when: str  # ENQUEUE_TIME: an error response at once; RESPONSE_TIME: instead of the first response
    upstream: bool = True  # False: the double's own check (DOUBLE prefix)


# utils.cc getOutputConfigFromTensors(), createRequestsFromInputTensors(), getSamplingConfigFromTensors():
# the singletons, in the order upstream extracts them (extractSingleton: exactly one element, else INVALID_SIZE).
OUTPUT_CONFIG_FLAGS = ("return_log_probs", "return_generation_logits", "return_context_logits", "return_perf_metrics")
SAMPLING_SINGLETONS = ("beam_width", "runtime_top_k", "runtime_top_p", "runtime_top_k_min", "runtime_top_p_decay",
                       "runtime_top_p_reset_ids", "temperature", "len_penalty", "early_stopping",
                       "repetition_penalty", "min_tokens", "beam_search_diversity_rate", "presence_penalty",
                       "frequency_penalty", "seed", "no_repeat_ngram_size", "num_return_sequences")


def first_flag(inputs: Mapping[str, np.ndarray], name: str) -> bool:
    """utils.cc getRequestBooleanInputTensor(): absent is false; else the first byte of the buffer."""
    array = inputs.get(name)
    if array is None:
        return False
    flat = np.asarray(array).reshape(-1)
    return bool(flat[0]) if flat.size else False


def is_stop_request(inputs: Mapping[str, np.ndarray]) -> bool:
    """model_instance_state.cc enqueue() -> handleStopRequest(): checked before anything else; a stop
    request is answered at once and never reaches the executor (its other inputs are not looked at, but
    Triton itself still requires the inputs the config declares non-optional)."""
    return first_flag(inputs, "stop")


# Audit round 3, R2: model_instance_state.cc handleStopRequest() @0c8de69a -> executor cancelRequest(), which only
# adds the id to mCancelledReqIds; executorImpl.cpp terminateCancelledRequests() @036a60f7 checks that set against
# the active requests only (fetchNewRequests() never looks at it), and trtGptModelInflightBatching.cpp
# terminateRequestSync() acts in forwardSync() on the scheduled batch only. So a stopped request that is still
# queued (or active but not scheduled under guaranteed_no_evict) runs its first step, its prefill, before it ends
# (kCANCELLED: clearGeneratedTokens(), a FINAL response with no tokens). Triton's own cancellation reaches the
# same cancelRequest() (model_instance_state.cc WaitForCancel): it too waits for the request's turn.
STOP_TAKES_EFFECT_WHEN_SCHEDULED = (f"{MIS} handleStopRequest @{COMMITS[MIS][:8]} / WaitForCancel -> cancelRequest; "
                                    "executorImpl.cpp terminateCancelledRequests @036a60f7; "
                                    "trtGptModelInflightBatching.cpp terminateRequestSync (forwardSync)")


def stop_request_error(request_id: str) -> str | None:
    """handleStopRequest(): a stop request needs the Triton request id of the requests to stop. With one, the
    stop request gets an empty FINAL response (no outputs, no error) whether or not anything matched."""
    return STOP_WITHOUT_REQUEST_ID if not request_id else None


def batch_items(inputs: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """utils.cc readInputsTensors() + splitBatchInputsTensors(): one dict per batch row. `stop` and `streaming`
    are not among them (read from the request itself). A one-row request is taken as it is: input_lengths
    is NOT applied to input_ids then; rows of a bigger batch are cut to their input_lengths."""
    tensors = {name: np.asarray(a) for name, a in inputs.items() if name not in ("stop", "streaming", "START",
                                                                                "END", "CORRID")}
    ids, features = tensors.get("input_ids"), tensors.get("encoder_input_features")
    if ids is not None:
        if ids.ndim != 2:
            raise ContractViolation(INPUT_TOKENS_NOT_2D)
        batch = ids.shape[0]
    elif features is not None:
        batch = features.shape[0]
    else:
        raise ContractViolation(INPUT_TOKENS_MISSING)
    if batch <= 1:
        return [tensors]
    lengths = tensors.get("input_lengths")
    if lengths is None:
        raise ContractViolation(INPUT_LENGTHS_MISSING)
    if lengths.ndim != 1:
        raise ContractViolation(INPUT_LENGTHS_NOT_1D)
    rows = []
    for row in range(batch):
        item = {name: array[row:row + 1] for name, array in tensors.items()}
        for name in ("input_ids", "encoder_input_features"):
            if name in item:
                item[name] = item[name][:, : int(lengths[row])]
        rows.append(item)
    return rows


def _singleton(item: Mapping[str, np.ndarray], name: str) -> Any:
    """utils.h extractSingleton(): None if absent; exactly one element, else INVALID_SIZE."""
    if name not in item:
        return None
    array = np.asarray(item[name])
    if array.size != 1:
        raise ContractViolation(INVALID_SIZE.format(name=name))
    return array.reshape(-1)[0].item()


def convert_word_list(flat: Iterable[int]) -> list[list[int]]:
    """utils.cc convertWordList(): a [2, L] word list, flattened: L token ids, then L end offsets padded
    with -1. Returns the words; raises with upstream's message for a malformed list."""
    values = [int(v) for v in flat]
    text = "".join(f"{v} " for v in values)  # utils.cc sparseListToStr()
    n = len(values)
    if n % 2:
        raise ContractViolation(WORDS_ODD_LENGTH.format(words=text))
    num_tokens, current, words = n // 2, 0, []
    for i in range(num_tokens, n):
        if values[i] == -1:
            if any(v != -1 for v in values[i + 1:]):
                raise ContractViolation(WORDS_EXTRA_END.format(words=text))
            break
        if values[i] > num_tokens:
            raise ContractViolation(WORDS_OUT_OF_BOUNDS.format(words=text))
        if i != num_tokens and values[i] <= values[i - 1]:
            raise ContractViolation(WORDS_NOT_INCREASING.format(words=text))
        words.append(values[current:values[i]])
        current = max(current, values[i])
    return words


def request_violation(inputs: Mapping[str, np.ndarray], requested_outputs: Iterable[str],
                      decoupled: bool) -> Violation | None:
    """The first thing upstream refuses in this (non-stop) request, with when it refuses it; None if nothing.
    `inputs` as Triton hands them to the backend (batch dimension first); `requested_outputs` as the request
    names them (Triton names every output when the client names none)."""
    if is_stop_request(inputs):
        return None  # handled by stop_request_error()
    try:
        _check_enqueue(inputs, decoupled)
    except ContractViolation as exc:
        return Violation(str(exc), ENQUEUE_TIME)
    double_only = _double_only(inputs)
    if double_only:
        return Violation(double_only, ENQUEUE_TIME, upstream=False)
    requested = set(requested_outputs)
    for name, message in (("output_ids", OUTPUT_IDS_REQUIRED), ("sequence_length", SEQUENCE_LENGTH_REQUIRED)):
        if name not in requested:  # model_instance_state.cc fillTritonResponse(), in this order
            return Violation(RESPONSE_ERROR_PREFIX + message, RESPONSE_TIME)
    return None


def check_request(inputs: Mapping[str, np.ndarray], requested_outputs: Iterable[str], decoupled: bool) -> str | None:
    """Upstream's message for the first violation in this request (None: upstream accepts it). See
    request_violation() for when upstream sends it: at once, or in place of the first response."""
    violation = request_violation(inputs, requested_outputs, decoupled)
    return violation.message if violation else None


def _check_enqueue(inputs: Mapping[str, np.ndarray], decoupled: bool) -> None:
    items = batch_items(inputs)  # splitBatchInputsTensors()
    # createRequestsFromInputTensors()
    if not decoupled and len(items) > 1:
        raise ContractViolation(BATCH_NEEDS_DECOUPLED)
    if first_flag(inputs, "streaming") and not decoupled:
        raise ContractViolation(STREAMING_NEEDS_DECOUPLED)
    for item in items:
        for name in OUTPUT_CONFIG_FLAGS:
            _singleton(item, name)
        _singleton(item, "exclude_input_in_output")
        if "input_ids" not in item and "encoder_input_features" not in item:
            raise ContractViolation("input_ids or encoder_input_features is not present in the request.")
        if _singleton(item, "request_output_len") is None:
            raise ContractViolation(OUTPUT_LEN_MISSING)
        _singleton(item, "end_id")
        _singleton(item, "pad_id")
        for name in SAMPLING_SINGLETONS:
            _singleton(item, name)
        for name in ("bad_words_list", "stop_words_list"):
            if name in item:
                convert_word_list(np.asarray(item[name]).reshape(-1))


# utils.cc getGuidedDecodingParamsFromTensors() @19290813: the guide types it maps; any other type is dropped
# without a word (the request then runs unguided), and a guide without a type is ignored too.
GUIDE_TYPES = frozenset({"json", "json_schema", "regex", "ebnf_grammar"})
GUIDE_IGNORED = (DOUBLE + "guided_decoding_guide_type {guide_type!r} is not one TensorRT-LLM maps (json, json_schema, "
                 "regex, ebnf_grammar): utils.cc getGuidedDecodingParamsFromTensors() would drop the guide without a "
                 "word and generate unguided")
GUIDE_WITHOUT_TYPE = (DOUBLE + "guided_decoding_guide without guided_decoding_guide_type: TensorRT-LLM "
                      "(utils.cc getGuidedDecodingParamsFromTensors) would ignore the guide and generate unguided")


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _double_only(inputs: Mapping[str, np.ndarray]) -> str | None:
    """What upstream accepts but silently does otherwise than asked, or what corrupts its memory: refused by
    the double, so that no test takes an unguided answer for a guided one, a cut prompt for a whole one, a
    clipped top_k for the one asked, or a logit write out of bounds for a harmless request."""
    item = batch_items(inputs)[0]
    if min_tokens_without_end_id(item):
        return MIN_TOKENS_WITHOUT_END_ID.format(min_tokens=_singleton(item, "min_tokens"))
    top_k = _singleton(item, "runtime_top_k")
    if top_k is not None and int(top_k) > TOP_K_MAX:
        return TOP_K_CLIPPED.format(top_k=int(top_k))
    guide_type, guide = inputs.get("guided_decoding_guide_type"), inputs.get("guided_decoding_guide")
    if guide_type is not None:
        name = _text(np.asarray(guide_type, dtype=object).reshape(-1)[0])
        if name not in GUIDE_TYPES:
            return GUIDE_IGNORED.format(guide_type=name)
    elif guide is not None:
        return GUIDE_WITHOUT_TYPE
    ids, lengths = inputs.get("input_ids"), inputs.get("input_lengths")
    if ids is None or lengths is None or np.asarray(ids).shape[0] != 1 or np.asarray(lengths).size != 1:
        return None
    length, width = int(np.asarray(lengths).reshape(-1)[0]), np.asarray(ids).shape[1]
    if length != width:
        return INPUT_LENGTHS_IGNORED.format(input_lengths=length, ids=width)
    return None


# ----- end ids and top_k (audit round 3: B1, R1, R4) ---------------------------------------------------------
# B1. A guided request with end_id -1 (ignore_eos) fails the batch once its document is complete: xgrammar then
# allows only its stop token (eos), the sampler picks it, end_id -1 does not end the request, and at the next
# step guidedDecoder.cpp GuidedDecoder::build() calls AcceptToken (result unchecked) then FillNextTokenBitmask,
# whose XGRAMMAR_CHECK(!IsStopTokenAccepted()) throws (xgrammar cpp/grammar_matcher.cc, v0.1.18-0.1.29;
# :505 in v0.1.25). executorImpl.cpp forwardAsync() catches it: terminateActiveRequests(), EVERY active request.
GUIDE_WITHOUT_END_ID_SOURCE = ("batch_manager/guidedDecoder.cpp GuidedDecoder::build @000a01de; xgrammar "
                               "cpp/grammar_matcher.cc:505 FillNextTokenBitmask @v0.1.25; executorImpl.cpp "
                               "Executor::Impl::forwardAsync @036a60f7 (terminateActiveRequests)")
STOP_TOKEN_ACCEPTED = ("Check failed: (!IsStopTokenAccepted()) is false: GrammarMatcher has terminated after "
                       "accepting the stop token, but is trying to find the next token mask")
# What the double logs (Triton's log) for each guided request it gets with end_id -1, when it enqueues it.
GUIDED_WITHOUT_END_ID_LOG = (DOUBLE + "a guided request with end_id -1: once its document is complete it fails "
                             "every active request (" + GUIDE_WITHOUT_END_ID_SOURCE + ")")
# R1. kernels/penaltyKernels.cu batchApplyPenalty() @249d93d5: while step < minLength it writes
# logits[endIds[slot]] = MASK_VAL, with no guard for endId -1 (layers/penaltyLayer.cpp setup() has none either):
# the float before the request's logit row (before the buffer for row 0). A request without an end_id input gets
# -1 too (batch_manager/createNewDecoderRequests.cpp: llmReq->mEndId.value_or(-1)). The double refuses both.
MIN_TOKENS_WITHOUT_END_ID = (DOUBLE + "min_tokens {min_tokens} with end_id -1 (or none): TensorRT-LLM's "
                             "kernels/penaltyKernels.cu batchApplyPenalty() @249d93d5 would write logits[-1] "
                             "(out of bounds) at every step before min_tokens")
# R4. kernels/samplingTopKKernels.h TOP_K_MAX; layers/topKSamplingLayer.cpp setup() @03961722 clampTopK(): a
# larger top_k is clipped to it with a log warning, and the request samples from 1024 tokens.
TOP_K_MAX = 1024
TOP_K_CLIPPED = (DOUBLE + "runtime_top_k {top_k} is above TOP_K_MAX (1024): TensorRT-LLM "
                 "(layers/topKSamplingLayer.cpp setup() @03961722, clampTopK) would clip it with only a log warning")


def _is_guided(item: Mapping[str, np.ndarray]) -> bool:
    return "guided_decoding_guide_type" in item and "guided_decoding_guide" in item


def guided_without_end_id(item: Mapping[str, np.ndarray]) -> bool:
    """B1: a guided request (one upstream maps: GUIDE_TYPES) whose end_id is -1."""
    return _is_guided(item) and _singleton(item, "end_id") == -1


def min_tokens_without_end_id(item: Mapping[str, np.ndarray]) -> bool:
    """R1: min_tokens > 0 with end_id -1 or no end_id (MIN_TOKENS_WITHOUT_END_ID)."""
    return _singleton(item, "end_id") in (-1, None) and int(_singleton(item, "min_tokens") or 0) > 0


# R6. TLLM_THROW / TLLM_CHECK texts carry " (<file>:<line>)" and a stack trace after the message
# (include/tensorrt_llm/common/tllmException.h, TllmException::TllmException: the file is the build's absolute
# path). The double gives its errors of those kinds the same shape, with a build path and trace of its own.
TLLM_BUILD_ROOT = "/home/jenkins/agent/workspace/LLM/release-1.1/L0_PostMerge/llm/cpp/tensorrt_llm/"
TLLM_TRACE = ("\n1       0x7f3c2a1b4c3d tensorrt_llm::common::throwRuntimeError(char const*, int, std::string "
              "const&) + 130\n2       0x7f3c2a9e8f10 /usr/local/lib/python3.12/dist-packages/tensorrt_llm/libs/"
              "libtensorrt_llm.so(+0x1a3ef10) [0x7f3c2a9e8f10]\n3       0x7f3c2a9f0021 "
              "tensorrt_llm::executor::Executor::Impl::fetchNewRequests(int, std::optional<float>) + 1233")


def tllm_error(message: str, source: str, line: int) -> str:
    """`message` as a TLLM_THROW / TLLM_CHECK exception's what() reads: ` (<path>:<line>)` and a stack trace
    after it. `source` is the file relative to cpp/tensorrt_llm/."""
    return f"{message} ({TLLM_BUILD_ROOT}{source}:{line}){TLLM_TRACE}"


def executor_violation(prompt_len: int, end_id: int | None, max_input_len: int, vocab_size: int) -> str | None:
    """llmRequest.cpp LlmRequest::validate(), run by executorImpl.cpp fetchNewRequests(): the request's error
    response (sent after enqueue, FINAL). `request_id` in the text is the executor's id; the double numbers
    its requests from 1 like a fresh executor. Returns the message without EXECUTOR_ERROR's wrapping."""
    if end_id is not None and not -1 <= end_id < vocab_size:
        return FETCH_ERROR_PREFIX + END_ID_OUT_OF_RANGE.format(end_id=end_id, vocab_size=vocab_size)
    if prompt_len > max_input_len:
        return FETCH_ERROR_PREFIX + PROMPT_TOO_LONG.format(prompt_len=prompt_len, max_input_len=max_input_len)
    return None


# executorImpl.cpp Executor::Impl::forwardAsync(): an exception of the model's forwardAsync is caught there and
# terminateActiveRequests() sends "Encountered an error in forwardAsync function: " + e.what() to EVERY active
# request (each then ends FINAL with it, through fillTritonResponse: EXECUTOR_ERROR) and drops them all. The
# model's forwardAsync (trtGptModelInflightBatching.cpp) calls guidedDecoder.cpp GuidedDecoder::build(), which
# compiles a new request's guide at its first context step (CompileJSONSchema, Grammar::FromRegex,
# Grammar::FromEBNF): a guide xgrammar cannot compile fails the whole batch. e.what() is xgrammar's error,
# which starts with its log prefix ("[hh:mm:ss] <file>:<line>: "); the double gives the reason without it.
# Read: executorImpl.cpp @036a60f7, guidedDecoder.cpp @000a01de (stored copies; the 1.1.0 tag is not stored).
GUIDE_FAILS_THE_BATCH = ("executorImpl.cpp Executor::Impl::forwardAsync, terminateActiveRequests; "
                         "trtGptModelInflightBatching.cpp forwardAsync -> guidedDecoder.cpp GuidedDecoder::build")
FORWARD_ASYNC_ERROR = "Encountered an error in forwardAsync function: "
# What the double logs (Triton's log) and counts (metric GUIDE_FAILURES_METRIC) for each such guide.
GUIDE_FAILED_LOG = "contract double: a guide failed to compile in the engine, failing every active request: "
GUIDE_FAILURES_METRIC = "trtllm_contract_guide_failures_total"
# The CPU engine's refusal of a guide that does not compile (cpu_engine/guided.py GuideCompiler._compile; an
# unexpected compiler exception: cpu_engine/guide_pool.py GuidePool._run).
_CPU_GUIDE_FAILURE = re.compile(r"invalid guided_decoding_guide for guided_decoding_guide_type '[^']*': (.*)"
                                r"|(compiling the guided_decoding_guide failed: .*)", re.DOTALL)


def engine_guide_failure(message: str | None) -> str | None:
    """The compiler's reason when `message` is the CPU engine's refusal of a guide xgrammar cannot compile
    (upstream: GuidedDecoder::build throws, GUIDE_FAILS_THE_BATCH); None for anything else (compiled, the
    compile queue full, the model unloading)."""
    match = _CPU_GUIDE_FAILURE.fullmatch(message or "")
    return None if match is None else match.group(1) or match.group(2)


def clamped_output_len(prompt_len: int, output_len: int, max_seq_len: int) -> int:
    """LlmRequest::validate(): prompt + request_output_len past max_seq_len is no error upstream: a warning,
    and request_output_len becomes max_seq_len - prompt (no draft tokens here)."""
    return min(output_len, max_seq_len - prompt_len)


# ----- the sampler and the executor's queue ------------------------------------------------------------------
# Read in NVIDIA/TensorRT-LLM `cpp/tensorrt_llm/...` (stored copies; the commit where the index names one). No
# stored copy is release 1.1.0 (9bab773c); where an older and a newer copy agree, 1.1.0 is taken to agree.
SAMPLER_SOURCES = {
    "seed": "layers/defaultDecodingParams.h DefaultDecodingParams::getSeed() @1020a8d7: 0, the curand seed of a "
            "request without one; batch_manager/llmRequest.cpp createChildRequest(): \"If no seed is provided, "
            "the parent's seed defaults to 0\"; maintainers on TensorRT-LLM #1000 and #2411",
    "order": "layers/layersFactory.h createDecodingLayerTypes() @20709ce9: penalty layer, ban-words layer, "
             "decoding (sampling) layer; batch_manager/trtGptModelInflightBatching.cpp forwardAsync(): "
             "GuidedDecoder::execute() (batch_manager/guidedDecoder.cpp @000a01de, invokeLogitsBitmask on the "
             "logits in place) runs before mDecoder->forwardAsync()",
    "penalties": "kernels/penaltyKernels.cu batchApplyPenalty() @249d93d5: logit * 1/(T + 1e-6) when T != 1, "
                 "then repetition, presence and frequency over the prompt's AND the generated tokens (the "
                 "context phase counts input_ids; PR#8127's promptIgnoreLength came after 1.1), then end_id "
                 "masked while fewer than min_tokens were generated",
    "softmax": "layers/samplingLayer.cpp SamplingLayer::forwardAsync() @03961722 (same in a 2026 copy): a "
               "softmax over the whole vocabulary of those processed logits whenever the mode has top-p (the "
               "default top_k_top_p) or log-probs are asked for (probsComputed)",
    "top_k": "kernels/samplingTopKKernels.cu topKStage2Sampling() @03961722 (same in a newer copy): log-prob "
             "= log p(token), or with normalizeLogProbs log(p(token) / sum of the top-k p): 0.0 when k is 1; "
             "cum_log_probs always adds the unnormalised log p; layers/topKSamplingLayer.cpp setup() @03961722 "
             "(mNormalizeLogProbs) and setupTopKRuntimeArgs(): top_k 0 with top_p 0 is top_k 1; top_k 0 "
             "otherwise goes to the top-p layer",
    "top_p": "kernels/samplingTopPKernels.cu epilogue() (the stored copies, 03cff08f and a newer one): log "
             "p(token) over the whole vocabulary, never normalised",
    "normalize": "triton_backend model_instance_state.cc getExecutorConfigFromParams() @0c8de69a: "
                 "normalize_log_probs, default true -> ExecutorConfig normalizeLogProbs",
    "queue": "executor/executorImpl.cpp Executor::Impl::enqueueRequests() @036a60f7: TLLM_THROW when "
             "maxQueueSize > 0 and queued + new > maxQueueSize; model_instance_state.cc "
             "getExecutorConfigFromParams(): maxQueueSize = dynamic_batching.default_queue_policy.max_queue_size, "
             "and enqueue() sends the exception's text as the request's error response at once",
}
DEFAULT_SEED = 0


def effective_seed(seed: int | None) -> int:
    """The seed the executor samples a request with (SAMPLER_SOURCES["seed"]): a request without a `seed`
    input is seeded with 0, so unseeded requests that are otherwise alike draw alike."""
    return DEFAULT_SEED if seed is None else seed


# What upstream reports in output_log_probs / cum_log_probs (return_log_probs): the value the CPU engine under
# the double reports (log-softmax of the model's logits after a guide's mask: the model's own log-prob,
# OpenAI's meaning), all 0.0, or something the double cannot compute (then it refuses the request).
LOG_PROBS_MODEL = "model"
LOG_PROBS_ZERO = "zero"
LOG_PROBS_NOT_MODELLED = (DOUBLE + "with {settings}, TensorRT-LLM reports {output} {what}, which the CPU engine "
                          "under the double does not compute; it refuses the request rather than answer with "
                          "other numbers (rules.log_prob_rule)")


@dataclass(frozen=True)
class LogProbRule:
    output: str | None  # output_log_probs: LOG_PROBS_MODEL, LOG_PROBS_ZERO, or None (not modelled)
    cum: str | None  # cum_log_probs: LOG_PROBS_MODEL or None (not modelled)
    refusal: str | None  # the double's refusal when a filled output is not modelled


def _number(item: Mapping[str, np.ndarray], name: str, default: float) -> float:
    value = _singleton(item, name)
    return default if value is None else float(value)


def log_prob_rule(inputs: Mapping[str, np.ndarray], requested_outputs: Iterable[str],
                  normalize_log_probs: bool) -> LogProbRule:
    """What upstream fills output_log_probs and cum_log_probs with for this (one-row) request
    (SAMPLER_SOURCES). The sampler's distribution is the softmax of the logits after the guide's mask,
    temperature, repetition/presence/frequency penalties (prompt tokens counted), min_tokens' end_id mask and
    bad words, over the whole vocabulary; it is the model's own exactly when none of these but the guide
    changes a logit. Top-k and top-p only pick the token, except that with normalize_log_probs the top-k path
    (effective top_k > 0) reports log(p / the top-k's sum): 0.0 for a greedy request (top_k 1, or top_k 0
    with top_p 0). Absent inputs take upstream's defaults (utils.cc getSamplingConfigFromTensors; top_p 0);
    an absent min_tokens is taken as 0 (the frontend always sends it)."""
    item = batch_items(inputs)[0]  # one row: the CPU engine refuses batches
    temperature = _number(item, "temperature", 1.0)
    top_k, top_p = int(_number(item, "runtime_top_k", 0)), _number(item, "runtime_top_p", 0.0)
    changed = []  # what makes the sampler's distribution other than the model's
    if abs(temperature - 1.0) >= 1e-9:  # penaltyKernels.cu: almostEqual(temperature, 1.0, 1e-9)
        changed.append(f"temperature {temperature:g}")
    for name, neutral in (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
        value = _number(item, name, neutral)
        if abs(value - neutral) >= 1e-9:
            changed.append(f"{name} {value:g}")
    if _number(item, "min_tokens", 0) > 0:
        changed.append("min_tokens > 0")
    if "bad_words_list" in item and convert_word_list(np.asarray(item["bad_words_list"]).reshape(-1)):
        changed.append("bad_words_list")
    processed = LOG_PROBS_MODEL if not changed else None
    effective_top_k = 1 if top_k == 0 and top_p == 0.0 else top_k  # topK kernels setupTopKRuntimeArgs()
    if normalize_log_probs and effective_top_k == 1:
        output = LOG_PROBS_ZERO
    elif normalize_log_probs and effective_top_k > 1:
        output, changed = None, changed + [f"normalize_log_probs true and top_k {effective_top_k}"]
    else:
        output = processed
    filled = filled_outputs(requested_outputs, first_flag(inputs, "return_log_probs"))
    missing = [name for name, rule in (("output_log_probs", output), ("cum_log_probs", processed))
               if name in filled and rule is None]
    refusal = None
    if missing:
        what = ("log p over the top-k tokens renormalised" if output is None and processed is not None
                else "the log-probs of the distribution after those")
        refusal = LOG_PROBS_NOT_MODELLED.format(settings=", ".join(changed), output=" and ".join(missing), what=what)
    return LogProbRule(output, processed, refusal)


# executorImpl.cpp enqueueRequests() (TLLM_THROW: the text up to TLLM_THROW's suffix, see the module docstring)
QUEUE_FULL = "Maximum queue size of {max_queue_size} has been reached, please try again later"


def max_queue_size(config: Mapping[str, Any]) -> int:
    """The executor's queue bound (SAMPLER_SOURCES["queue"]): dynamic_batching.default_queue_policy.
    max_queue_size (Triton's JSON may give the int64 as a string); absent or 0: no bound. The queue holds the
    requests the executor has not yet taken into its batch (fetchNewRequests): for the CPU engine, those
    waiting for a batch row."""
    policy = (config.get("dynamic_batching") or {}).get("default_queue_policy") or {}
    return max(0, int(policy.get("max_queue_size", 0) or 0))


def queue_full(queued: int, bound: int) -> str | None:
    """enqueueRequests(): upstream's refusal for one more request when `queued` already wait (None: taken)."""
    return QUEUE_FULL.format(max_queue_size=bound) if bound > 0 and queued + 1 > bound else None


# ----- responses ---------------------------------------------------------------------------------------------
def filled_outputs(requested: Iterable[str], return_log_probs: bool) -> set[str]:
    """The outputs a response carries (model_instance_state.cc fillTritonResponse()): output_ids and
    sequence_length (which must be requested, see request_violation()); output_log_probs and cum_log_probs
    only when requested AND return_log_probs is true (utils.cc getOutputConfigFromTensors() reads the flag;
    llmRequest.cpp createResult() sets them only then). Nothing else the CPU engine could produce: upstream
    has no top-log-prob outputs (an output it does not know is never filled), and batch_index /
    sequence_index / token counts / perf metrics need batch > 1, num_return_sequences > 1 or a flag the
    double does not serve."""
    requested = set(requested)
    filled = {"output_ids", "sequence_length"} & requested
    if return_log_probs:
        filled |= LOG_PROB_OUTPUTS & requested
    return filled


class ResponseShaper:
    """One request's responses, shaped as upstream shapes them (beam width 1: the CPU engine has no beams;
    upstream pads shorter beams with -1, irrelevant with one).

    From llmRequest.cpp LlmRequest::createResult() and model_instance_state.cc fillTritonResponse():
    - Not streaming: one response, when the request ends: the prompt (unless exclude_input_in_output) and
      every generated token.
    - Streaming: a response whenever new tokens exist or the request ended, carrying only the tokens since
      the last response: never the prompt, whatever exclude_input_in_output says (the count starts after
      the prompt: mMaxSentTokenLen starts at the prompt length). The last response may carry no token
      (output_ids [1, 1, 0], sequence_length [[0]]) e.g. after a cancellation.
    - output_ids [1, beams, len] int32; sequence_length [1, beams] int32 = the ids in THIS response.
    - output_log_probs [1, beams, n] float32 with n = EVERY token generated so far, also when streaming
      (trtGptModelInflightBatching.cpp hands setLogProbs() all generated log-probs each step; createResult()
      returns them all): not the new tokens' only, and never the prompt's.
    - cum_log_probs [1, beams] float32: the running sum.
    - `zero_log_probs` (log_prob_rule(): normalize_log_probs and a greedy request): every output_log_probs
      value 0.0, while cum_log_probs still sums the unnormalised log-probs (topKStage2Sampling()).
    - A cancelled request (client gone, or a stop request) ends like any other: a FINAL response, no error.
    """

    def __init__(self, prompt: list[int], streaming: bool, exclude_input: bool, requested: Iterable[str],
                 return_log_probs: bool, zero_log_probs: bool = False):
        self.zero_log_probs = zero_log_probs
        self.prompt = list(prompt)
        self.streaming = streaming
        self.exclude_input = exclude_input
        self.outputs = filled_outputs(requested, return_log_probs)
        self.generated: list[int] = []
        self.logprobs: list[float] = []
        self.sent = 0  # generated tokens already sent (streaming)

    def step(self, tokens: list[int], logprobs: list[float], finished: bool) -> dict[str, np.ndarray] | None:
        """Record a step's new tokens; the response upstream sends now, or None when it sends none."""
        self.generated += list(tokens)
        self.logprobs += list(logprobs)
        if self.streaming:
            if not finished and len(self.generated) == self.sent:
                return None
            ids = self.generated[self.sent:]
            self.sent = len(self.generated)
        else:
            if not finished:
                return None
            ids = (self.prompt if not self.exclude_input else []) + self.generated
        arrays = {
            "output_ids": np.asarray(ids, dtype=np.int32).reshape(1, 1, len(ids)),
            "sequence_length": np.asarray([[len(ids)]], dtype=np.int32),
            "output_log_probs": np.asarray([0.0] * len(self.logprobs) if self.zero_log_probs else self.logprobs,
                                           dtype=np.float32).reshape(1, 1, len(self.logprobs)),
            "cum_log_probs": np.asarray([[sum(self.logprobs)]], dtype=np.float32),
        }
        return {name: array for name, array in arrays.items() if name in self.outputs}


def new_log_probs(output_log_probs: np.ndarray, new_tokens: int) -> np.ndarray:
    """How a client reads a streamed response's log-probs from upstream: the LAST `new_tokens` entries of
    output_log_probs (which holds every generated token's so far), not the first."""
    flat = np.asarray(output_log_probs).reshape(-1)
    return flat[len(flat) - new_tokens:] if new_tokens else flat[:0]


@dataclass(frozen=True)
class Rule:
    rule: str
    source: str  # upstream file:function
    message: str


RULES: tuple[Rule, ...] = (
    Rule("a parameter read without fallback is missing", f"{MS} GetParameter<std::string>", PARAMETER_MISSING),
    Rule("the config has no parameters at all", f"{MS} GetParameter<std::string>", PARAMETERS_SECTION_MISSING),
    Rule("gpt_model_type not V1/v1/inflight_batching/inflight_fused_batching", f"{MIS} getBatchingTypeFromParams",
         GPT_MODEL_TYPE_INVALID),
    Rule("lookahead decoding without its three sizes", f"{MIS} getExecutorConfigFromParams",
         LOOKAHEAD_PARAMETERS_MISSING),
    Rule("guided decoding on (backend and info path set) but the info file is missing",
         f"{MIS} getGuidedDecodingConfigFromParams", XGRAMMAR_INFO_MISSING),
    Rule("guided decoding on with a backend other than xgrammar", f"{MIS} getGuidedDecodingConfigFromParams",
         GUIDED_BACKEND_INVALID),
    Rule("neither gpt_model_path nor encoder_model_path names an existing path",
         f"{MIS} ModelInstanceState::ModelInstanceState", MODEL_PATHS_EMPTY),
    Rule("stop=true without a request id", f"{MIS} handleStopRequest", STOP_WITHOUT_REQUEST_ID),
    Rule("neither input_ids nor encoder_input_features", f"{UT} splitBatchInputsTensors", INPUT_TOKENS_MISSING),
    Rule("batch > 1 on a non-decoupled model", f"{UT} createRequestsFromInputTensors", BATCH_NEEDS_DECOUPLED),
    Rule("streaming=true on a non-decoupled model", f"{UT} createRequestsFromInputTensors", STREAMING_NEEDS_DECOUPLED),
    Rule("a scalar input with more than one element", "utils.h extractSingleton", INVALID_SIZE),
    Rule("request_output_len missing", f"{UT} createRequestsFromInputTensors", OUTPUT_LEN_MISSING),
    Rule("a malformed stop/bad word list", f"{UT} convertWordList", WORDS_ODD_LENGTH),
    Rule("output_ids not requested (at the first response)", f"{MIS} fillTritonResponse",
         RESPONSE_ERROR_PREFIX + OUTPUT_IDS_REQUIRED),
    Rule("sequence_length not requested (at the first response)", f"{MIS} fillTritonResponse",
         RESPONSE_ERROR_PREFIX + SEQUENCE_LENGTH_REQUIRED),
    Rule("end_id outside [-1, vocab)", "llmRequest.cpp LlmRequest::validate",
         EXECUTOR_ERROR.format(request_id="<id>", message=FETCH_ERROR_PREFIX + END_ID_OUT_OF_RANGE)),
    Rule("prompt longer than max_input_len", "llmRequest.cpp LlmRequest::validate",
         EXECUTOR_ERROR.format(request_id="<id>", message=FETCH_ERROR_PREFIX + PROMPT_TOO_LONG)),
    Rule("a request's guide does not compile: EVERY active request fails with it, not only its own (GPU: the "
         "frontend compiles guides first, frontend/planning/guide_check.py)", GUIDE_FAILS_THE_BATCH,
         EXECUTOR_ERROR.format(request_id="<id>", message=FORWARD_ASYNC_ERROR + "<xgrammar's reason>")),
    # The sampler and the executor's queue (SAMPLER_SOURCES; not errors but what the double does as upstream):
    Rule("no seed input: the request is seeded with 0 (effective_seed)", SAMPLER_SOURCES["seed"],
         "(no error: unseeded requests alike draw alike)"),
    Rule("log-probs with normalize_log_probs on and top_k 1: every output_log_probs value 0.0 (log_prob_rule)",
         SAMPLER_SOURCES["top_k"], "(no error: 0.0)"),
    Rule("log-probs with normalize_log_probs off, or from the top-p path: log-softmax of the logits after the "
         "guide's mask, temperature, penalties (prompt counted), min_tokens and bad words; the double refuses "
         "what it cannot compute (log_prob_rule)", SAMPLER_SOURCES["penalties"], LOG_PROBS_NOT_MODELLED),
    Rule("max_queue_size > 0 requests already wait for the executor", SAMPLER_SOURCES["queue"], QUEUE_FULL),
    Rule("a stop (or Triton's cancellation) for a request not yet scheduled ends it only after its first step "
         "(its prefill), with no tokens", STOP_TAKES_EFFECT_WHEN_SCHEDULED, "(no error: an empty FINAL response)"),
    Rule("a guided request with end_id -1 reaches a complete document: EVERY active request fails (the frontend "
         "keeps the end id under a guide, frontend/planning/sampling.py)", GUIDE_WITHOUT_END_ID_SOURCE,
         EXECUTOR_ERROR.format(request_id="<id>", message=FORWARD_ASYNC_ERROR + STOP_TOKEN_ACCEPTED)),
    Rule("min_tokens > 0 with end_id -1 (the double refuses it: upstream writes out of bounds)",
         "kernels/penaltyKernels.cu batchApplyPenalty @249d93d5", MIN_TOKENS_WITHOUT_END_ID),
    Rule("runtime_top_k above 1024 (the double refuses it: upstream clips it with a log line)",
         "layers/topKSamplingLayer.cpp setup @03961722, clampTopK", TOP_K_CLIPPED),
    Rule("TLLM_THROW / TLLM_CHECK errors carry ' (<path>:<line>)' and a stack trace after the message (tllm_error)",
         "include/tensorrt_llm/common/tllmException.h TllmException", "<message> (/<path>:<line>)\\n<trace>"),
)


# ----- LoRA: the PEFT cache (cpp/tensorrt_llm/batch_manager/peftCacheManager.cpp) ------------------------------
# PeftCacheManager::addRequestPeft(): a request naming a task id without lora_weights/lora_config whose task the
# cache does not hold throws PeftTaskNotCachedException with these words; the executor answers the request with
# them as its error (tests/executor/executorTest: EXPECT_EQ on the whole message). The first request of a task
# must therefore carry its weights, and so must the first one after the task was evicted.
LORA_NOT_CACHED = "LoRA task {task_id} not found in cache. Please send LoRA weights with request"
# loraCache.cpp LoraCache::claimPagesWithEvict(): pages are freed by evicting the least recently used tasks that
# are done (no request in flight uses them); with none left to evict and no room, the put fails with this.
LORA_CACHE_FULL = "Cache is full. There are no done tasks to evict"


class PeftCache:
    """Which task ids upstream's PEFT cache holds, `capacity` tasks at most (upstream sizes it in pages from
    lora_cache_gpu_memory_fraction / lora_cache_host_memory_bytes; the double counts whole tasks, set by its
    test knob test_lora_cache_tasks), evicting the least recently used task no request is using."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.tasks: dict[int, int] = {}  # task id -> requests in flight using it, least recently used first

    def admit(self, task_id: int, has_weights: bool) -> tuple[str | None, list[int]]:
        """A request of `task_id` arrives: (upstream's error or None, the tasks evicted to make room)."""
        if task_id in self.tasks:
            self.tasks[task_id] = self.tasks.pop(task_id)  # used: now the most recent
            return None, []
        if not has_weights:
            return LORA_NOT_CACHED.format(task_id=task_id), []
        evicted = []
        while len(self.tasks) >= self.capacity:
            done = next((task for task, users in self.tasks.items() if users == 0), None)
            if done is None:
                return LORA_CACHE_FULL, evicted
            del self.tasks[done]
            evicted.append(done)
        self.tasks[task_id] = 0
        return None, evicted

    def use(self, task_id: int) -> None:
        """A request of `task_id` is in the engine: its task is not evicted until it ends."""
        if task_id in self.tasks:
            self.tasks[task_id] += 1

    def release(self, task_id: int) -> None:
        """A request of `task_id` ended: once none uses it, the task may be evicted."""
        if task_id in self.tasks:
            self.tasks[task_id] = max(0, self.tasks[task_id] - 1)
