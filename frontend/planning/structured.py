"""Structured output: from OpenAI's request fields to the engine's guide (checked before it reaches the engine).
The parsers that read the answer back are chosen with the guide, in frontend/planning/chat_plan.py.

Both engines take TensorRT-LLM's guided-decoding interface (a guide type and its text; xgrammar runs it), so
what a request asks for is turned into one `Guide` here:
- `response_format`: `json_object` is a JSON schema for any object; `json_schema` is its schema;
- `tool_choice` "required" and a named tool: the output is forced into the form the guided tool-call parsers
  read (frontend/parsing/tool_parsers.py): for a named tool, its arguments object (the tool's parameters schema);
  for "required", a JSON array of `{"name", "parameters"}` objects over all the tools, not "the first tool";
- vLLM's extensions `guided_json`, `guided_regex`, `guided_grammar` (EBNF, as xgrammar reads it).
JSON schemas are checked here (a schema that is not one is a 400 naming the field, never an engine
failure), and every guide's text is bounded (MAX_GUIDE_BYTES); then every guide is compiled by the frontend
before any engine sees it (frontend/planning/guide_check.py: on TensorRT-LLM a guide that fails to compile
fails every request of the batch), after `refuse_unguided` (an engine whose guided decoding is off).
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from frontend.generation.engine import Guide
from frontend.api_types.errors import invalid_request
from frontend.api_types.request_bodies import ChatCompletionRequest, GuidedFields, NamedToolChoice, ToolDefinition

MAX_GUIDE_BYTES = 100_000  # every guide (schema, regex, grammar) is compiled (frontend, engine): bounded input
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def check_schema(schema: Any, param: str) -> str:
    """The schema as compact JSON text, after checking that it is a JSON Schema (its own `$schema`
    draft, else 2020-12)."""
    if not isinstance(schema, dict):
        raise invalid_request(f"{param}: a JSON schema must be an object", param)
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(part) for part in exc.path)
        raise invalid_request(f"{param}: not a valid JSON schema: {exc.message}"
                              f"{f' (at {where})' if where else ''}", param) from None
    return check_size(json.dumps(schema, separators=(",", ":"), ensure_ascii=False), param, "schema")


def check_size(text: str, param: str, what: str) -> str:
    if len(text.encode("utf-8", "surrogatepass")) > MAX_GUIDE_BYTES:
        raise invalid_request(f"{param}: the {what} is longer than {MAX_GUIDE_BYTES} bytes", param)
    return text


def json_schema_guide(schema: Any, param: str) -> Guide:
    return Guide("json_schema", check_schema(schema, param), param)


def _object_schema(parameters: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema, which must describe an object (an empty one means any object)."""
    return parameters if parameters.get("type") else {**parameters, "type": "object"}


def tool_schema_guides(req: ChatCompletionRequest) -> list[Guide]:
    """The parameters schemas the tool_choice guide is made of (all tools for "required", the named one's),
    each under its own field: a schema that does not compile is named where the client wrote it."""
    choice = req.effective_tool_choice
    if choice != "required" and not isinstance(choice, NamedToolChoice):
        return []
    return [json_schema_guide(_object_schema(tool.function.parameters), f"tools.{i}.function.parameters")
            for i, tool in enumerate(req.tools or [])
            if choice == "required" or tool.function.name == choice.function.name]


def refuse_unguided(guide: Guide | None, guided_decoding: bool) -> None:
    """A guided request on an engine whose guided decoding is off (EngineMetadata.guided_decoding) is a 400
    naming the field: TensorRT-LLM would generate it unguided, without a word (audit finding 8)."""
    if guide is not None and not guided_decoding:
        raise invalid_request(f"{guide.param}: guided decoding is off on this model's engine (its "
                              "guided_decoding_backend or xgrammar_tokenizer_info_path is empty), so the output "
                              "could not follow it", guide.param)


def named_tool_guide(tool: ToolDefinition, param: str = "tool_choice") -> Guide:
    """The named tool's arguments object."""
    return json_schema_guide(_object_schema(tool.function.parameters), param)


def required_tools_guide(tools: list[ToolDefinition], parallel: bool, param: str = "tool_choice") -> Guide:
    """One or more calls (at most one without parallel_tool_calls) of any of the tools, each
    `{"name": <its name>, "parameters": <its arguments>}`."""
    for i, tool in enumerate(tools):
        check_schema(_object_schema(tool.function.parameters), f"tools.{i}.function.parameters")
    call = {"anyOf": [{"type": "object",
                       "properties": {"name": {"const": tool.function.name},
                                      "parameters": _object_schema(tool.function.parameters)},
                       "required": ["name", "parameters"], "additionalProperties": False}
                      for tool in tools]}
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return json_schema_guide(schema, param)


def extension_guide(req: GuidedFields) -> Guide | None:
    if req.guided_json is not None:
        return json_schema_guide(req.guided_json, "guided_json")
    if req.guided_regex is not None:
        return Guide("regex", check_size(req.guided_regex, "guided_regex", "regex"), "guided_regex")
    if req.guided_grammar is not None:
        return Guide("ebnf_grammar", check_size(req.guided_grammar, "guided_grammar", "grammar"), "guided_grammar")
    return None


def chat_guide(req: ChatCompletionRequest) -> Guide | None:
    """The one guide a chat request asks for, if any; asking for two at once is a 400."""
    guides: list[Guide] = []
    if req.response_format is not None and req.response_format.type != "text":
        if req.response_format.type == "json_object":
            guides.append(Guide("json_schema", json.dumps(ANY_OBJECT), "response_format"))
        else:
            assert req.response_format.json_schema is not None  # the schema's own validator says so
            guides.append(json_schema_guide(req.response_format.json_schema.schema_, "response_format"))
    choice = req.effective_tool_choice
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in req.tools or [] if t.function.name == choice.function.name)
        guides.append(named_tool_guide(tool))
    elif choice == "required":
        guides.append(required_tools_guide(req.tools or [], req.parallel_tool_calls))
    extension = extension_guide(req)
    if extension is not None:
        guides.append(extension)
    if len(guides) > 1:
        raise invalid_request(f"{guides[0].param} and {guides[1].param} both constrain the output; give one",
                              guides[1].param)
    return guides[0] if guides else None
