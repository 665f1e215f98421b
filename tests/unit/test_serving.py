"""The serving layer over a fake engine that scripts token streams, errors and delays: stop strings,
usage, logprobs, n>1 with a failing choice, cancellation, and the HTTP response around it. No Triton;
each test runs in milliseconds. Synchronised on events, never on sleeps."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable

import pytest

from frontend.text.detokenizer import IncrementalDetokenizer
from frontend.generation.engine import EngineMetadata, EngineRequest, SamplingOptions, TokenChunk
from frontend.api_types.errors import OpenAIError, engine_error
from frontend.http.renderers import ChatRenderer, CompletionRenderer
from frontend.http.generation_response import GenerationResponse
from frontend.api_types.request_bodies import CompletionRequest
from frontend.parsing.reasoning import REASONING_PARSERS
from frontend.generation.serving import (AnswerParsing, ChoiceJob, Generation, GenerationLimits, UsageCounter, choice_jobs,
                             generate_choice)
from frontend.parsing.tool_parsers import PARSERS, ToolCall, named_parser

EOS = 0


class ByteTokenizer:
    """One token per UTF-8 byte (ids 1..256 = byte + 1; 0 is the end of sequence), like a byte-fallback
    tokenizer at worst: characters split across tokens."""

    eos_token_id = EOS
    end_token_ids = (EOS, 300)  # 300: a second end id (generation_config.json's), as on Llama 3.1
    pad_token_id = EOS

    @staticmethod
    def encode(text: str) -> list[int]:
        return [b + 1 for b in text.encode("utf-8")]

    @staticmethod
    def decode(ids: list[int]) -> str:
        return bytes(t - 1 for t in ids if 0 < t <= 256).decode("utf-8", errors="replace")  # specials: none

    def detokenizer(self, prompt_ids: list[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.decode, prompt_tail=prompt_ids)

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id - 1])


TOKENIZER = ByteTokenizer()
Script = Callable[[EngineRequest], AsyncIterator[TokenChunk]]


@dataclass
class FakeEngine:
    """An LLMEngine whose streams a test scripts; records which requests ended early (cancelled)."""

    script: Script
    requests: list[EngineRequest] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenChunk]:
        self.requests.append(request)
        self.started.set()
        try:
            async for chunk in self.script(request):
                yield chunk
        except (GeneratorExit, asyncio.CancelledError):  # closed or cancelled before its end
            self.cancelled.append(request.request_id)
            raise

    async def is_ready(self) -> bool:
        return True

    async def metadata(self) -> EngineMetadata:
        return EngineMetadata("fake", None, 512)

    async def close(self) -> None:
        pass


def tokens_of(text: str, logprobs: bool = False, per_chunk: int = 1) -> Script:
    """A script that sends `text`'s tokens, `per_chunk` at a time, with logprob -(position) if asked."""

    async def script(request: EngineRequest) -> AsyncIterator[TokenChunk]:
        ids = TOKENIZER.encode(text)[: request.options.max_tokens]
        for i in range(0, len(ids), per_chunk):
            part = ids[i:i + per_chunk]
            yield TokenChunk(part, [-float(i + k) for k in range(len(part))] if logprobs else None,
                             [[(t, -0.5)] for t in part] if request.options.top_logprobs else None)
    return script


def job(max_tokens: int = 64, index: int = 0, **options) -> ChoiceJob:
    return ChoiceJob(index, EngineRequest(f"req-{index}", TOKENIZER.encode("prompt: "),
                                          SamplingOptions(max_tokens=max_tokens, **options)))


async def deltas_of(engine: FakeEngine, choice: ChoiceJob, stop: list[str], usage: UsageCounter) -> list:
    return [d async for d in generate_choice(engine, TOKENIZER, choice, stop, usage)]


# ----- one choice: stop strings, usage, logprobs ----------------------------------------------------------
@pytest.mark.parametrize("per_chunk", [1, 3, 100])
async def test_a_stop_string_across_deltas_ends_the_engine_request_and_usage_counts_up_to_it(per_chunk: int) -> None:
    engine = FakeEngine(tokens_of("hello world, more text after", per_chunk=per_chunk))
    usage = UsageCounter(prompt_tokens=3)
    deltas = await deltas_of(engine, job(), ["lo w"], usage)
    assert "".join(d.text for d in deltas) == "hel"
    assert deltas[-1].finish_reason == "stop"
    assert usage.completion_tokens == len("hello w")  # the token that completed the stop string, no more
    assert sum(len(d.tokens) for d in deltas) == usage.completion_tokens
    assert engine.cancelled == ["req-0"]  # the engine request was ended, not read to its end


async def test_length_and_natural_stop_finish_reasons() -> None:
    usage = UsageCounter(0)
    deltas = await deltas_of(FakeEngine(tokens_of("abcdef")), job(max_tokens=4), [], usage)
    assert "".join(d.text for d in deltas) == "abcd" and deltas[-1].finish_reason == "length"
    assert usage.completion_tokens == 4
    usage = UsageCounter(0)
    deltas = await deltas_of(FakeEngine(tokens_of("ab")), job(max_tokens=4), [], usage)
    assert deltas[-1].finish_reason == "stop" and usage.completion_tokens == 2


@pytest.mark.parametrize("per_chunk", [1, 100])
async def test_an_extra_end_id_ends_the_answer_without_its_text_or_usage(per_chunk: int) -> None:
    """TensorRT-LLM emits a stop word's token before it stops: the frontend ends the answer there."""
    async def script(request: EngineRequest) -> AsyncIterator[TokenChunk]:
        ids = TOKENIZER.encode("ab") + [300] + TOKENIZER.encode("cd")
        for i in range(0, len(ids), per_chunk):
            yield TokenChunk(ids[i:i + per_chunk], None, None)

    usage = UsageCounter(0)
    engine = FakeEngine(script)
    choice = choice_jobs(CompletionRequest(model="m", prompt="p", max_tokens=5), [[1]], 512, TOKENIZER, None,
                         "prompt")[0]
    assert choice.request.options.extra_end_ids == (300,)
    deltas = await deltas_of(engine, choice, [], usage)
    assert "".join(d.text for d in deltas) == "ab" and deltas[-1].finish_reason == "stop"
    assert usage.completion_tokens == 2 == sum(len(d.tokens) for d in deltas)
    # The engine ends the request at that id itself: its stream is read to the end, not cancelled at its
    # final response (TritonEngine.generate says why); what came after the id is neither text nor usage.
    assert engine.cancelled == []
    ignoring = ChoiceJob(0, EngineRequest("r", [1], replace(choice.request.options, ignore_eos=True)))
    deltas = await deltas_of(FakeEngine(script), ignoring, [], UsageCounter(0))
    assert deltas[-1].finish_reason == "length"  # ignore_eos: no id ends the answer


async def test_text_that_only_looks_like_a_stop_string_is_released_at_the_end() -> None:
    deltas = await deltas_of(FakeEngine(tokens_of("say STO")), job(), ["STOP"], UsageCounter(0))
    assert "".join(d.text for d in deltas) == "say STO" and deltas[-1].finish_reason == "stop"


async def test_multibyte_characters_split_across_tokens_are_never_emitted_half() -> None:
    text = "中文😀 ok"
    deltas = await deltas_of(FakeEngine(tokens_of(text)), job(), [], UsageCounter(0))
    assert "".join(d.text for d in deltas) == text
    assert all("\ufffd" not in d.text for d in deltas)


async def test_one_logprob_entry_per_token_and_a_mismatch_is_an_engine_error() -> None:
    usage = UsageCounter(0)
    deltas = await deltas_of(FakeEngine(tokens_of("abc", logprobs=True, per_chunk=2)), job(logprobs=True), [], usage)
    tokens = [t for d in deltas for t in d.tokens]
    assert [t.logprob for t in tokens] == [-0.0, -1.0, -2.0] and len(tokens) == usage.completion_tokens

    async def short(request: EngineRequest) -> AsyncIterator[TokenChunk]:
        yield TokenChunk([5, 6], [-1.0])  # two tokens, one logprob

    with pytest.raises(OpenAIError) as caught:
        await deltas_of(FakeEngine(short), job(logprobs=True), [], UsageCounter(0))
    assert caught.value.status == 500 and "1 log-probabilities for 2 tokens" in caught.value.message


# ----- choices, request ids ---------------------------------------------------------------------------------
def test_every_choice_gets_its_own_server_made_engine_request_id() -> None:
    req = CompletionRequest(model="m", prompt=["a", "b"], n=3, seed=7, max_tokens=5)
    jobs = choice_jobs(req, [[1, 2], [3]], 512, TOKENIZER, None, "prompt")
    assert [j.index for j in jobs] == list(range(6))
    ids = {j.request.request_id for j in jobs}
    assert len(ids) == 6 and all(len(i) == 32 for i in ids)  # uuid4 hex, nothing from the client
    assert [j.request.options.seed for j in jobs[:3]] == [7, 8, 9]
    assert all(j.request.options.eos_token_id == EOS and not j.request.options.ignore_eos for j in jobs)


def test_unseeded_choices_each_carry_a_fresh_random_seed() -> None:
    """TensorRT-LLM seeds a request without one with 0: every engine request must carry its own."""
    req = CompletionRequest(model="m", prompt="a", n=4, max_tokens=5)
    seeds = [j.request.options.seed for j in choice_jobs(req, [[1]], 512, TOKENIZER, None, "prompt")]
    again = [j.request.options.seed for j in choice_jobs(req, [[1]], 512, TOKENIZER, None, "prompt")]
    assert all(isinstance(seed, int) and 0 <= seed < 2**63 for seed in seeds + again)
    assert len(set(seeds + again)) == 8


def test_limits_name_the_parameter() -> None:
    limits = GenerationLimits(max_n=4, max_engine_requests=8, max_prompt_tokens=2, max_stop_length=5)
    for call, param, code in ((lambda: limits.check_choices(5, 1, "prompt"), "n", None),
                              (lambda: limits.check_choices(1, 3000, "prompt"), "prompt", "too_many_generations"),
                              (lambda: limits.check_choices(3, 3, "prompt"), "prompt", "too_many_generations"),
                              (lambda: limits.check_prompts([[1, 2, 3]], "messages"), "messages", "prompt_too_long"),
                              (lambda: limits.check_stops(["ok", "too long"]), "stop", None)):
        with pytest.raises(OpenAIError) as caught:
            call()
        assert caught.value.status == 400 and caught.value.param == param
        assert code is None or caught.value.code == code
    limits.check_choices(4, 2, "prompt")
    limits.check_prompts([[1, 2]], "prompt")
    limits.check_stops(["stop!"])


def failing_choice(fail_index: int, gate: asyncio.Event) -> Script:
    """Choice `fail_index` fails after one token; the others send one token and then wait on `gate`."""

    async def script(request: EngineRequest) -> AsyncIterator[TokenChunk]:
        yield TokenChunk(TOKENIZER.encode("x"))
        if request.request_id.endswith(f"-{fail_index}"):
            raise engine_error("the engine failed the request: injected")
        await gate.wait()
        yield TokenChunk(TOKENIZER.encode("y"))
    return script


def three_choices() -> list[ChoiceJob]:
    return [job(index=i) for i in range(3)]


async def test_n3_one_failing_choice_cancels_the_other_two_engine_requests() -> None:
    gate = asyncio.Event()
    engine = FakeEngine(failing_choice(1, gate))
    generation = Generation(engine, TOKENIZER, three_choices(), [], 3)
    with pytest.raises(OpenAIError) as caught:
        await asyncio.wait_for(generation.collect(), 5)
    assert "injected" in caught.value.message
    assert sorted(engine.cancelled) == ["req-0", "req-2"]
    assert not gate.is_set()


async def test_cancelling_the_generation_cancels_every_engine_request() -> None:
    gate = asyncio.Event()
    engine = FakeEngine(failing_choice(99, gate))
    generation = Generation(engine, TOKENIZER, three_choices(), [], 3)
    task = asyncio.create_task(generation.collect())
    while len(engine.requests) < 3:
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(engine.cancelled) == ["req-0", "req-1", "req-2"]


async def test_usage_of_several_choices_adds_up() -> None:
    generation = Generation(FakeEngine(tokens_of("abcd")), TOKENIZER, [job(index=i, max_tokens=3) for i in range(2)],
                            [], prompt_tokens=5)
    results = await generation.collect()
    assert {i: (r.text, r.finish_reason) for i, r in results.items()} == {0: ("abc", "length"), 1: ("abc", "length")}
    assert generation.usage.as_dict() == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}


# ----- the HTTP response: SSE, errors before and after the first token, disconnects -------------------------
class Client:
    """The ASGI side of one HTTP exchange: what the response sent, and a disconnect the test triggers."""

    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.leave = asyncio.Event()
        self.first_body = asyncio.Event()

    async def receive(self) -> dict:
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.messages.append(message)
        if message["type"] == "http.response.body":
            self.first_body.set()

    @property
    def status(self) -> int:
        return next(m["status"] for m in self.messages if m["type"] == "http.response.start")

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")

    def events(self) -> list[str]:
        return [line[6:] for line in self.body.decode().splitlines() if line.startswith("data: ")]


def completion_response(engine: FakeEngine, jobs: list[ChoiceJob], stream: bool, stop: list[str] = ()) -> GenerationResponse:
    generation = Generation(engine, TOKENIZER, jobs, list(stop), 3)
    renderer = CompletionRenderer("m", None, TOKENIZER, {})
    return GenerationResponse(generation, renderer, stream=stream, include_usage=True, request_id="client-id")


async def test_streamed_and_non_streamed_responses_carry_the_same_text_and_usage() -> None:
    streamed, whole = Client(), Client()
    await completion_response(FakeEngine(tokens_of("hello world")), [job()], True, ["wor"])({}, streamed.receive, streamed.send)
    await completion_response(FakeEngine(tokens_of("hello world")), [job()], False, ["wor"])({}, whole.receive, whole.send)
    events = streamed.events()
    assert events[-1] == "[DONE]" and streamed.status == 200
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    body = json.loads(whole.body)
    assert text == body["choices"][0]["text"] == "hello "
    assert chunks[-1]["usage"] == body["usage"] and body["usage"]["completion_tokens"] == len("hello wor")
    assert (dict(whole.messages[0]["headers"])[b"x-request-id"] == b"client-id")


async def test_a_failure_before_the_first_token_is_an_http_error_and_after_it_an_error_event() -> None:
    async def fails_at_once(request: EngineRequest) -> AsyncIterator[TokenChunk]:
        raise engine_error("boom")
        yield  # pragma: no cover

    client = Client()
    await completion_response(FakeEngine(fails_at_once), [job()], True)(
        {}, client.receive, client.send)
    assert client.status == 500 and json.loads(client.body)["error"]["message"] == "boom"

    client = Client()
    await completion_response(FakeEngine(failing_choice(0, asyncio.Event())), [job()], True)(
        {}, client.receive, client.send)
    events = client.events()
    assert client.status == 200 and events[-1] == "[DONE]"
    assert "injected" in json.loads(events[-2])["error"]["message"]


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_leaving_before_the_first_token_cancels_the_engine_request_at_once(stream: bool) -> None:
    async def never_starts(request: EngineRequest) -> AsyncIterator[TokenChunk]:
        await asyncio.Event().wait()
        yield TokenChunk([1])  # pragma: no cover

    engine = FakeEngine(never_starts)
    client = Client()
    sending = asyncio.create_task(completion_response(engine, [job()], stream)({}, client.receive, client.send))
    await engine.started.wait()
    client.leave.set()
    await asyncio.wait_for(sending, 5)
    assert engine.cancelled == ["req-0"]
    assert client.status == 499  # for the access log; nobody reads it


async def test_a_client_leaving_mid_stream_cancels_every_choice() -> None:
    gate = asyncio.Event()
    engine = FakeEngine(failing_choice(99, gate))
    client = Client()
    sending = asyncio.create_task(completion_response(engine, three_choices(), True)({}, client.receive, client.send))
    await client.first_body.wait()
    client.leave.set()
    await asyncio.wait_for(sending, 5)
    assert sorted(engine.cancelled) == ["req-0", "req-1", "req-2"]
    assert b"[DONE]" not in client.body


def test_chat_renderer_streams_role_first_then_content_then_finish() -> None:
    from frontend.generation.serving import TextDelta
    renderer = ChatRenderer("m", [0], None, TOKENIZER)
    frames = renderer.stream_start() + renderer.stream_delta(0, TextDelta("hi", "stop"))
    chunks = [json.loads(f.decode()[6:]) for f in frames]
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": ""}, {"content": "hi"}, {}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and len({c["id"] for c in chunks}) == 1


async def test_a_bug_in_the_generation_path_is_a_500_or_an_error_event_never_a_broken_response() -> None:
    async def buggy(request: EngineRequest) -> AsyncIterator[TokenChunk]:
        yield TokenChunk(TOKENIZER.encode("a"))
        raise RuntimeError("a bug")

    async def buggy_at_once(request: EngineRequest) -> AsyncIterator[TokenChunk]:
        raise RuntimeError("a bug")
        yield  # pragma: no cover

    client = Client()
    await completion_response(FakeEngine(buggy_at_once), [job()], False)({}, client.receive, client.send)
    assert client.status == 500 and json.loads(client.body)["error"]["message"] == "internal error: RuntimeError"
    client = Client()
    await completion_response(FakeEngine(buggy), [job()], True)({}, client.receive, client.send)
    events = client.events()
    assert client.status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "server_error"


@pytest.mark.parametrize(("message", "status", "code"), [
    ("the engine's queue is full (256 requests waiting for a slot); retry later", 429, "overloaded"),
    ("Exceeds maximum queue size", 429, "overloaded"),
    ("input_ids holds token id 9999, outside the vocabulary [0, 4096)", 400, "invalid_engine_request"),
    ("Request for unknown model: 'tensorrt_llm' has no available versions", 503, "service_unavailable"),
    ("engine step failed: RuntimeError: boom", 500, "engine_error"),
])
def test_engine_error_responses_map_to_what_the_client_can_do(message: str, status: int, code: str) -> None:
    from tritonclient.utils import InferenceServerException

    from frontend.generation.triton_errors import error_for
    error = error_for(InferenceServerException(message), "tensorrt_llm")
    assert (error.status, error.code) == (status, code)
    assert status != 429 or int(error.headers["Retry-After"]) >= 1


# ----- tool calls and reasoning: the answer taken apart, streamed and not alike -------------------------------
def chat_response(engine: FakeEngine, stream: bool, parsing: AnswerParsing) -> GenerationResponse:
    generation = Generation(engine, TOKENIZER, [job(max_tokens=1000)], [], 3, parsing=parsing)
    return GenerationResponse(generation, ChatRenderer("m", [0], None, TOKENIZER), stream=stream,
                              include_usage=False, request_id="r")


HERMES_ANSWER = ('<think>the user wants weather</think>Let me look.\n<tool_call>\n{"name": "get_weather", '
                 '"arguments": {"city": "北京", "days": [1, 2]}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
                 '"arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("per_chunk", [1, 7])
async def test_streamed_tool_call_deltas_assemble_to_the_non_streamed_calls(per_chunk: int) -> None:
    parsing = AnswerParsing(REASONING_PARSERS["think"], PARSERS["hermes"])
    streamed, whole = Client(), Client()
    await chat_response(FakeEngine(tokens_of(HERMES_ANSWER, per_chunk=per_chunk)), True, parsing)(
        {}, streamed.receive, streamed.send)
    await chat_response(FakeEngine(tokens_of(HERMES_ANSWER)), False, parsing)({}, whole.receive, whole.send)
    message = json.loads(whole.body)["choices"][0]
    assert message["finish_reason"] == "tool_calls"
    assert message["message"]["content"] == "Let me look."
    assert message["message"]["reasoning_content"] == "the user wants weather"
    calls = message["message"]["tool_calls"]
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"city": "北京", "days": [1, 2]}), ("function", "get_time", {})]
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]

    chunks = [json.loads(e) for e in streamed.events()[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me look."
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "the user wants weather"
    assembled: dict[int, dict] = {}
    for delta in (call for d in deltas for call in d.get("tool_calls") or []):
        call = assembled.setdefault(delta["index"], {"name": "", "arguments": ""})
        if "id" in delta:  # a call's first delta: id, type and name, once
            assert "id" not in call and delta["type"] == "function" and delta["function"]["name"]
            call["id"], call["name"] = delta["id"], delta["function"]["name"]
        call["arguments"] += delta["function"].get("arguments", "")
    assert [(a["name"], a["arguments"]) for a in assembled.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all("<tool_call>" not in (d.get("content") or "") for d in deltas)


async def test_a_cut_call_is_content_and_the_finish_reason_says_length() -> None:
    parsing = AnswerParsing(None, PARSERS["hermes"])
    client = Client()
    answer = '<tool_call>\n{"name": "f", "arguments": {"a": 1'
    await chat_response(FakeEngine(tokens_of(answer + "}}")), False, parsing)({}, client.receive, client.send)
    choice = json.loads(client.body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"  # the whole call: a call
    client = Client()
    generation = Generation(FakeEngine(tokens_of(answer + "}}")), TOKENIZER, [job(max_tokens=len(answer))], [], 3,
                            parsing=parsing)
    results = await generation.collect()
    assert results[0].finish_reason == "length" and not results[0].tool_calls and results[0].text == answer


async def test_guided_named_and_required_answers_become_calls() -> None:
    named = Generation(FakeEngine(tokens_of('{"city": "Paris"}')), TOKENIZER, [job(max_tokens=1000)], [], 3,
                       parsing=AnswerParsing(None, lambda: named_parser("get_weather", stream_arguments=True)))
    result = (await named.collect())[0]
    assert result.finish_reason == "tool_calls" and result.text == ""
    assert result.tool_calls == [ToolCall("get_weather", '{"city": "Paris"}')]
    required = Generation(FakeEngine(tokens_of('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]')),
                          TOKENIZER, [job(max_tokens=1000)], [], 3,
                          parsing=AnswerParsing(None, lambda: PARSERS["required"](stream_arguments=True)))
    result = (await required.collect())[0]
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [("a", {"x": 1}), ("b", {})]


def test_end_token_ids_are_the_tokenizer_eos_then_generation_config_s(tmp_path) -> None:
    from frontend.text.tokenizer import end_token_ids

    assert end_token_ids(2, tmp_path, 100) == (2,)  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 2, 7, 1000, True]}))
    assert end_token_ids(2, tmp_path, 100) == (2, 5, 7)  # once each, inside the vocabulary
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert end_token_ids(None, tmp_path, 100) == (9,)
    (tmp_path / "generation_config.json").write_text("not json")
    assert end_token_ids(2, tmp_path, 100) == (2,)
