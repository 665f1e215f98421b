"""A client no one here wrote: the OpenAI Agents SDK runs an agent with one function tool end to end
against the stack, on its default model class (the Responses API).

The SDK takes a response that ran out of tokens (`incomplete`) for a failure, and the demo weights are
random (they rarely stop on their own), so this runs on the scripted model (tests/integration/
scripted_model.py), whose greedy answer to any chat prompt is a short fixed text and then its end: the first
turn's call is forced (`ModelSettings(tool_choice=...)`) and guided into the tool's schema (an enum, so the
call is short too); the SDK runs the tool, sends the conversation back with its output, resets tool_choice
(its default after a tool use), and takes the scripted text as the agent's final answer."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import openai
import pytest
from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client, set_tracing_disabled
from agents.models.openai_provider import OpenAIProvider
from agents.models.openai_responses import OpenAIResponsesModel

from tests.integration.conftest import Stack, frontend_on

pytestmark = pytest.mark.integration


def test_an_agent_calls_its_tool_and_answers(stack: Stack, tmp_path: Path) -> None:
    scripted = stack.scripted
    with frontend_on(stack, scripted.model_name, tmp_path, SERVED_MODEL_NAME=scripted.served_model_name,
                     RESPONSES_DB_URL=f"sqlite:///{tmp_path / 'responses.sqlite3'}") as base_url:
        set_tracing_disabled(True)  # the SDK would export traces to OpenAI's servers
        set_default_openai_client(openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0,
                                                     timeout=120), use_for_tracing=False)
        cities: list[str] = []

        @function_tool
        def get_weather(city: Literal["Oslo", "Rome"]) -> str:
            """The weather in a city."""
            cities.append(city)
            return "Sunny, 21 C"

        agent = Agent(name="weather", instructions="You answer questions about the weather.",
                      model=scripted.served_model_name, tools=[get_weather],
                      model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=32))
        result = Runner.run_sync(agent, "What is the weather in Oslo?", max_turns=4)

    assert cities in (["Oslo"], ["Rome"])  # the tool ran once, with arguments of its schema
    assert result.final_output == scripted.demo.text  # the second turn's answer
    assert [item.type for item in result.new_items] == ["tool_call_item", "tool_call_output_item",
                                                        "message_output_item"]
    assert [r.response_id[:5] for r in result.raw_responses] == ["resp_", "resp_"]  # both from /v1/responses
    # The model class the SDK's default provider builds for a model name: the Responses one.
    assert isinstance(OpenAIProvider().get_model(scripted.served_model_name), OpenAIResponsesModel)
