"""Round 2 of the Responses API, without a model: namespaced and custom tools' calls as items and events the
official client parses (with the namespace apart from the name), their history rendered back under the names
the model knows, and reasoning sealed for the client: opened on the next turn, under a rotated key too, and
refused (a 400 naming `input`) once altered."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import (Response, ResponseCustomToolCall, ResponseFunctionToolCall,
                                    ResponseReasoningItem)
from openai.types.responses.response_output_item import LocalShellCall
from openai.types.responses.response_stream_event import ResponseStreamEvent
from pydantic import TypeAdapter

from frontend.generation.serving import TextDelta
from frontend.api_types.errors import OpenAIError
from frontend.parsing.tool_parsers import ToolCallDelta
from frontend.responses_api import events
from frontend.responses_api.conversation import conversation_messages, stored_item
from frontend.responses_api.objects import request_echo, response_object
from frontend.responses_api.output import OutputAssembler
from frontend.responses_api.request import ResponsesRequest
from frontend.responses_api.sealing import ReasoningSeal

EVENT = TypeAdapter(ResponseStreamEvent)
TOOLS = [{"type": "function", "name": "exec_command", "parameters": {"type": "object"}},
         {"type": "namespace", "name": "multi_agent_v1", "description": "agents",
          "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}},
                    {"type": "custom", "name": "note"}]},
         {"type": "custom", "name": "code", "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]+"}},
         {"type": "web_search"}]
KEY_OLD, KEY_NEW = "o" * 40, "n" * 40


def assembled(deltas: list[TextDelta], **request: Any) -> tuple[OutputAssembler, list[dict[str, Any]]]:
    req = ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": TOOLS, **request})
    assembler = OutputAssembler()
    assembler.configure(req.offered_tools, req.chosen_tool, None)
    out = []
    for delta in deltas:
        out += assembler.feed(delta)
    for number, event in enumerate(out):
        EVENT.validate_python(events.numbered(event, number))  # every event parses as the client's
    return assembler, out


def test_a_namespaced_call_comes_back_with_its_namespace_and_a_custom_call_with_its_input() -> None:
    assembler, out = assembled([
        TextDelta("", tool_calls=(ToolCallDelta(0, "multi_agent_v1__spawn_agent", '{"task": '),)),
        TextDelta("", tool_calls=(ToolCallDelta(0, None, '"x"}'),)),
        TextDelta("", tool_calls=(ToolCallDelta(1, "multi_agent_v1__note", '{"input": "a\\nb"}'),)),
        TextDelta("", finish_reason="tool_calls", tool_calls=(ToolCallDelta(2, "code", '{"input": "42"}'),))])
    spawn = ResponseFunctionToolCall.model_validate(assembler.output[0])
    assert (spawn.name, spawn.namespace, json.loads(spawn.arguments)) == ("spawn_agent", "multi_agent_v1",
                                                                          {"task": "x"})
    note, code = (ResponseCustomToolCall.model_validate(item) for item in assembler.output[1:])
    assert (note.name, note.namespace, note.input) == ("note", "multi_agent_v1", "a\nb")
    assert (code.name, code.namespace, code.input) == ("code", None, "42")
    assert [e["input"] for e in out if e["type"] == "response.custom_tool_call_input.done"] == ["a\nb", "42"]


def test_a_forced_custom_tool_takes_the_whole_answer_as_its_input() -> None:
    assembler, out = assembled([TextDelta("12"), TextDelta("3", finish_reason="stop")],
                               tool_choice={"type": "custom", "name": "code"})
    [call] = assembler.output
    assert ResponseCustomToolCall.model_validate(call).input == "123"
    assert "".join(e["delta"] for e in out if e["type"] == "response.custom_tool_call_input.delta") == "123"


def test_calls_sent_back_render_under_the_names_the_model_was_offered() -> None:
    req = ResponsesRequest.model_validate({"model": "m", "tools": TOOLS, "input": [
        {"role": "user", "content": "go"},
        {"type": "function_call", "call_id": "c1", "name": "spawn_agent", "namespace": "multi_agent_v1",
         "arguments": "{}"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "code", "input": "7"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "done"}]})
    items = [stored_item(item) for item in req.items]
    assert items[1]["namespace"] == "multi_agent_v1" and items[2]["type"] == "custom_tool_call"
    messages = conversation_messages([], items, None)
    calls = messages[1]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["multi_agent_v1__spawn_agent", "code"]
    assert calls[1]["function"]["arguments"] == {"input": "7"}  # the template gets the arguments as an object
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]


def test_sealed_reasoning_opens_under_a_rotated_key_and_never_once_altered() -> None:
    old = ReasoningSeal([KEY_OLD])
    blob = old.seal("the sky scatters blue")
    assert "sky" not in blob
    rotated = ReasoningSeal([KEY_NEW, KEY_OLD])  # the new key seals, the old one still opens
    assert rotated.open(blob, "input.1") == "the sky scatters blue"
    assert ReasoningSeal([KEY_NEW]).open(rotated.seal("x"), "input.0") == "x"
    tampered = blob[:40] + ("A" if blob[40] != "A" else "B") + blob[41:]
    for bad, seal in ((tampered, rotated), (blob, ReasoningSeal([KEY_NEW])), ("not a blob", rotated)):
        with pytest.raises(OpenAIError) as refused:
            seal.open(bad, "input.1")
        assert refused.value.status == 400 and refused.value.param == "input"


def test_a_finished_reasoning_item_carries_its_sealed_text() -> None:
    seal = ReasoningSeal([KEY_NEW])
    req = ResponsesRequest.model_validate({"model": "m", "input": "hi", "include": ["reasoning.encrypted_content"]})
    assembler = OutputAssembler()
    assembler.configure(req.offered_tools, req.chosen_tool, seal.seal)
    out = assembler.feed(TextDelta("", reasoning="hmm")) + assembler.feed(TextDelta("ok", finish_reason="stop"))
    added = next(e for e in out if e["type"] == "response.output_item.added")
    assert "encrypted_content" not in added["item"]
    item = ResponseReasoningItem.model_validate(assembler.output[0])
    assert seal.open(item.encrypted_content, "input.0") == "hmm"


def test_a_local_shell_call_is_an_exec_action_the_client_runs_and_sends_back() -> None:
    shell = [{"type": "local_shell"}]
    req = ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": shell,
                                           "tool_choice": {"type": "function", "name": "local_shell"}})
    assert req.chosen_tool is not None and req.chosen_tool.model_name == "local_shell"
    echo = Response.model_validate(response_object(request_echo(req), response_id="resp_1", created_at=1, model="m",
                                                   status="completed", output=[]))
    assert echo.tools[0].type == "local_shell" and echo.tool_choice.name == "local_shell"
    assembler = OutputAssembler()
    assembler.configure(req.offered_tools, req.chosen_tool, None)
    out = assembler.feed(TextDelta("", finish_reason="tool_calls", tool_calls=(
        ToolCallDelta(0, "local_shell", '{"command": ["ls", "-l"], "working_directory": "/tmp"}'),)))
    for number, event in enumerate(out):
        EVENT.validate_python(events.numbered(event, number))
    call = LocalShellCall.model_validate(assembler.output[0])
    assert call.action.command == ["ls", "-l"] and call.action.working_directory == "/tmp"
    back = ResponsesRequest.model_validate({"model": "m", "tools": shell, "input": [
        {"role": "user", "content": "list"}, assembler.output[0],
        {"type": "local_shell_call_output", "id": call.call_id, "output": "a b"}]})
    messages = conversation_messages([], [stored_item(item) for item in back.items], None)
    assert messages[1]["tool_calls"][0]["function"] == {"name": "local_shell", "arguments": {
        "command": ["ls", "-l"], "working_directory": "/tmp"}}
    assert messages[2] == {"role": "tool", "content": "a b", "tool_call_id": call.call_id}


def test_without_keys_the_workers_of_a_sqlite_database_share_one_made_once(tmp_path, monkeypatch) -> None:
    from frontend.responses_api.sealing import AUTO_KEY_FILE, reasoning_seal
    from frontend.settings import Settings

    for name in ("RESPONSES_REASONING_KEYS", "RESPONSES_REASONING_KEYS_FILE"):
        monkeypatch.delenv(name, raising=False)
    settings = Settings(responses_db_url=f"sqlite:///{tmp_path / 'db' / 'responses.sqlite3'}")
    blob = reasoning_seal(settings).seal("shared")
    assert reasoning_seal(settings).open(blob, "input.0") == "shared"  # another worker, the same key file
    key_file = tmp_path / "db" / AUTO_KEY_FILE
    assert oct(key_file.stat().st_mode & 0o777) == "0o600" and list((tmp_path / "db").iterdir()) == [key_file]
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# rotated\n{KEY_NEW}\n{key_file.read_text().strip()}\n")
    rotated = Settings(responses_db_url=settings.responses_db_url, responses_reasoning_keys_file=keys_file)
    assert reasoning_seal(rotated).open(blob, "input.0") == "shared"
