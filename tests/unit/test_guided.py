"""Guided decoding in the CPU engine (cpu_engine/guided.py with xgrammar), driven through the scheduler without
Triton, on the tiny demo checkpoint (random weights: whatever the grammar lets through is what comes out,
so a sample that parses says the mask works, not that the model is good)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
import threading
import types
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from build_engine.cpu_engine_builder import write_int8_weights
from build_engine.demo_checkpoint import ensure_demo_checkpoint
from cpu_engine.config import EngineConfig
from cpu_engine.guide_pool import SHUT_DOWN, GuidePool
from cpu_engine.guided import GuideCompiler, GuidedRows, GuideError, pack_bits
from cpu_engine.runner import LlamaRunner
from cpu_engine.sampling import SamplingParams, SamplingRow, sample
from cpu_engine.scheduler import STOPPED_BY_ID, FinishReason, GenerationRequest, RequestError, Scheduler
from tests.unit.test_cpu_engine import ListSink, run_until_done

SLOTS = 24
MAX_NEW = 256
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "role", "tags", "address"],
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city", "zip"],
            "properties": {"city": {"type": "string", "maxLength": 10},
                           "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
        },
        "active": {"type": "boolean"},
    },
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model gains nothing from a second thread, and on a shared machine whose other core is busy
    OpenMP's waits for it made this file 5-10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_checkpoint(tmp_path_factory.mktemp("demo"), "tiny")


@pytest.fixture(scope="module")
def tokenizer(demo: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo))


@pytest.fixture(scope="module")
def runner(demo: Path) -> LlamaRunner:
    return LlamaRunner(EngineConfig(checkpoint_dir=demo, max_batch_size=SLOTS, max_seq_len=512, max_num_tokens=256))


@pytest.fixture(scope="module")
def int8_runner(demo: Path, tmp_path_factory: pytest.TempPathFactory) -> LlamaRunner:
    """The same model on the int8 weights `build_engine --weights int8` makes."""
    weights = write_int8_weights(demo, tmp_path_factory.mktemp("int8-engine"))
    return LlamaRunner(EngineConfig(checkpoint_dir=demo, max_batch_size=SLOTS, max_seq_len=512, max_num_tokens=256,
                                    int8_weights=weights))


@pytest.fixture(params=["float32", "int8"])
def any_runner(request: pytest.FixtureRequest) -> LlamaRunner:
    """Runs a test once per weight format."""
    return request.getfixturevalue("runner" if request.param == "float32" else "int8_runner")


@pytest.fixture(scope="module")
def compiler(tokenizer, runner: LlamaRunner) -> GuideCompiler:
    return GuideCompiler(tokenizer, runner.vocab_size)


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer.encode("<|im_start|>user\nanswer in the format asked<|im_end|>\n<|im_start|>assistant\n")


def scheduler_for(runner: LlamaRunner) -> Scheduler:
    return Scheduler(runner, 256)  # every request below ends within the test: the runner's slots are reused


def sampled(seed: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=1.0, seed=seed, **kwargs)  # top_p 1: sampling, not greedy


def generate(runner, tokenizer, requests: list[GenerationRequest]) -> list[str]:
    scheduler = scheduler_for(runner)
    for req in requests:
        scheduler.add(req)
    run_until_done(scheduler)
    assert scheduler._guided == 0 and not scheduler.running
    return [tokenizer.decode(req.sink.tokens, skip_special_tokens=True) for req in requests]


def guided(rid: str, prompt: list[int], guide, tokenizer, seed: int | None = None, max_new: int = MAX_NEW,
           **kwargs) -> GenerationRequest:
    sampling = kwargs.pop("sampling", None) or (sampled(seed) if seed is not None else SamplingParams())
    kwargs.setdefault("end_id", tokenizer.eos_token_id)
    return GenerationRequest(rid, prompt, max_new, ListSink(), sampling, guide=guide, **kwargs)


def test_json_schema_samples_parse_strictly_validate_and_end_by_themselves(runner, tokenizer, compiler, prompt):
    # The maxLength strings matter: xgrammar 0.2.9 lets raw control characters into them, and without the
    # vocabulary filter 5 of these 20 answers failed json.loads.
    guide = compiler.compile("json_schema", json.dumps(SCHEMA))
    requests = [guided(f"s{i}", prompt, guide, tokenizer, seed=i) for i in range(20)]
    texts = generate(runner, tokenizer, requests)
    assert len(set(texts)) > 10  # really sampled
    for req, text in zip(requests, texts):
        assert req.sink.error is None and req.sink.finish is FinishReason.END_ID, text
        assert len(req.sink.tokens) < MAX_NEW // 2, text  # no runaway whitespace or strings
        jsonschema.validate(json.loads(text), SCHEMA)  # json.loads is strict: no raw control characters
        assert "\n" not in text and ": " in text  # compact JSON, bounded whitespace


def test_any_json_answers_parse(runner, tokenizer, compiler, prompt):
    guide = compiler.compile("json", "ignored, as TensorRT-LLM ignores it")
    assert compiler.compile("json", None) is guide
    requests = [guided(f"j{i}", prompt, guide, tokenizer, seed=i, max_new=128) for i in range(12)]
    texts = generate(runner, tokenizer, requests)
    ended = [text for req, text in zip(requests, texts) if req.sink.finish is FinishReason.END_ID]
    for text in ended:
        assert isinstance(json.loads(text), (dict, list))  # TensorRT-LLM's json: an object or an array
    # Free strings and numbers on random weights may run to max_tokens (8 of these 12 do); the cut ones are
    # still a prefix the grammar accepts.
    assert len(ended) >= 3
    for req, text in zip(requests, texts):
        if req.sink.finish is not FinishReason.END_ID:
            assert req.sink.finish is FinishReason.LENGTH and guide.start(None).matcher.accept_string(text), text


def test_regex_answers_fullmatch(runner, tokenizer, compiler, prompt):
    pattern = r"(yes|no), [0-9]{2,4}\n[a-z]{1,6}!"  # a newline: only JSON bans control characters
    guide = compiler.compile("regex", pattern)
    requests = [guided(f"r{i}", prompt, guide, tokenizer, seed=i) for i in range(8)]
    for req, text in zip(requests, generate(runner, tokenizer, requests)):
        assert req.sink.finish is FinishReason.END_ID and re.fullmatch(pattern, text), text


def test_ebnf_grammar_answers_follow_it(runner, tokenizer, compiler, prompt):
    grammar = 'root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi"\nname ::= [a-z]{1,8}'
    guide = compiler.compile("ebnf_grammar", grammar)
    requests = [guided(f"e{i}", prompt, guide, tokenizer, seed=i) for i in range(6)]
    requests.append(guided("greedy", prompt, guide, tokenizer))
    for req, text in zip(requests, generate(runner, tokenizer, requests)):
        assert req.sink.finish is FinishReason.END_ID and re.fullmatch(r"(hello|hi) [a-z]{1,8}!", text), text


@pytest.mark.parametrize("guide_type, guide", [
    ("json_schema", '{"type": "object", "properties": '),  # not JSON
    ("json_schema", '{"type": "tuple"}'),  # no such type
    ("json_schema", "[1, 2]"),  # not a schema
    ("regex", "a(b"),
    ("ebnf_grammar", "root ::= undefined_rule"),
])
def test_a_guide_that_does_not_compile_is_a_clear_request_error(compiler, guide_type, guide):
    with pytest.raises(GuideError) as caught:
        compiler.compile(guide_type, guide)
    message = str(caught.value)
    assert message.startswith(f"invalid guided_decoding_guide for guided_decoding_guide_type {guide_type!r}: ")
    assert "/project/cpp" not in message and isinstance(caught.value, RequestError)


@pytest.mark.parametrize("guide_type, guide, expected", [
    ("xml", "<a/>", "guided_decoding_guide_type must be one of json, json_schema, regex, ebnf_grammar; got 'xml'"),
    ("regex", None, "guided_decoding_guide_type 'regex' needs a guided_decoding_guide"),
    (None, "[a-z]+", "guided_decoding_guide was given without guided_decoding_guide_type"),
])
def test_inputs_that_name_no_guide_are_refused(compiler, guide_type, guide, expected):
    with pytest.raises(RequestError, match=re.escape(expected)):
        compiler.compile(guide_type, guide)


def test_compiled_guides_are_cached_per_type_and_guide_in_a_bounded_lru(tokenizer, runner):
    compiler = GuideCompiler(tokenizer, runner.vocab_size, cache_size=2)
    first = compiler.compile("regex", "[0-9]+")
    assert compiler.compile("regex", "[0-9]+") is first and (compiler.hits, compiler.misses) == (1, 1)
    assert compiler.compile("ebnf_grammar", 'root ::= "[0-9]+"') is not first  # same text, another type
    compiler.compile("regex", "[a-z]+")  # evicts the least recently used: [0-9]+
    assert compiler.compile("regex", "[0-9]+") is not first and (compiler.hits, compiler.misses) == (1, 4)


def test_an_unguided_sequence_batched_with_guided_ones_is_its_solo_greedy_self(any_runner, tokenizer, compiler,
                                                                               prompt):
    alone = GenerationRequest("u", prompt, 40, ListSink())
    generate(any_runner, tokenizer, [alone])
    guide = compiler.compile("json_schema", json.dumps(SCHEMA))
    again = GenerationRequest("u", prompt, 40, ListSink(), SamplingParams(top_logprobs=2))
    batch = [guided(f"g{i}", prompt, guide, tokenizer, seed=i) for i in range(5)]
    generate(any_runner, tokenizer, batch[:2] + [again] + batch[2:])
    assert again.sink.tokens == alone.sink.tokens and again.sink.finish is FinishReason.LENGTH
    assert again.sink.logprobs == pytest.approx(alone.sink.logprobs, abs=1e-5)


def test_seeded_guided_sampling_is_reproducible_in_any_batch(any_runner, tokenizer, compiler, prompt):
    guide = compiler.compile("json_schema", json.dumps(SCHEMA))
    solo = guided("a", prompt, guide, tokenizer, seed=7)
    generate(any_runner, tokenizer, [solo])
    batched = guided("a", prompt, guide, tokenizer, seed=7)
    generate(any_runner, tokenizer, [GenerationRequest("n", prompt, 30, ListSink(), sampled(1)), batched,
                                 guided("b", prompt, guide, tokenizer, seed=8)])
    assert batched.sink.tokens == solo.sink.tokens


def test_the_grammar_end_wins_over_min_tokens_and_ignore_eos(runner, tokenizer, compiler, prompt):
    guide = compiler.compile("regex", "[0-9]{1,3}")
    min_tokens = guided("min", prompt, guide, tokenizer, sampling=SamplingParams(min_tokens=50))
    ignore_eos = guided("ign", prompt, guide, tokenizer, end_id=None)  # TensorRT-LLM's end_id -1
    sampled_ignore = guided("ign2", prompt, compiler.compile("json_schema", json.dumps(SCHEMA)), tokenizer,
                            sampling=sampled(3, min_tokens=200), end_id=None)
    texts = generate(runner, tokenizer, [min_tokens, ignore_eos, sampled_ignore])
    for req, text in zip([min_tokens, ignore_eos], texts):
        assert re.fullmatch("[0-9]{1,3}", text) and req.sink.finish is FinishReason.END_ID
        assert tokenizer.eos_token_id not in req.sink.tokens
    jsonschema.validate(json.loads(texts[2]), SCHEMA)
    assert sampled_ignore.sink.finish is FinishReason.END_ID
    assert tokenizer.eos_token_id not in sampled_ignore.sink.tokens


def test_the_end_token_comes_only_where_the_grammar_may_end(runner, tokenizer, compiler, prompt):
    """`[0-9]{1,3}` may end after one digit: a token from there on may be the end (not emitted)."""
    guide = compiler.compile("regex", "[0-9]{1,3}")
    requests = [guided(f"d{i}", prompt, guide, tokenizer, seed=i) for i in range(8)]
    texts = generate(runner, tokenizer, requests)
    assert all(re.fullmatch("[0-9]{1,3}", text) for text in texts)
    assert all(tokenizer.eos_token_id not in req.sink.tokens for req in requests)


def test_stop_words_max_tokens_and_cancellation_still_end_a_guided_request(runner, tokenizer, compiler, prompt):
    guide = compiler.compile("regex", "[a-z]{40}")
    probe = guided("probe", prompt, guide, tokenizer)
    generate(runner, tokenizer, [probe])
    word = probe.sink.tokens[2:4]
    stopped = guided("stop", prompt, guide, tokenizer, stop_words=[word])
    short = guided("len", prompt, guide, tokenizer, max_new=2)
    long_one = guided("cancel", prompt, guide, tokenizer, seed=1)
    scheduler = scheduler_for(runner)
    for req in (stopped, short, long_one):
        scheduler.add(req)
    for _ in range(3):
        scheduler.step()
    scheduler.cancel(long_one)
    run_until_done(scheduler)
    first = next(n for n in range(2, 5) if probe.sink.tokens[n - 2:n] == word)  # greedy may repeat itself
    assert stopped.sink.finish is FinishReason.STOP_WORDS and stopped.sink.tokens == probe.sink.tokens[:first]
    assert short.sink.finish is FinishReason.LENGTH and short.sink.tokens == probe.sink.tokens[:2]
    assert long_one.sink.finish is FinishReason.CANCELLED
    assert scheduler._guided == 0 and sorted(scheduler.free_slots) == list(range(SLOTS))


def test_the_vocabulary_filter_bans_special_tokens_everywhere_and_control_characters_in_json(compiler, tokenizer):
    json_guide, regex_guide = compiler.compile("json", None), compiler.compile("regex", "[a-z]+")
    newline = tokenizer.convert_tokens_to_ids("Ċ")  # byte-level BPE's "\n"
    assert not json_guide.allowed_tokens[newline] and regex_guide.allowed_tokens[newline]
    for special in tokenizer.all_special_ids:
        assert not json_guide.allowed_tokens[special] and not regex_guide.allowed_tokens[special]
    decoded = compiler.tokenizer_info.decoded_vocab
    assert all(not any(c < 0x20 for c in decoded[t]) for t in torch.nonzero(json_guide.allowed_tokens).flatten())


def test_sampler_masks_only_the_guided_rows_and_reports_log_probs_after_the_mask():
    logits = torch.randn(3, 70, generator=torch.Generator().manual_seed(0))
    allowed = torch.zeros(70, dtype=torch.bool)
    allowed[[3, 5, 64]] = True
    rows = [SamplingRow(SamplingParams(top_logprobs=5), None, [1], [], []) for _ in range(3)]
    plain = sample(logits.clone(), rows)
    results = sample(logits.clone(), rows, GuidedRows([1], pack_bits(allowed)[None], 70))
    assert results[0] == plain[0] and results[2] == plain[2]  # unguided rows untouched
    masked = torch.log_softmax(logits[1].masked_fill(~allowed, -math.inf), dim=-1)
    assert results[1].token == int(masked.argmax()) and results[1].logprob == pytest.approx(float(masked.max()))
    assert sorted(t for t, _ in results[1].top) == [3, 5, 64]  # no forbidden alternative
    assert sum(math.exp(v) for _, v in results[1].top) == pytest.approx(1.0)


def test_a_guide_for_another_vocabulary_is_refused(runner, tokenizer):
    other = GuideCompiler(tokenizer, runner.vocab_size + 64).compile("regex", "a")
    with pytest.raises(RequestError, match="vocabulary of 4160 tokens, the model has 4096"):
        scheduler_for(runner).add(GenerationRequest("v", [1, 2], 4, ListSink(), guide=other))


# ----- the Triton glue's guided inputs (model_repository/tensorrt_llm/1/model.py, with a stand-in pb_utils) -----
class _Tensor:
    def __init__(self, array: np.ndarray):
        self._array = array

    def as_numpy(self) -> np.ndarray:
        return self._array


class _Sender:
    """A request's response sender: what the glue sends it directly (errors, a stop's empty FINAL)."""

    def __init__(self) -> None:
        self.sent: list[tuple[object, int]] = []
        self.answered = threading.Event()

    def send(self, response=None, flags: int = 0) -> None:
        self.sent.append((response, flags))
        self.answered.set()

    def error(self) -> str:
        assert self.answered.wait(WAIT_S)
        (response, flags), = self.sent
        assert flags == 1  # FINAL
        return response.error


class _Request:
    def __init__(self, request_id: str = "glue", **inputs: np.ndarray):
        self.inputs = {name: _Tensor(array) for name, array in inputs.items()}
        self._request_id = request_id
        self.sender = _Sender()

    def request_id(self) -> str:
        return self._request_id

    def requested_output_names(self) -> list[str]:
        return ["output_ids"]

    def get_response_sender(self) -> _Sender:
        return self.sender


class _Engine:
    """Stands in for cpu_engine.engine.Engine: records submissions, from any thread."""

    def __init__(self) -> None:
        self.submitted: list[GenerationRequest] = []
        self.events: list[tuple[str, str]] = []
        self.refuse: str | None = None  # submit raises RequestError with this text
        self._changed = threading.Condition()

    def submit(self, request: GenerationRequest) -> None:
        if self.refuse is not None:
            raise RequestError(self.refuse)
        with self._changed:
            self.submitted.append(request)
            self.events.append(("submit", request.request_id))
            self._changed.notify_all()

    def cancel_by_id(self, request_id: str) -> None:
        self.events.append(("cancel_by_id", request_id))

    def wait_for(self, count: int) -> list[GenerationRequest]:
        with self._changed:
            assert self._changed.wait_for(lambda: len(self.submitted) >= count, WAIT_S), self.submitted
            return list(self.submitted)

    def stop(self) -> None:
        self.events.append(("stop", ""))


class _Gated:
    """A guide compiler (cpu_engine.guide_pool.Compiler) whose compiles wait for `go`; "bad..." fails."""

    def __init__(self) -> None:
        self.go, self.started = threading.Event(), threading.Event()
        self.cache: dict[tuple, object] = {}

    def cached(self, guide_type, guide):
        return self.cache.get((guide_type, guide))

    def compile(self, guide_type, guide):
        self.started.set()
        assert self.go.wait(WAIT_S), "the test never let the compile go"
        if guide.startswith("bad"):
            raise GuideError(f"invalid guided_decoding_guide for guided_decoding_guide_type {guide_type!r}: bad")
        compiled = self.cache[(guide_type, guide)] = types.SimpleNamespace(guide=guide)
        return compiled


WAIT_S = 10.0


@pytest.fixture
def glue(monkeypatch: pytest.MonkeyPatch):
    pb_utils = types.ModuleType("triton_python_backend_utils")
    pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    pb_utils.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)
    pb_utils.InferenceResponse = lambda error=None, output_tensors=(): types.SimpleNamespace(error=error)
    pb_utils.TritonError = str
    pb_utils.Logger = types.SimpleNamespace(log_error=print, log_warn=print, log_info=print)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb_utils)
    path = Path(__file__).resolve().parents[2] / "model_repository" / "tensorrt_llm" / "1" / "model.py"
    spec = importlib.util.spec_from_file_location("cpu_engine_glue_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel.__new__(module.TritonPythonModel)  # no initialize(): no engine thread
    model.exclude_input_default, model.max_top_logprobs = True, 20
    model.guide_compiler = model.guide_pool = None
    model.engine = _Engine()
    model.channel = types.SimpleNamespace(close=lambda: None)
    model._make_sink = lambda *args: ListSink()
    yield model
    if model.guide_pool is not None:
        model.guide_pool.close()


def _guided_request(guide_type: bytes | None, guide: bytes | None, request_id: str = "glue") -> _Request:
    inputs = {"input_ids": np.array([[5, 6, 7]], dtype=np.int32), "request_output_len": np.array([[8]], dtype=np.int32)}
    if guide_type is not None:
        inputs["guided_decoding_guide_type"] = np.array([guide_type], dtype=object)
    if guide is not None:
        inputs["guided_decoding_guide"] = np.array([guide], dtype=object)
    return _Request(request_id, **inputs)


def test_the_glue_compiles_an_uncached_guide_off_its_thread_and_hands_a_cached_one_to_the_engine_at_once(
        glue, tokenizer, runner):
    compiler = GuideCompiler(tokenizer, runner.vocab_size)  # its own: a cold cache
    glue.guide_compiler, glue.guide_pool = compiler, GuidePool(compiler)
    schema = json.dumps(SCHEMA)
    glue.execute([_guided_request(b"json_schema", schema.encode(), "first")])
    first, = glue.engine.wait_for(1)
    assert first.guide is compiler.cached("json_schema", schema) and compiler.misses == 1
    glue.execute([_guided_request(None, None, "plain"), _guided_request(b"json_schema", schema.encode(), "again")])
    assert [(r.request_id, r.guide) for r in glue.engine.submitted[1:]] == [("plain", None), ("again", first.guide)]
    assert compiler.misses == 1  # "again" came from the cache, on execute()'s thread, submitted before it returned

    bad = _guided_request(b"regex", b"((")
    glue.execute([bad])  # compiles on a pool thread; its error response comes from there
    assert bad.sender.error().startswith("invalid guided_decoding_guide for guided_decoding_guide_type 'regex'")
    nameless = _guided_request(None, b"[a-z]")
    glue.execute([nameless])  # refused at once, on execute()'s thread
    assert nameless.sender.sent and "without guided_decoding_guide_type" in nameless.sender.error()
    assert len(glue.engine.submitted) == 3


def test_a_slow_uncached_compile_does_not_hold_up_an_unguided_request(glue):
    """Finding 12 of the 2026-12-01 review: execute() used to compile on Triton's one thread."""
    compiler = _Gated()
    glue.guide_pool = GuidePool(compiler)
    guided, plain = _guided_request(b"regex", b"[0-9]+", "guided"), _guided_request(None, None, "plain")
    glue.execute([guided, plain])  # returns while the compile waits
    assert compiler.started.wait(WAIT_S)
    assert [r.request_id for r in glue.engine.submitted] == ["plain"] and not guided.sender.sent
    compiler.go.set()
    assert [(r.request_id, getattr(r.guide, "guide", None)) for r in glue.engine.wait_for(2)] == [
        ("plain", None), ("guided", "[0-9]+")]

    failing = _guided_request(b"regex", b"bad((")
    glue.execute([failing])
    assert failing.sender.error() == "invalid guided_decoding_guide for guided_decoding_guide_type 'regex': bad"
    glue.engine.refuse = "prompt length (3) + request_output_len (8) exceeds the engine's max_seq_len (4)"
    refused = _guided_request(b"regex", b"[a-z]+")  # compiles, then the engine refuses it: answered all the same
    glue.execute([refused])
    assert refused.sender.error() == glue.engine.refuse
    assert len(glue.engine.submitted) == 2


def test_a_stop_answers_a_request_still_compiling_and_finalize_never_submits_a_late_compile(glue):
    compiler = _Gated()
    glue.guide_pool = GuidePool(compiler)
    compiling = _guided_request(b"regex", b"[0-9]+", "same")
    glue.execute([compiling])
    assert compiler.started.wait(WAIT_S)
    stop = _Request("same", stop=np.array([[True]]))
    glue.execute([stop])
    assert compiling.sender.error() == STOPPED_BY_ID and stop.sender.sent == [(None, 1)]
    assert glue.engine.events == [("cancel_by_id", "same")]  # after the pool's stop (see model.py)

    late = _guided_request(b"regex", b"[0-9]+", "late")  # joins the compile still running
    glue.execute([late])
    glue.finalize()
    compiler.go.set()
    assert late.sender.error() == SHUT_DOWN
    assert glue.engine.submitted == [] and glue.engine.events[-1] == ("stop", "")
    after = _guided_request(b"regex", b"[a-z]", "after")
    glue.execute([after])
    assert after.sender.error() == SHUT_DOWN


def test_the_glue_refuses_a_guide_when_guided_decoding_is_off(glue):
    off = "guided decoding is off on this engine (guided_decoding_backend)"
    with pytest.raises(RequestError, match=re.escape(off)):
        glue._enqueue(_guided_request(b"json", None), sender=None)
    assert not glue.engine.submitted
