"""Every guide compiled by the frontend before any engine sees it (frontend/planning/guide_check.py): a guide
that does not compile, with this xgrammar or with the GPU image's older one, is a 400 naming its field; the
compiles are cached, bounded in size and time, and off the event loop; a guided request on an engine whose
guided decoding is off is a 400 too."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest

from frontend.generation.engine import EngineMetadata, Guide
from frontend.generation.triton_engine import TritonEngine
from frontend.api_types.errors import OpenAIError
from frontend.api_types.request_bodies import CompletionRequest
from frontend.planning.guide_check import (GuideChecker, check_guides, compile_guide, empty_alternative,
                                           newer_ebnf_macro)
from frontend.planning.structured import MAX_GUIDE_BYTES, extension_guide
from tests.unit.test_chat_plan import MESSAGES, MODEL, WEATHER, LeasedFakeEngine, chat_client, plan_of
from tests.unit.test_serving import tokens_of

LOOK_BEHIND = {"type": "object", "properties": {"id": {"type": "string", "pattern": "(?<=x)y"}}}


async def refused(guides: list[Guide], param: str, checker: GuideChecker | None = None) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        await (checker or GuideChecker()).check(guides)
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message
    assert "\n" not in caught.value.message and len(caught.value.message) < 600
    return caught.value


# ----- what does not compile is a 400 naming its field -----------------------------------------------------
async def test_a_bad_regex_is_a_400_naming_guided_regex() -> None:
    guide = extension_guide(CompletionRequest(model="m", prompt="p", guided_regex="(?<=a)b"))
    error = await refused([guide], "guided_regex")
    assert "Lookbehind is not supported" in error.message and error.message.startswith("guided_regex: ")


async def test_a_bad_grammar_is_a_400_naming_guided_grammar() -> None:
    guide = extension_guide(CompletionRequest(model="m", prompt="p", guided_grammar='root ::= "a" undefined_rule'))
    error = await refused([guide], "guided_grammar")
    assert 'Rule "undefined_rule" is not defined' in error.message


async def test_a_schema_with_a_look_behind_pattern_passes_jsonschema_but_is_a_400() -> None:
    jsonschema.Draft202012Validator.check_schema(LOOK_BEHIND)  # what the frontend checked until now: fine
    plan = plan_of(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": LOOK_BEHIND}})
    error = await refused([*plan.guide_parts, plan.guide], "response_format")
    assert "Lookbehind" in error.message
    extension = extension_guide(CompletionRequest(model="m", prompt="p", guided_json=LOOK_BEHIND))
    await refused([extension], "guided_json")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "lookup"}}])
async def test_a_tool_schema_that_does_not_compile_is_named_where_the_client_wrote_it(tool_choice: Any) -> None:
    lookup = {"type": "function", "function": {"name": "lookup", "parameters": LOOK_BEHIND}}
    plan = plan_of(tools=[WEATHER, lookup], tool_choice=tool_choice)
    await refused([*plan.guide_parts, plan.guide], "tools.1.function.parameters")


async def test_good_guides_compile_and_are_cached() -> None:
    checker = GuideChecker()
    guides = [
        plan_of(response_format={"type": "json_object"}).guide,
        plan_of(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "pattern": "^[a-z]+$"}},
            "required": ["n"]}}}).guide,
        *plan_of(tools=[WEATHER], tool_choice="required").guide_parts,
        plan_of(tools=[WEATHER], tool_choice="required").guide,
        Guide("regex", r"\d{3}-(a|b|)", "guided_regex"),
        Guide("ebnf_grammar", 'root ::= "yes" | "no" # "Regex(" in a comment\nx ::= "Token("', "guided_grammar"),
    ]
    await checker.check(guides)
    assert (checker.misses, checker.hits) == (len(guides), 0)
    await checker.check(guides)
    assert (checker.misses, checker.hits) == (len(guides), len(guides))  # every one from the cache
    bad = Guide("regex", "a||b", "guided_regex")
    await refused([bad], "guided_regex", checker)
    await refused([bad], "guided_regex", checker)  # a refusal is cached too
    assert checker.misses == len(guides) + 1


# ----- what the GPU image's xgrammar (0.1.25) refuses and 0.2.9 accepts --------------------------------------
# Each case: 0.1.25's own error (Grammar.from_regex / from_json_schema / from_ebnf, run in a venv with
# xgrammar==0.1.25, the version tensorrt_llm 1.1.0 pins); 0.2.9 compiles every one of them.
def pattern(regex: str) -> str:
    return json.dumps({"type": "string", "pattern": regex})


OLDER_XGRAMMAR_REFUSES = [
    ("regex", "a|", "EBNF parser error at line 2, column 1: Expect element, but got"),
    ("regex", "|a", "EBNF parser error at line 1, column 10: Expect element, but got |"),
    ("regex", "a||b", "EBNF parser error at line 1, column 16: Expect element, but got |"),
    ("regex", "(|a)", "EBNF parser error at line 1, column 12: Expect element, but got |"),
    ("regex", "(?:|a)", "EBNF parser error at line 1, column 12: Expect element, but got |"),
    ("json_schema", pattern("(?=a)a"), "Regex parsing error at position 3: Lookahead is not supported yet."),
    ("json_schema", pattern("(?!a)b"), "Regex parsing error at position 3: Lookahead is not supported yet."),
    ("json_schema", pattern("(?i)abc"), "Regex parsing error at position 3: Group modifier flag is not supported yet."),
    ("json_schema", pattern("(?P<x>a)"), "Regex parsing error at position 3: Group modifier flag is not supported yet."),
    ("json_schema", pattern("a++"), "Regex parsing error at position 3: Two consecutive repetition modifiers ..."),
    ("json_schema", pattern("a||b"), "EBNF parser error at line 11, column 23: Expect element, but got |"),
    ("json_schema", pattern("(|a)"), "EBNF parser error at line 11, column 19: Expect element, but got |"),
    ("json_schema", json.dumps({"type": "object", "patternProperties": {"(?=x)": {"type": "integer"}}}),
     "Regex parsing error: Lookahead is not supported yet. (patternProperties keys are patterns)"),
    ("json_schema", json.dumps({"$defs": {"x/y": {"type": "integer"}}, "$ref": "#/$defs/x~1y"}),
     "Cannot find field x~1y in ..."),
    ("json_schema", json.dumps({"$defs": {"x y": {"type": "integer"}}, "$ref": "#/$defs/x%20y"}),
     "Cannot find field x%20y in ..."),
    ("ebnf_grammar", 'root ::= Regex("[a-z]+")', 'EBNF parser error at line 1, column 10: Rule "Regex" is not defined'),
    ("ebnf_grammar", 'root ::= "a" Substring("abc")', 'Rule "Substring" is not defined'),
    ("ebnf_grammar", "root ::= Token(1)", 'Rule "Token" is not defined'),
    ("ebnf_grammar", "root ::= ExcludeToken(1)", 'Rule "ExcludeToken" is not defined'),
    ("ebnf_grammar", 'root ::= TokenTagDispatch((1, a))\na ::= "x"', 'Rule "TokenTagDispatch" is not defined'),
]
# ... and what both accept: the extra checks must not refuse these.
BOTH_ACCEPT = [
    ("regex", "(a|)"), ("regex", "(a|b|c|)"), ("regex", "()"), ("regex", "[|]|a"), ("regex", r"\||a"), ("regex", ""),
    ("regex", "(a|)|b"), ("regex", "a|(b|)"),
    ("json_schema", pattern("a|")), ("json_schema", pattern("|a")), ("json_schema", pattern("|")),
    ("json_schema", pattern("(a|)")), ("json_schema", pattern("(?<name>a)")),
    ("json_schema", json.dumps({"type": "object", "properties": {"pattern": {"type": "string"}},
                                "enum": [{"pattern": "(?=x)"}]})),  # data, not a schema: not a pattern
    ("json_schema", json.dumps({"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a"})),
    ("ebnf_grammar", 'root ::= "Regex(" r\nr ::= [(]'), ("ebnf_grammar", 'root ::= MyRegex\nMyRegex ::= "x"'),
    ("ebnf_grammar", 'root ::= TagDispatch(("<a>", a), loop_after_dispatch=false)\na ::= "x"'),
]


@pytest.mark.parametrize(("guide_type", "text", "older_error"), OLDER_XGRAMMAR_REFUSES,
                         ids=[f"{t}:{x}" for t, x, _ in OLDER_XGRAMMAR_REFUSES])
def test_what_the_gpu_images_xgrammar_refuses_is_refused(guide_type: str, text: str, older_error: str) -> None:
    import xgrammar as xgr
    compiles = {"regex": xgr.Grammar.from_regex, "json_schema": xgr.Grammar.from_json_schema,
                "ebnf_grammar": xgr.Grammar.from_ebnf}[guide_type]
    compiles(text)  # the installed 0.2.9 takes it: only the extra check stands between it and the GPU
    reason = compile_guide(guide_type, text)
    assert reason is not None and "0.1.25" in reason, (reason, older_error)


@pytest.mark.parametrize(("guide_type", "text"), BOTH_ACCEPT, ids=[f"{t}:{x}" for t, x in BOTH_ACCEPT])
def test_what_both_versions_accept_passes(guide_type: str, text: str) -> None:
    assert compile_guide(guide_type, text) is None


def test_the_empty_alternative_and_macro_scanners() -> None:
    assert empty_alternative("ab|", pattern=False) == 3 and empty_alternative("ab|", pattern=True) is None
    assert empty_alternative("x(|y)", pattern=True) == 2
    assert empty_alternative("[a|]\\|(b|)", pattern=False) is None
    assert newer_ebnf_macro('root ::= "Regex(" [Regex(] # Regex(\nr ::= Regex ("a")') == "Regex"
    assert newer_ebnf_macro('root ::= my-Token ("a")\nmy-Token ::= "x"') is None


# ----- bounds ------------------------------------------------------------------------------------------------
def test_every_guide_is_bounded_in_size() -> None:
    big = 'root ::= "' + "é" * (MAX_GUIDE_BYTES // 2) + '"'  # fewer characters than the schema allows, more bytes
    with pytest.raises(OpenAIError) as caught:
        extension_guide(CompletionRequest(model="m", prompt="p", guided_grammar=big))
    assert caught.value.param == "guided_grammar" and f"{MAX_GUIDE_BYTES} bytes" in caught.value.message
    with pytest.raises(OpenAIError) as caught:
        extension_guide(CompletionRequest(model="m", prompt="p", guided_json={"enum": ["x" * MAX_GUIDE_BYTES]}))
    assert caught.value.param == "guided_json"


class SlowCompiler:
    """A compiler that blocks on a guide until the test releases it, and compiles everything else at once."""

    def __init__(self, slow_text: str):
        self.slow_text = slow_text
        self.release = threading.Event()
        self.calls: list[str] = []

    def __call__(self, guide_type: str, text: str) -> str | None:
        self.calls.append(text)
        if text == self.slow_text:
            self.release.wait(30)
        return None


async def test_a_compile_past_the_time_bound_is_a_400_and_holds_one_thread_only() -> None:
    compiler = SlowCompiler("slow")
    checker = GuideChecker(threads=1, timeout_s=0.2, queue_wait_s=0.5, compile=compiler)
    try:
        error = await refused([Guide("regex", "slow", "guided_regex")], "guided_regex", checker)
        assert "longer than 0.2 s to compile" in error.message
        # The same guide again joins the compile still running: no second thread, no second compile.
        await refused([Guide("regex", "slow", "guided_regex")], "guided_regex", checker)
        assert compiler.calls == ["slow"] and len(checker._workers) == 1
        # The one thread is held: another guide waits for it, then is told the server is busy (never a 400).
        with pytest.raises(OpenAIError) as caught:
            await checker.check([Guide("regex", "fine", "guided_regex")])
        assert caught.value.status == 429 and caught.value.headers.get("Retry-After")
    finally:
        compiler.release.set()
    # Once it returns, the slow guide stays refused (the engine would stall that long), and the thread is free.
    while checker._pending:
        await asyncio.sleep(0.01)
    await refused([Guide("regex", "slow", "guided_regex")], "guided_regex", checker)
    await checker.check([Guide("regex", "fine", "guided_regex")])


async def test_compiles_run_off_the_event_loop() -> None:
    compiler = SlowCompiler("slow")
    checker = GuideChecker(timeout_s=5, compile=compiler)
    task = asyncio.create_task(checker.check([Guide("regex", "slow", "guided_regex")]))
    while not compiler.calls:
        await asyncio.sleep(0.01)  # the loop runs while the compile blocks its thread
    assert not task.done()
    compiler.release.set()
    await task


async def test_too_many_distinct_guides_at_once_is_a_429() -> None:
    compiler = SlowCompiler("slow")
    checker = GuideChecker(threads=1, timeout_s=5, max_pending=1, compile=compiler)
    task = asyncio.create_task(checker.check([Guide("regex", "slow", "guided_regex")]))
    while not compiler.calls:
        await asyncio.sleep(0.01)
    with pytest.raises(OpenAIError) as caught:
        await checker.check([Guide("regex", "other", "guided_regex")])
    assert caught.value.status == 429
    compiler.release.set()
    await task


# ----- guided decoding off on the engine -------------------------------------------------------------------
@dataclass
class UnguidedEngine(LeasedFakeEngine):
    """An engine model whose config turned guided decoding off."""

    async def metadata(self) -> EngineMetadata:
        return EngineMetadata("fake", None, 512, guided_decoding=False)


async def test_a_guided_request_on_an_engine_with_guided_decoding_off_is_a_400() -> None:
    state = SimpleNamespace()
    engine = UnguidedEngine(tokens_of("x"))
    with pytest.raises(OpenAIError) as caught:
        await check_guides(state, engine, Guide("regex", "a+", "guided_regex"))
    assert caught.value.status == 400 and caught.value.param == "guided_regex"
    assert "guided decoding is off" in caught.value.message
    await check_guides(state, engine, None)  # unguided requests run


def test_through_the_routes_nothing_reaches_the_engine() -> None:
    client, engine = chat_client("{}")
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": LOOK_BEHIND}}
    for endpoint, body, param in [
        ("chat/completions", {"messages": MESSAGES, "response_format": schema}, "response_format"),
        ("chat/completions", {"messages": MESSAGES, "guided_regex": "(?<=a)b"}, "guided_regex"),
        ("chat/completions", {"messages": MESSAGES, "tools": [WEATHER, {"type": "function", "function": {
            "name": "f", "parameters": LOOK_BEHIND}}], "tool_choice": "required"}, "tools.1.function.parameters"),
        ("completions", {"prompt": [1, 2], "guided_grammar": "root ::= nope"}, "guided_grammar"),
        ("completions", {"prompt": [1, 2], "guided_json": LOOK_BEHIND}, "guided_json"),
    ]:
        response = client.post(f"/v1/{endpoint}", json={"model": MODEL, "max_tokens": 4, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert not engine.requests
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2], "max_tokens": 4,
                                                    "guided_regex": "[{}]+"})
    assert response.status_code == 200, response.text
    assert engine.requests[-1].options.guide is not None


class FakeTritonClient:
    def __init__(self, backend: str, parameters: dict[str, str]):
        self.config = {"config": {"backend": backend,
                                  "parameters": {k: {"string_value": v} for k, v in parameters.items()}}}

    async def get_model_config(self, model: str, as_json: bool = False, client_timeout: float | None = None) -> dict:
        return self.config


@pytest.mark.parametrize(("backend", "parameters", "on"), [
    ("tensorrtllm", {"guided_decoding_backend": "xgrammar", "xgrammar_tokenizer_info_path": "/e/info.json"}, True),
    ("tensorrtllm", {"guided_decoding_backend": "xgrammar", "xgrammar_tokenizer_info_path": ""}, False),
    ("tensorrtllm", {"guided_decoding_backend": "xgrammar",
                     "xgrammar_tokenizer_info_path": "${xgrammar_tokenizer_info_path}"}, False),
    ("tensorrtllm", {"guided_decoding_backend": "", "xgrammar_tokenizer_info_path": "/e/info.json"}, False),
    ("python", {"guided_decoding_backend": "xgrammar", "xgrammar_tokenizer_info_path": ""}, True),  # CPU engine
    ("python", {"guided_decoding_backend": "", "xgrammar_tokenizer_info_path": ""}, False),
])
async def test_engine_metadata_says_whether_guided_decoding_is_on(backend: str, parameters: dict[str, str],
                                                                 on: bool) -> None:
    engine = TritonEngine("127.0.0.1:1", "tensorrt_llm")
    engine._client = FakeTritonClient(backend, {"max_seq_len": "512", **parameters})  # type: ignore[assignment]
    assert (await engine.metadata()).guided_decoding is on


def test_guided_decoding_is_on_unless_an_engine_says_otherwise() -> None:
    assert EngineMetadata("m", None, 512).guided_decoding is True
