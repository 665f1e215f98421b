"""The chat plan (frontend/planning/chat_plan.py): the tools the template renders, the guide and the answer's parsers,
decided together. Through the real chat route and serving layer, over a fake engine that scripts the answer
and a byte tokenizer whose chat template ends the prompt with an open `<think>` (as Qwen3-2507 thinking and
QwQ do) and a reasoning parser on: guided answers land in `content` or `tool_calls`, never in
`reasoning_content`; tool_choice none renders no tools; parallel_tool_calls false gives one call."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from fastapi.testclient import TestClient

from frontend.http.app import create_app
from frontend.planning.chat_plan import ChatPlan
from frontend.api_types.errors import OpenAIError
from frontend.models.registry import ModelContext
from frontend.api_types.request_bodies import ChatCompletionRequest
from frontend.settings import Settings
from tests.unit.test_serving import TOKENIZER, ByteTokenizer, FakeEngine, tokens_of

MODEL = "thinker"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city", "days"]}
TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


class ThinkingTemplateTokenizer(ByteTokenizer):
    """ChatML with Hermes-style tools; the generation prompt opens the reasoning: `...assistant\\n<think>\\n`."""

    chat_template = "{{ tools }} <tool_call> (a stand-in: the route only renders through apply_chat_template)"
    vocab_size = 257

    @staticmethod
    def certainly_longer_than(text: str, tokens: int) -> bool:
        return False

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
                            ) -> list[int]:
        text = ""
        if tools:
            text += "<|im_start|>system\n# Tools\n<tools>\n" + "\n".join(json.dumps(t) for t in tools) + \
                    "\n</tools><|im_end|>\n"
        text += "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return self.encode(text + "<|im_start|>assistant\n<think>\n")


THINKING_TOKENIZER = ThinkingTemplateTokenizer()


@dataclass
class LeasedFakeEngine(FakeEngine):
    """The fake engine as a model version's engine (the route leases it for the request's life)."""

    def lease(self) -> None:
        pass

    def release(self) -> None:
        pass


class OneModel:
    """The model registry of the app: one model, its context fixed by the test."""

    def __init__(self, context: ModelContext):
        self.context = context

    async def get(self, model: str | None = None) -> ModelContext:
        return self.context


def chat_client(answer: str, reasoning_parser: str | None = "think",
                tool_call_parser: str | None = "hermes") -> tuple[TestClient, LeasedFakeEngine]:
    """The real app (no lifespan: no Triton) serving one model whose engine answers `answer` to anything."""
    engine = LeasedFakeEngine(tokens_of(answer))
    app = create_app(Settings())
    app.state.models = OneModel(ModelContext(MODEL, 4096, THINKING_TOKENIZER, 0,  # type: ignore[arg-type]
                                             tool_call_parser, reasoning_parser, engine))  # type: ignore[arg-type]
    return TestClient(app), engine


def chat(client: TestClient, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 500,
                                                         **body})
    assert response.status_code == 200, response.text
    return response.json()


def stream_chat(client: TestClient, **body: Any) -> dict[str, Any]:
    """A streamed answer assembled: content, reasoning, calls by index, finish reason."""
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 500,
                                                         "stream": True, **body})
    assert response.status_code == 200, response.text
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    whole: dict[str, Any] = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for event in events[:-1]:
        choice = json.loads(event)["choices"][0]
        delta = choice["delta"]
        whole["content"] += delta.get("content") or ""
        whole["reasoning"] += delta.get("reasoning_content") or ""
        for call in delta.get("tool_calls") or []:
            entry = whole["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
            if "id" in call:
                entry["name"] = call["function"]["name"]
            entry["arguments"] += call["function"].get("arguments", "")
        whole["finish"] = choice["finish_reason"] or whole["finish"]
    return whole


def prompt_of(engine: LeasedFakeEngine) -> str:
    return TOKENIZER.decode(engine.requests[-1].prompt_ids)


# ----- through the route and the serving layer -------------------------------------------------------------
def test_unguided_answers_still_start_inside_the_reasoning_the_template_opened() -> None:
    client, engine = chat_client("the user asks\n</think>\n\nSunny.")
    message = chat(client)["choices"][0]["message"]
    assert prompt_of(engine).endswith("<think>\n")
    assert (message["reasoning_content"], message["content"]) == ("the user asks", "Sunny.")


def test_json_schema_answer_lands_in_content_and_parses_under_an_open_think() -> None:
    document = '{"city": "Paris", "days": 3}'
    client, engine = chat_client(document)
    response_format = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}
    whole = chat(client, response_format=response_format)["choices"][0]
    assert prompt_of(engine).endswith("<think>\n")  # the template did open the reasoning
    assert engine.requests[-1].options.guide is not None
    assert whole["finish_reason"] == "stop" and not whole["message"].get("reasoning_content")
    assert json.loads(whole["message"]["content"]) == {"city": "Paris", "days": 3}
    streamed = stream_chat(client, response_format=response_format)
    assert (streamed["content"], streamed["reasoning"], streamed["finish"]) == (whole["message"]["content"], "", "stop")


def test_json_object_answer_is_content_even_with_tool_choice_auto() -> None:
    """The JSON document is the answer: a tool-call parser does not read a call out of it."""
    document = '{"note": "<tool_call>\\n{\\"name\\": \\"get_time\\", \\"arguments\\": {}}\\n</tool_call>"}'
    client, _ = chat_client(document)
    message = chat(client, response_format={"type": "json_object"}, tools=[WEATHER, CLOCK])["choices"][0]
    assert message["finish_reason"] == "stop" and message["message"].get("tool_calls") is None
    assert json.loads(message["message"]["content"]) == json.loads(document)


@pytest.mark.parametrize("parallel", [True, False])
def test_a_named_tool_choice_is_a_tool_call_under_an_open_think(parallel: bool) -> None:
    client, engine = chat_client('{"city": "Paris"}')
    body = {"tools": [WEATHER, CLOCK], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "parallel_tool_calls": parallel}
    whole = chat(client, **body)["choices"][0]
    assert prompt_of(engine).endswith("<think>\n") and "get_weather" in prompt_of(engine)
    assert whole["finish_reason"] == "tool_calls"
    assert not whole["message"].get("content") and not whole["message"].get("reasoning_content")
    [call] = whole["message"]["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("get_weather", {"city": "Paris"})
    streamed = stream_chat(client, **body)
    assert streamed["finish"] == "tool_calls" and (streamed["content"], streamed["reasoning"]) == ("", "")
    assert list(streamed["calls"].values()) == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]


def test_required_tool_choice_is_tool_calls_under_an_open_think() -> None:
    client, _ = chat_client('[{"name": "get_time", "parameters": {}}]')
    whole = chat(client, tools=[WEATHER, CLOCK], tool_choice="required")["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and not whole["message"].get("reasoning_content")
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_time"]


def test_tool_choice_none_renders_no_tools_and_parses_no_calls() -> None:
    client, engine = chat_client(TWO_CALLS, reasoning_parser=None)
    message = chat(client, tools=[WEATHER, CLOCK], tool_choice="none")["choices"][0]
    prompt = prompt_of(engine)
    assert "get_weather" not in prompt and "<tools>" not in prompt and "Weather for a city" not in prompt
    assert message["finish_reason"] == "stop" and message["message"].get("tool_calls") is None
    assert message["message"]["content"] == TWO_CALLS  # no parser: what the model wrote, as written
    chat(client, tools=[WEATHER, CLOCK])  # auto: the same tools are rendered
    assert "get_weather" in prompt_of(engine) and "<tools>" in prompt_of(engine)


def test_parallel_tool_calls_false_gives_one_call_under_auto() -> None:
    client, _ = chat_client(TWO_CALLS, reasoning_parser=None)
    both = chat(client, tools=[WEATHER, CLOCK])["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in both] == ["get_weather", "get_time"]  # parallel by default
    whole = chat(client, tools=[WEATHER, CLOCK], parallel_tool_calls=False)["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and not whole["message"].get("content")
    [call] = whole["message"]["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("get_weather", {"city": "Paris"})
    streamed = stream_chat(client, tools=[WEATHER, CLOCK], parallel_tool_calls=False)
    assert streamed["finish"] == "tool_calls" and streamed["content"] == ""
    assert list(streamed["calls"].values()) == [{"name": "get_weather", "arguments": call["function"]["arguments"]}]


# ----- the plan itself ---------------------------------------------------------------------------------------
def context(reasoning_parser: str | None = "think", tool_call_parser: str | None = "hermes") -> ModelContext:
    return ModelContext(MODEL, 4096, THINKING_TOKENIZER, 0,  # type: ignore[arg-type]
                        tool_call_parser, reasoning_parser)


def plan_of(model: ModelContext = context(), **body: Any) -> ChatPlan:
    return ChatPlan.build(ChatCompletionRequest(model=MODEL, messages=MESSAGES, **body), model)


def test_the_plan_decides_from_the_request_and_the_model() -> None:
    plain = plan_of()
    assert (plain.template_tools, plain.guide, plain.tool_parser, plain.starts_in_reasoning) == (None, None, None, None)
    prompt = THINKING_TOKENIZER.apply_chat_template(MESSAGES)
    assert plain.for_prompt(THINKING_TOKENIZER, prompt).starts_in_reasoning is True  # the template opened it
    assert plain.for_prompt(THINKING_TOKENIZER, TOKENIZER.encode("assistant\n")).starts_in_reasoning is False
    guided = plan_of(response_format={"type": "json_object"})
    assert guided.guide is not None and guided.starts_in_reasoning is False
    assert guided.for_prompt(THINKING_TOKENIZER, prompt).starts_in_reasoning is False  # guided: no reasoning
    auto = plan_of(tools=[WEATHER])
    assert auto.template_tools == [WEATHER] and auto.tool_parser == "hermes" and auto.max_tool_calls is None
    assert plan_of(tools=[WEATHER], parallel_tool_calls=False).max_tool_calls == 1
    none = plan_of(tools=[WEATHER], tool_choice="none")
    assert (none.template_tools, none.tool_parser, none.parsing.tool_calls) == (None, None, None)
    named = plan_of(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert (named.tool_parser, named.named_tool, named.template_tools) == ("named", "get_weather", [WEATHER])
    assert plan_of(context(reasoning_parser=None), response_format={"type": "json_object"}).parsing.reasoning is None


def test_auto_on_a_model_whose_call_markup_is_unknown_is_a_400() -> None:
    with pytest.raises(OpenAIError) as refused:
        plan_of(context(tool_call_parser=None), tools=[WEATHER])
    assert refused.value.status == 400 and refused.value.param == "tool_choice"
    assert plan_of(context(tool_call_parser=None), tools=[WEATHER], tool_choice="none").tool_parser is None


async def test_a_plans_parsing_runs_in_the_serving_layer_like_any_other() -> None:
    """The plan's parsing is the serving layer's AnswerParsing: Generation runs it unchanged."""
    from tests.unit.test_serving import job
    from frontend.generation.serving import Generation

    engine = FakeEngine(tokens_of(TWO_CALLS))
    plan = plan_of(context(reasoning_parser=None), tools=[WEATHER, CLOCK], parallel_tool_calls=False)
    generation = Generation(engine, TOKENIZER, [job(max_tokens=1000)], [], 3, parsing=plan.parsing)
    result = (await generation.collect())[0]
    assert result.finish_reason == "tool_calls" and [c.name for c in result.tool_calls] == ["get_weather"]

