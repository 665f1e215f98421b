"""The TensorRT-LLM contract rules (tests/trtllm_contract/rules.py) on plain dicts and arrays, and the
double's config (double.py add_contract_double) against the rendered production TensorRT-LLM config."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from build_engine.demo_checkpoint import ensure_demo_checkpoint
from build_engine.render import render_repository
from build_engine.values import repository_values
from tests.trtllm_contract import rules
from tests.trtllm_contract.double import REPO_ROOT, add_contract_double, contract_config
# The sampler rules' frontend side (frontend/planning/logprob_rules.py, the queue-full mapping, the metadata field).
from frontend.generation.engine import SamplingOptions
from frontend.generation.triton_engine import TritonEngine
from frontend.generation.triton_errors import error_for
from frontend.generation.trtllm_tensors import build_inputs, requested_outputs
from frontend.api_types.errors import OpenAIError
from frontend.api_types.request_bodies import SamplingFields
from frontend.planning.logprob_rules import check_logprobs_meaning, logprobs_meaning_problems
from tritonclient.utils import InferenceServerException, deserialize_bytes_tensor

TEMPLATE_DIR = REPO_ROOT / "model_repository"
DOUBLE_NAME = "tensorrt_llm_contract"


def config_json(pbtxt: str) -> dict[str, Any]:
    """A config.pbtxt as the JSON Triton hands a Python model (args["model_config"])."""
    message = text_format.Parse(pbtxt, model_config_pb2.ModelConfig())
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny demo checkpoint: add_contract_double reads its tokenizer (for the guided-decoding info)."""
    return ensure_demo_checkpoint(tmp_path_factory.mktemp("demo"), "tiny")


@pytest.fixture()
def engine_dir(tmp_path: Path, checkpoint: Path) -> Path:
    """What add_contract_double reads of a CPU build: engine_config.json and the checkpoint's tokenizer."""
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "engine_config.json").write_text(json.dumps({
        "backend": "cpu", "checkpoint_dir": str(checkpoint), "served_model_name": "demo-tiny",
        "max_batch_size": 16, "max_seq_len": 1024, "max_num_tokens": 512}))
    return engine


def render_trtllm(engine_dir: Path, out: Path, template_dir: Path = TEMPLATE_DIR,
                  tokenizer_info: Path | None = None) -> str:
    engine_config = json.loads((engine_dir / "engine_config.json").read_text())
    if tokenizer_info is not None:
        engine_config["xgrammar_tokenizer_info"] = str(tokenizer_info)
    render_repository(template_dir, repository_values(template_dir, "trtllm", engine_config, engine_dir), out)
    return (out / "tensorrt_llm" / "config.pbtxt").read_text()


@pytest.fixture()
def trtllm_config(engine_dir: Path, tmp_path: Path) -> dict[str, Any]:
    return config_json(render_trtllm(engine_dir, tmp_path / "rendered"))


def without(config: dict[str, Any], *names: str) -> dict[str, Any]:
    copy = json.loads(json.dumps(config))
    for name in names:
        del copy["parameters"][name]
    return copy


def with_params(config: dict[str, Any], **values: str) -> dict[str, Any]:
    copy = json.loads(json.dumps(config))
    for name, value in values.items():
        copy["parameters"][name] = {"string_value": value}
    return copy


# ----- load: parameters ---------------------------------------------------------------------------------------
def test_the_rendered_trtllm_config_loads(trtllm_config: dict[str, Any]) -> None:
    assert rules.check_model_config(trtllm_config) == []
    assert rules.check_interface(trtllm_config) == []


@pytest.mark.parametrize("name", sorted(rules.REQUIRED_PARAMETERS))
def test_a_missing_required_parameter_fails_the_load_with_upstreams_message(trtllm_config, name: str) -> None:
    errors = rules.check_model_config(without(trtllm_config, name))
    assert errors[0] == f"Cannot find parameter with name: {name}"
    assert rules.load_error(errors) == \
        f"unexpected error when creating modelInstanceState: Cannot find parameter with name: {name}"


def test_the_guided_decoding_parameters_are_read_in_upstreams_order(trtllm_config) -> None:
    errors = rules.check_model_config(without(trtllm_config, "guided_decoding_backend", "tokenizer_dir"))
    assert errors == ["Cannot find parameter with name: tokenizer_dir"]  # the first read throws


def test_defaulted_parameters_may_be_missing(trtllm_config) -> None:
    present = [name for name in rules.DEFAULTED_PARAMETERS
               if name in trtllm_config["parameters"] and name != "gpt_model_path"]
    assert "exclude_input_in_output" in present and "enable_kv_cache_reuse" in present
    assert rules.check_model_config(without(trtllm_config, *present)) == []
    assert not set(rules.REQUIRED_PARAMETERS) & set(rules.DEFAULTED_PARAMETERS)


def test_no_parameters_at_all(trtllm_config) -> None:
    config = dict(trtllm_config)
    del config["parameters"]
    assert rules.check_model_config(config) == ["Model config doesn't have a parameters section"]


@pytest.mark.parametrize("value", ["V1", "v1", "inflight_batching", "inflight_fused_batching"])
def test_gpt_model_type_accepted(trtllm_config, value: str) -> None:
    assert rules.check_model_config(with_params(trtllm_config, gpt_model_type=value)) == []


@pytest.mark.parametrize("value", ["", "inflight", "${batching_strategy}", "V2"])
def test_gpt_model_type_refused(trtllm_config, value: str) -> None:
    assert rules.check_model_config(with_params(trtllm_config, gpt_model_type=value)) == [
        "Invalid gpt_model_type. Must be v1/inflight_batching/inflight_fused_batching."]


def test_the_engine_path_has_a_fallback_but_must_exist(trtllm_config, tmp_path: Path) -> None:
    # Not "Cannot find parameter": upstream catches that, warns, and fails later on the empty path.
    assert rules.check_model_config(without(trtllm_config, "gpt_model_path")) == [rules.MODEL_PATHS_EMPTY]
    missing = with_params(trtllm_config, gpt_model_path=str(tmp_path / "nowhere"))
    assert rules.check_model_config(missing) == [
        "[TensorRT-LLM][ERROR] Assertion failed: Both encoder and decoder model paths are empty"]
    assert rules.check_model_config(with_params(missing, encoder_model_path=str(tmp_path))) == []


def test_lookahead_decoding_needs_its_sizes(trtllm_config) -> None:
    config = with_params(trtllm_config, decoding_mode="lookahead")
    assert rules.check_model_config(config) == [rules.LOOKAHEAD_PARAMETERS_MISSING]
    sizes = {"lookahead_window_size": "4", "lookahead_ngram_size": "3", "lookahead_verification_set_size": "2"}
    assert rules.check_model_config(with_params(config, **sizes)) == []
    assert rules.check_model_config(with_params(config, **{**sizes, "lookahead_ngram_size": "x"})) == [
        rules.LOOKAHEAD_PARAMETERS_MISSING]


# ----- load: guided decoding --------------------------------------------------------------------------------
@pytest.fixture()
def tokenizer_info(tmp_path: Path) -> Path:
    path = tmp_path / "xgrammar_tokenizer_info.json"
    path.write_text(json.dumps({"encoded_vocab": ["a", "b"], "tokenizer_str": "{}", "stop_token_ids": [2]}))
    return path


@pytest.mark.parametrize(("backend", "info"), [
    ("", ""), ("xgrammar", ""), ("outlines", ""), ("", "/nowhere/info.json"),
    ("${guided_decoding_backend}", "/nowhere/info.json"), ("xgrammar", "${xgrammar_tokenizer_info_path}"),
])
def test_guided_decoding_is_off_when_backend_or_info_path_is_unset(trtllm_config, backend: str, info: str) -> None:
    config = with_params(trtllm_config, guided_decoding_backend=backend, xgrammar_tokenizer_info_path=info)
    assert rules.check_model_config(config) == []


def test_guided_decoding_with_xgrammar_needs_the_info_file(trtllm_config, tokenizer_info: Path) -> None:
    config = with_params(trtllm_config, guided_decoding_backend="xgrammar",
                         xgrammar_tokenizer_info_path=str(tokenizer_info))
    assert rules.check_model_config(config) == []
    tokenizer_info.unlink()
    assert rules.check_model_config(config) == [
        f"[TensorRT-LLM][ERROR] Assertion failed: Xgrammar's tokenizer info path at {tokenizer_info} does not exist."]


def test_guided_decoding_with_another_backend_fails_once_the_file_is_read(trtllm_config, tokenizer_info) -> None:
    config = with_params(trtllm_config, guided_decoding_backend="outlines",
                         xgrammar_tokenizer_info_path=str(tokenizer_info))
    assert rules.check_model_config(config) == [rules.GUIDED_BACKEND_INVALID]
    assert "'xgrammar' backend" in rules.GUIDED_BACKEND_INVALID


def test_a_tokenizer_info_file_without_upstreams_keys_is_refused(trtllm_config, tokenizer_info: Path) -> None:
    tokenizer_info.write_text(json.dumps({"encoded_vocab": ["a"], "tokenizer_str": "{}"}))
    config = with_params(trtllm_config, guided_decoding_backend="xgrammar",
                         xgrammar_tokenizer_info_path=str(tokenizer_info))
    (error,) = rules.check_model_config(config)
    assert error.startswith(rules.DOUBLE) and "stop_token_ids" in error


# ----- load: parsing as upstream parses --------------------------------------------------------------------
def test_parameters_parse_as_the_cpp_does(trtllm_config) -> None:
    assert rules.parse_like_cpp("int32", "100ms") == 100
    assert rules.parse_like_cpp("float", " 0.85x") == pytest.approx(0.85)
    assert rules.parse_like_cpp("bool", "TRUE") is True
    for kind, text in (("int32", "ms"), ("bool", "yes"), ("float", ""), ("int32_csv", "")):
        with pytest.raises(rules.ContractViolation):
            rules.parse_like_cpp(kind, text)
    config = with_params(trtllm_config, exclude_input_in_output="yes", cancellation_check_period_ms="250")
    assert rules.exclude_input_default(config) is False  # unparsable: the default
    assert rules.cancellation_check_period_s(config) == pytest.approx(0.25)
    assert rules.cancellation_check_period_s(trtllm_config) == pytest.approx(0.02)  # the template's
    assert rules.cancellation_check_period_s(without(trtllm_config, "cancellation_check_period_ms")) == \
        pytest.approx(0.1)  # upstream's default
    warnings = rules.defaulted_parameter_warnings(config)
    assert any("Cannot convert yes to a boolean." in w for w in warnings)
    assert rules.defaulted_parameter_warnings(trtllm_config) == []


# ----- load: the tensor interface --------------------------------------------------------------------------
def _entry(config: dict[str, Any], kind: str, name: str) -> dict[str, Any]:
    return next(e for e in config[kind] if e["name"] == name)


def test_a_tensor_declared_unlike_upstream_is_refused(trtllm_config) -> None:
    config = json.loads(json.dumps(trtllm_config))
    _entry(config, "input", "seed")["data_type"] = "TYPE_INT32"
    _entry(config, "input", "input_lengths")["optional"] = True
    config["output"] = [o for o in config["output"] if o["name"] != "sequence_length"]
    problems = rules.check_interface(config)
    assert any("input seed is TYPE_INT32 in the template, TYPE_UINT64 upstream" in p for p in problems)
    assert any("input_lengths is required upstream but optional" in p for p in problems)
    assert any("sequence_length is not declared" in p for p in problems)
    assert all(p.startswith(rules.DOUBLE) for p in problems)


def test_the_first_byte_flags_need_no_scalar_reshape(trtllm_config) -> None:
    assert "reshape" not in _entry(trtllm_config, "input", "streaming")  # unlike upstream: harmless
    config = json.loads(json.dumps(trtllm_config))
    del _entry(config, "input", "temperature")["reshape"]
    assert rules.check_interface(config) == [
        f"{rules.DOUBLE}input temperature: reshape none in the template, [ ] upstream"]


def test_the_cpu_engine_only_tensors_are_unknown_upstream(trtllm_config) -> None:
    assert rules.unknown_inputs(trtllm_config) == ["top_logprobs"]
    assert rules.unknown_outputs(trtllm_config) == ["output_top_log_prob_ids", "output_top_log_probs"]


# ----- requests ---------------------------------------------------------------------------------------------
FRONTEND_OUTPUTS = {"output_ids", "sequence_length"}


def frontend_request(**overrides: Any) -> dict[str, np.ndarray]:
    """What the frontend sends (frontend/generation/trtllm_tensors.py build_inputs), as the backend sees it: batch 1,
    scalar-reshaped inputs as [1]."""
    inputs: dict[str, Any] = {
        "input_ids": np.array([[5, 6, 7]], dtype=np.int32),
        "input_lengths": np.array([3], dtype=np.int32),
        "request_output_len": np.array([4], dtype=np.int32),
        "streaming": np.array([[True]]),
        "exclude_input_in_output": np.array([True]),
        "temperature": np.array([1.0], dtype=np.float32),
        "runtime_top_k": np.array([1], dtype=np.int32),
        "min_tokens": np.array([0], dtype=np.int32),
    }
    inputs.update(overrides)
    return {name: value for name, value in inputs.items() if value is not None}


def test_the_frontends_request_is_accepted() -> None:
    assert rules.check_request(frontend_request(), FRONTEND_OUTPUTS, decoupled=True) is None
    everything = FRONTEND_OUTPUTS | {"output_log_probs", "cum_log_probs", "output_top_log_probs"}
    assert rules.check_request(frontend_request(top_logprobs=np.array([2], dtype=np.int32)), everything, True) is None


def test_a_request_that_does_not_ask_for_sequence_length_is_refused_at_its_first_response() -> None:
    violation = rules.request_violation(frontend_request(), {"output_ids"}, decoupled=True)
    assert violation == rules.Violation(
        "Error encountered while populating response: sequence_length tensor must be present in list of "
        "output tensors", rules.RESPONSE_TIME)
    assert rules.SEQUENCE_LENGTH_REQUIRED in rules.check_request(frontend_request(), {"output_ids"}, True)
    assert rules.check_request(frontend_request(), {"sequence_length"}, True) == \
        rules.RESPONSE_ERROR_PREFIX + rules.OUTPUT_IDS_REQUIRED  # output_ids is checked first
    assert rules.check_request(frontend_request(), set(), True) == \
        rules.RESPONSE_ERROR_PREFIX + rules.OUTPUT_IDS_REQUIRED


@pytest.mark.parametrize(("overrides", "message"), [
    ({"input_ids": None}, "inputTokens or encoderInputFeatures tensor not provided"),
    ({"request_output_len": None}, "request_output_len is not present in the request"),
    ({"input_ids": np.array([5, 6, 7], dtype=np.int32)},
     "[TensorRT-LLM][ERROR] Assertion failed: Expected inputTokens tensors to have 2 dimensions"),
    ({"temperature": np.array([1.0, 0.5], dtype=np.float32)},
     "[TensorRT-LLM][ERROR] Assertion failed: Invalid size for tensor temperature"),
    ({"return_log_probs": np.array([True, True])},
     "[TensorRT-LLM][ERROR] Assertion failed: Invalid size for tensor return_log_probs"),
    ({"stop_words_list": np.array([[[5, 6, 7], [1, 3, -1]]], dtype=np.int32), "bad_words_list":
      np.array([[[5, 6], [2, 1]]], dtype=np.int32)},
     "[TensorRT-LLM][ERROR] Assertion failed: Sparse list must not have non-increasing offsets: 5 6 2 1 "),
])
def test_what_upstream_refuses_at_enqueue(overrides: dict[str, Any], message: str) -> None:
    violation = rules.request_violation(frontend_request(**overrides), FRONTEND_OUTPUTS, decoupled=True)
    assert violation == rules.Violation(message, rules.ENQUEUE_TIME)


def test_enqueue_errors_come_before_the_response_time_ones() -> None:
    assert rules.check_request(frontend_request(input_ids=None), {"output_ids"}, True) == rules.INPUT_TOKENS_MISSING


def test_streaming_and_batches_need_a_decoupled_model() -> None:
    assert rules.check_request(frontend_request(), FRONTEND_OUTPUTS, decoupled=False) == \
        "Streaming is only supported if model is deployed using decoupled mode."
    not_streamed = frontend_request(streaming=np.array([[False]]))
    assert rules.check_request(not_streamed, FRONTEND_OUTPUTS, decoupled=False) is None
    batch = frontend_request(streaming=None, input_ids=np.array([[5, 6, 7], [8, 9, 0]], dtype=np.int32),
                             input_lengths=np.array([3, 2], dtype=np.int32),
                             request_output_len=np.array([4, 4], dtype=np.int32),
                             exclude_input_in_output=None, temperature=None, runtime_top_k=None, min_tokens=None)
    assert rules.check_request(batch, FRONTEND_OUTPUTS, decoupled=False) == rules.BATCH_NEEDS_DECOUPLED
    assert rules.check_request(batch, FRONTEND_OUTPUTS, decoupled=True) is None
    rows = rules.batch_items(batch)
    assert [row["input_ids"].tolist() for row in rows] == [[[5, 6, 7]], [[8, 9]]]  # cut to input_lengths


def test_a_one_row_request_is_not_cut_to_input_lengths() -> None:
    inputs = frontend_request(input_lengths=np.array([2], dtype=np.int32))
    (row,) = rules.batch_items(inputs)
    assert row["input_ids"].tolist() == [[5, 6, 7]]
    violation = rules.request_violation(inputs, FRONTEND_OUTPUTS, decoupled=True)
    assert violation is not None and not violation.upstream and violation.when == rules.ENQUEUE_TIME
    assert violation.message.startswith(rules.DOUBLE) and "ignores input_lengths" in violation.message


def test_stop_requests() -> None:
    stop = {"stop": np.array([[True]]), "input_lengths": np.array([1], dtype=np.int32),
            "request_output_len": np.array([1], dtype=np.int32)}
    assert rules.is_stop_request(stop) and not rules.is_stop_request(frontend_request())
    assert not rules.is_stop_request({**stop, "stop": np.array([[False]])})
    assert rules.check_request(stop, set(), decoupled=False) is None  # no input_ids needed: answered at once
    assert rules.stop_request_error("") == "Trying to stop a request but request ID is not provided"
    assert rules.stop_request_error("abc") is None


def test_word_lists_are_read_as_upstream_reads_them() -> None:
    assert rules.convert_word_list([5, 6, 7, 1, 3, -1]) == [[5], [6, 7]]
    assert rules.convert_word_list([]) == []
    for flat, message in (([5, 6, 1], rules.WORDS_ODD_LENGTH), ([5, 6, -1, 2], rules.WORDS_EXTRA_END),
                          ([5, 6, 1, 3], rules.WORDS_OUT_OF_BOUNDS)):
        with pytest.raises(rules.ContractViolation) as caught:
            rules.convert_word_list(flat)
        assert str(caught.value) == message.format(words="".join(f"{v} " for v in flat))


def test_what_the_executor_refuses_or_clamps() -> None:
    assert rules.executor_violation(10, -1, 63, 100) is None  # -1: no end id
    assert rules.executor_violation(10, 100, 63, 100) == (
        "Encountered an error when fetching new request: [TensorRT-LLM][ERROR] Assertion failed: EndId (100) is "
        "not within acceptable range [-1, 100).")
    message = rules.executor_violation(64, None, 63, 100)
    assert message.startswith("Encountered an error when fetching new request: Prompt length (64) exceeds maximum "
                              "input length (63).")
    assert rules.clamped_output_len(10, 100, 64) == 54  # no error upstream: a warning and a shorter answer
    assert rules.clamped_output_len(10, 5, 64) == 5


# ----- responses --------------------------------------------------------------------------------------------
def test_log_prob_outputs_only_with_return_log_probs() -> None:
    requested = {"output_ids", "sequence_length", "output_log_probs", "cum_log_probs", "output_top_log_probs",
                 "output_top_log_prob_ids"}
    assert rules.filled_outputs(requested, return_log_probs=False) == {"output_ids", "sequence_length"}
    assert rules.filled_outputs(requested, return_log_probs=True) == {
        "output_ids", "sequence_length", "output_log_probs", "cum_log_probs"}
    assert rules.filled_outputs({"output_ids", "sequence_length"}, True) == {"output_ids", "sequence_length"}


ALL = {"output_ids", "sequence_length", "output_log_probs", "cum_log_probs"}


def test_streamed_responses_carry_new_tokens_and_every_log_prob_so_far() -> None:
    shaper = rules.ResponseShaper([5, 6, 7], streaming=True, exclude_input=False, requested=ALL,
                                  return_log_probs=True)
    first = shaper.step([11], [-0.5], finished=False)
    assert first["output_ids"].tolist() == [[[11]]]  # never the prompt when streaming, whatever exclude says
    assert first["output_ids"].dtype == np.int32 and first["sequence_length"].tolist() == [[1]]
    assert shaper.step([], [], finished=False) is None
    second = shaper.step([12], [-0.25], finished=False)
    assert second["output_ids"].tolist() == [[[12]]] and second["sequence_length"].tolist() == [[1]]
    assert second["output_log_probs"].tolist() == [[[-0.5, -0.25]]]  # cumulative, not the new token's only
    assert second["output_log_probs"].dtype == np.float32
    assert second["cum_log_probs"].tolist() == [[-0.75]]
    last = shaper.step([], [], finished=True)  # e.g. cancelled: a normal FINAL response without tokens
    assert last["output_ids"].shape == (1, 1, 0) and last["sequence_length"].tolist() == [[0]]
    assert rules.new_log_probs(second["output_log_probs"], 1).tolist() == [-0.25]


@pytest.mark.parametrize(("exclude", "ids"), [(False, [5, 6, 7, 11, 12]), (True, [11, 12])])
def test_a_non_streamed_request_gets_one_response_at_the_end(exclude: bool, ids: list[int]) -> None:
    shaper = rules.ResponseShaper([5, 6, 7], streaming=False, exclude_input=exclude, requested=ALL,
                                  return_log_probs=True)
    assert shaper.step([11], [-0.5], finished=False) is None
    response = shaper.step([12], [-0.25], finished=True)
    assert response["output_ids"].tolist() == [[ids]] and response["sequence_length"].tolist() == [[len(ids)]]
    assert response["output_log_probs"].tolist() == [[[-0.5, -0.25]]]  # generated tokens only, never the prompt


def test_without_return_log_probs_the_log_prob_outputs_are_absent() -> None:
    shaper = rules.ResponseShaper([5], streaming=True, exclude_input=True, requested=ALL, return_log_probs=False)
    assert set(shaper.step([11], [-0.5], finished=True)) == {"output_ids", "sequence_length"}


# ----- the double's config -----------------------------------------------------------------------------------
def test_the_double_differs_from_the_trtllm_config_in_backend_and_name_only(engine_dir: Path, tmp_path: Path) -> None:
    repository = tmp_path / "repository"
    repository.mkdir()
    add_contract_double(repository, DOUBLE_NAME, engine_dir)
    tokenizer_info = repository / DOUBLE_NAME / "xgrammar_tokenizer_info.json"
    assert json.loads(tokenizer_info.read_text())["stop_token_ids"]  # written beside it, as a build writes it
    production = render_trtllm(engine_dir, tmp_path / "reference", tokenizer_info=tokenizer_info).splitlines()
    double = (repository / DOUBLE_NAME / "config.pbtxt").read_text().splitlines()
    assert len(double) == len(production)
    assert [(a, b) for a, b in zip(production, double) if a != b] == [
        ('name: "tensorrt_llm"', f'name: "{DOUBLE_NAME}"'), ('backend: "tensorrtllm"', 'backend: "python"')]
    loader = (repository / DOUBLE_NAME / "1" / "model.py").read_text()
    assert str(REPO_ROOT / "tests" / "trtllm_contract" / "double.py") in loader
    config = config_json("\n".join(double))
    assert rules.check_model_config(config) == [] and rules.check_interface(config) == []
    with pytest.raises(ValueError, match="already exists"):
        add_contract_double(repository, DOUBLE_NAME, engine_dir)


def test_the_step_delay_knob_is_the_only_addition(engine_dir: Path, tmp_path: Path) -> None:
    add_contract_double(tmp_path, DOUBLE_NAME, engine_dir, test_step_delay_s=0.02)
    config = config_json((tmp_path / DOUBLE_NAME / "config.pbtxt").read_text())
    assert config["parameters"]["test_step_delay_s"] == {"string_value": "0.02"}
    reference = config_json(render_trtllm(engine_dir, tmp_path / "reference"))
    assert set(config["parameters"]) - set(reference["parameters"]) == {"test_step_delay_s"}
    with pytest.raises(ValueError, match="unknown knob"):
        add_contract_double(tmp_path, "other", engine_dir, test_hold_first_response_s=1.0)


@pytest.mark.parametrize("count", [0, 2])
def test_the_backend_line_must_be_there_exactly_once(count: int) -> None:
    rendered = 'name: "tensorrt_llm"\n' + 'backend: "tensorrtllm"\n' * count + "max_batch_size: 8\n"
    with pytest.raises(ValueError, match=f"found {count}"):
        contract_config(rendered, DOUBLE_NAME)


def test_a_template_upstream_would_refuse_makes_the_double_refuse(engine_dir: Path, tmp_path: Path) -> None:
    """The template as it was before the guided-decoding parameters: tokenizer_dir missing."""
    template = tmp_path / "template"
    shutil.copytree(TEMPLATE_DIR, template, ignore=shutil.ignore_patterns("__pycache__"))
    engine_template = template / "tensorrt_llm" / "config.pbtxt"
    block = 'parameters: {\n  key: "tokenizer_dir"\n  value: { string_value: "${tokenizer_dir}" }\n}\n'
    assert block in engine_template.read_text()
    engine_template.write_text(engine_template.read_text().replace(block, ""))
    add_contract_double(tmp_path, DOUBLE_NAME, engine_dir, template_dir=template)
    config = config_json((tmp_path / DOUBLE_NAME / "config.pbtxt").read_text())
    assert rules.load_error(rules.check_model_config(config)) == \
        "unexpected error when creating modelInstanceState: Cannot find parameter with name: tokenizer_dir"


def test_a_guide_upstream_would_drop_without_a_word_is_refused_by_the_double() -> None:
    base = {"input_ids": np.array([[1, 2]], dtype=np.int32), "input_lengths": np.array([[2]], dtype=np.int32),
            "request_output_len": np.array([[4]], dtype=np.int32)}
    outputs = {"output_ids", "sequence_length"}
    guided = {**base, "guided_decoding_guide_type": np.array([[b"json_schema"]], dtype=object),
              "guided_decoding_guide": np.array([[b'{"type": "object"}']], dtype=object)}
    assert rules.check_request(guided, outputs, decoupled=True) is None
    unknown = {**guided, "guided_decoding_guide_type": np.array([[b"xml"]], dtype=object)}
    assert "'xml' is not one TensorRT-LLM maps" in rules.check_request(unknown, outputs, decoupled=True)
    no_type = {**base, "guided_decoding_guide": guided["guided_decoding_guide"]}
    assert "without guided_decoding_guide_type" in rules.check_request(no_type, outputs, decoupled=True)


# ----- the sampler: seeds and log-probs (rules.SAMPLER_SOURCES) --------------------------------------------------
NUMPY_TYPES = {"INT32": np.int32, "FP32": np.float32, "BOOL": np.bool_, "UINT64": np.uint64}


def backend_inputs(options: SamplingOptions, prompt: list[int] = [5, 6, 7]) -> dict[str, np.ndarray]:
    """What the frontend sends for `options` (build_inputs), as numpy arrays the way the backend reads them."""
    arrays = {}
    for tensor in build_inputs(prompt, options):
        content, shape = tensor._get_content(), tensor.shape()
        if tensor.datatype() == "BYTES":
            arrays[tensor.name()] = deserialize_bytes_tensor(content).reshape(shape)
        else:
            arrays[tensor.name()] = np.frombuffer(content, dtype=NUMPY_TYPES[tensor.datatype()]).reshape(shape)
    return arrays


def openai_request(**fields: Any) -> SamplingFields:
    return SamplingFields(model="m", **fields)


def engine_options(req: SamplingFields) -> SamplingOptions:
    """As frontend/generation/serving.py choice_jobs turns a request into one choice's options."""
    return SamplingOptions(max_tokens=8, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=1,
                           presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                           repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens, eos_token_id=2,
                           logprobs=True)


def test_an_unseeded_request_is_seeded_with_0() -> None:
    assert rules.effective_seed(None) == rules.DEFAULT_SEED == 0
    assert rules.effective_seed(7) == 7


def test_the_trtllm_config_asks_for_full_vocabulary_log_probs(trtllm_config, engine_dir: Path,
                                                               tmp_path: Path) -> None:
    """values/trtllm.json: normalize_log_probs false (upstream's default, true, makes greedy log-probs 0.0);
    the CPU engine's values say what its log-probs are instead."""
    assert rules.get_parameter(trtllm_config, "normalize_log_probs") == "false"
    assert rules.parameter_value(trtllm_config, "normalize_log_probs") is False
    assert rules.parameter_value(without(trtllm_config, "normalize_log_probs"), "normalize_log_probs") is True
    engine_config = json.loads((engine_dir / "engine_config.json").read_text())
    render_repository(TEMPLATE_DIR, repository_values(TEMPLATE_DIR, "cpu", engine_config, engine_dir), tmp_path / "cpu")
    cpu = config_json((tmp_path / "cpu" / "tensorrt_llm" / "config.pbtxt").read_text())
    assert rules.get_parameter(cpu, "normalize_log_probs") == "model"


LOG_PROB_OUTPUTS_ASKED = {"output_ids", "sequence_length", "output_log_probs"}  # what the frontend asks for


@pytest.mark.parametrize(("fields", "normalized", "plain"), [
    # (request, output_log_probs with normalize_log_probs true, ... false): zero / model / None (refused)
    ({"temperature": 0}, rules.LOG_PROBS_ZERO, rules.LOG_PROBS_MODEL),
    ({"temperature": 1.0}, rules.LOG_PROBS_MODEL, rules.LOG_PROBS_MODEL),  # top_k 0: the top-p path
    ({"temperature": 1.0, "top_p": 0.5}, rules.LOG_PROBS_MODEL, rules.LOG_PROBS_MODEL),
    ({"temperature": 1.0, "top_k": 5}, None, rules.LOG_PROBS_MODEL),
    ({"temperature": 1.0, "top_k": 1}, rules.LOG_PROBS_ZERO, rules.LOG_PROBS_MODEL),
    ({"temperature": 0.7}, None, None),
    ({"temperature": 0, "presence_penalty": 0.5}, rules.LOG_PROBS_ZERO, None),  # 0.0 whatever came before
    ({"temperature": 1.0, "frequency_penalty": 0.5}, None, None),
    ({"temperature": 1.0, "repetition_penalty": 1.2}, None, None),
    ({"temperature": 1.0, "min_tokens": 3}, None, None),
])
def test_what_output_log_probs_hold(fields: dict[str, Any], normalized: str | None, plain: str | None) -> None:
    inputs = backend_inputs(engine_options(openai_request(**fields)))
    for normalize, expected in ((True, normalized), (False, plain)):
        rule = rules.log_prob_rule(inputs, LOG_PROB_OUTPUTS_ASKED, normalize)
        assert rule.output == expected, (normalize, rule)
        assert (rule.refusal is None) == (expected is not None)
        if rule.refusal is not None:
            assert rule.refusal.startswith(rules.DOUBLE) and "output_log_probs" in rule.refusal
    without_flag = {name: value for name, value in inputs.items() if name != "return_log_probs"}
    assert rules.log_prob_rule(without_flag, LOG_PROB_OUTPUTS_ASKED, True).refusal is None  # nothing filled


def test_cum_log_probs_are_never_normalised() -> None:
    inputs = backend_inputs(engine_options(openai_request(temperature=0, presence_penalty=0.5)))
    rule = rules.log_prob_rule(inputs, LOG_PROB_OUTPUTS_ASKED | {"cum_log_probs"}, normalize_log_probs=True)
    assert rule.output == rules.LOG_PROBS_ZERO and rule.cum is None
    assert "cum_log_probs" in rule.refusal and "presence_penalty 0.5" in rule.refusal
    shaper = rules.ResponseShaper([5], streaming=True, exclude_input=True, requested=ALL, return_log_probs=True,
                                  zero_log_probs=True)
    first = shaper.step([11], [-0.5], finished=False)
    second = shaper.step([12], [-0.25], finished=True)
    assert first["output_log_probs"].tolist() == [[[0.0]]] and second["output_log_probs"].tolist() == [[[0.0, 0.0]]]
    assert second["cum_log_probs"].tolist() == [[-0.75]]  # topKStage2Sampling adds the unnormalised log p


REQUESTS = [{"temperature": 0}, {"temperature": 1.0}, {"temperature": 1.0, "top_p": 0.3}, {"temperature": 0.7},
            {"temperature": 1.0, "top_k": 1}, {"temperature": 1.0, "top_k": 40}, {"temperature": 0, "top_k": 40},
            {"temperature": 0, "presence_penalty": -1.0}, {"temperature": 1.0, "frequency_penalty": 2.0},
            {"temperature": 0, "repetition_penalty": 1.1}, {"temperature": 0, "min_tokens": 2},
            {"temperature": 1.5, "top_k": 3, "min_tokens": 1}]


@pytest.mark.parametrize("fields", REQUESTS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
@pytest.mark.parametrize(("log_probs", "normalize"), [("sampling", False), ("top_k_normalized", True)])
def test_the_frontend_refuses_exactly_the_log_probs_tensorrt_llm_reports_otherwise(
        fields: dict[str, Any], log_probs: str, normalize: bool) -> None:
    """frontend/planning/logprob_rules.py against the engine side of the rule: through build_inputs, a request it lets
    through gets the model's own log-probs from TensorRT-LLM (what the CPU engine reports), and one it refuses
    would not. On the CPU engine ("model") nothing is refused."""
    req = openai_request(**fields)
    rule = rules.log_prob_rule(backend_inputs(engine_options(req)), requested_outputs(engine_options(req)), normalize)
    problems = logprobs_meaning_problems(req, log_probs)
    assert (not problems) == (rule.output == rules.LOG_PROBS_MODEL), (problems, rule)
    assert logprobs_meaning_problems(req, "model") == []
    check_logprobs_meaning(req, False, log_probs)  # no log-probs asked: nothing to refuse
    if problems:
        with pytest.raises(OpenAIError) as refused:
            check_logprobs_meaning(req, True, log_probs, "logprobs")
        assert refused.value.status == 400 and refused.value.param == "logprobs"
        assert refused.value.type == "invalid_request_error" and problems[0] in refused.value.message
    else:
        check_logprobs_meaning(req, True, log_probs)


@pytest.mark.parametrize(("value", "meaning"), [("model", "model"), ("false", "sampling"), ("0", "sampling"),
                                                ("true", "top_k_normalized"), (None, "top_k_normalized"),
                                                ("", "top_k_normalized"), ("no", "top_k_normalized")])
def test_the_frontend_reads_what_the_engines_log_probs_are(value: str | None, meaning: str) -> None:
    """TritonEngine.metadata: normalize_log_probs as the C++ backend parses it (absent or unparsable: true), and
    the CPU engine's "model"."""
    import asyncio

    async def read() -> str:
        engine = TritonEngine("127.0.0.1:1", "tensorrt_llm")
        params = {"max_seq_len": "512"} if value is None else {"max_seq_len": "512", "normalize_log_probs": value}

        async def parameters(model: str) -> dict[str, str]:
            return params

        engine._parameters = parameters
        try:
            return (await engine.metadata()).log_probs
        finally:
            await engine.close()

    assert asyncio.run(read()) == meaning


# ----- the executor's queue --------------------------------------------------------------------------------------
def test_the_executor_queue_bound_comes_from_dynamic_batching(trtllm_config) -> None:
    assert rules.max_queue_size(trtllm_config) == 0  # the template's: no bound
    config = json.loads(json.dumps(trtllm_config))
    config["dynamic_batching"]["default_queue_policy"] = {"max_queue_size": "2"}  # Triton's JSON: int64 as text
    assert rules.max_queue_size(config) == 2
    assert rules.max_queue_size({"parameters": {}}) == 0
    assert rules.queue_full(1, 2) is None and rules.queue_full(5, 0) is None
    assert rules.queue_full(2, 2) == "Maximum queue size of 2 has been reached, please try again later"


def test_the_double_can_be_rendered_with_another_queue_and_normalize_log_probs(engine_dir: Path,
                                                                               tmp_path: Path) -> None:
    add_contract_double(tmp_path, DOUBLE_NAME, engine_dir, parameters={"normalize_log_probs": "true"},
                        max_queue_size=2)
    config = config_json((tmp_path / DOUBLE_NAME / "config.pbtxt").read_text())
    assert rules.max_queue_size(config) == 2 and rules.parameter_value(config, "normalize_log_probs") is True
    assert rules.check_model_config(config) == [] and rules.check_interface(config) == []
    with pytest.raises(ValueError, match="'no_such_key' 0 times"):
        add_contract_double(tmp_path, "other", engine_dir, parameters={"no_such_key": "1"})


def test_the_executors_full_queue_is_a_429_with_retry_after() -> None:
    message = (rules.QUEUE_FULL.format(max_queue_size=2) + " (/src/tensorrt_llm/cpp/tensorrt_llm/executor/"
               "executorImpl.cpp:612)\n1       0x7f0 tensorrt_llm::common::throwRuntimeError")
    error = error_for(InferenceServerException(msg=message), "tensorrt_llm")
    assert error.status == 429 and error.code == "overloaded" and int(error.headers["Retry-After"]) >= 1
    assert "Maximum queue size of 2 has been reached" in error.message


# ----- LoRA (rules.PeftCache, peftCacheManager.cpp / loraCache.cpp) -------------------------------------------
def test_the_rendered_trtllm_config_carries_the_lora_inputs_and_cache_parameters(trtllm_config) -> None:
    inputs = {i["name"]: i for i in trtllm_config["input"]}
    assert inputs["lora_weights"]["data_type"] == "TYPE_FP16"  # upstream's declaration (the engine's dtype)
    assert inputs["lora_config"]["dims"] == ["-1", "3"] or inputs["lora_config"]["dims"] == [-1, 3]
    assert inputs["lora_task_id"]["data_type"] == "TYPE_UINT64"
    for name in ("lora_cache_optimal_adapter_size", "lora_cache_max_adapter_size",
                 "lora_cache_gpu_memory_fraction", "lora_cache_host_memory_bytes"):
        assert rules.parameter_value(trtllm_config, name) is not None, name
    assert rules.parameter_value(trtllm_config, "lora_cache_max_adapter_size") == 64


def test_a_lora_input_declared_unlike_upstream_is_refused(trtllm_config) -> None:
    for entry in trtllm_config["input"]:
        if entry["name"] == "lora_weights":
            entry["data_type"] = "TYPE_FP32"
    assert rules.check_interface(trtllm_config) == [
        f"{rules.DOUBLE}input lora_weights is TYPE_FP32 in the template, TYPE_FP16 upstream"]


def test_the_first_request_of_a_lora_task_must_carry_its_weights() -> None:
    cache = rules.PeftCache(capacity=2)
    assert cache.admit(10, has_weights=False) == (
        "LoRA task 10 not found in cache. Please send LoRA weights with request", [])
    assert cache.admit(10, has_weights=True) == (None, [])
    assert cache.admit(10, has_weights=False) == (None, [])  # cached: the task id alone


def test_the_lora_cache_evicts_the_least_recently_used_task_no_request_uses() -> None:
    cache = rules.PeftCache(capacity=2)
    cache.admit(1, True)
    cache.admit(2, True)
    cache.admit(1, False)  # 1 used: 2 is now the least recently used
    assert cache.admit(3, True) == (None, [2])
    assert cache.admit(2, False)[0] == rules.LORA_NOT_CACHED.format(task_id=2)
    cache.use(1)
    cache.use(3)  # both in flight: nothing may be evicted
    assert cache.admit(4, True) == (rules.LORA_CACHE_FULL, [])
    cache.release(1)
    assert cache.admit(4, True) == (None, [1])
