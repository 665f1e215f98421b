"""One chat request's plan, decided in one place from the request and the model it runs on: which tools
the chat template renders, the guide the engine applies, and how the answer is read back (the reasoning
parser, and where it starts; the tool-call parser, and how many calls it may give).

These decisions constrain each other, so they are made together (`ChatPlan.build`):
- a guide (`response_format` json, `tool_choice` required or named, a `guided_*` extension) applies from the
  answer's first token, so the answer has no reasoning ahead of it: the reasoning parser starts outside the
  reasoning even when the template opened a `<think>` in the prompt. Else the guided JSON or call, which
  never writes `</think>`, would all land in `reasoning_content`;
- a `response_format` answer is the JSON document itself: it goes to `content`, never to a tool-call parser
  (tool_choice auto would otherwise read a JSON object, or markup inside one of its strings, as a call);
- `tool_choice` "none": the template renders no tools (the model is not invited to call) and no tool-call
  parser reads the answer;
- `parallel_tool_calls` false: at most one call, whatever the tool_choice (the guide of "required" allows
  one; for "auto" the calls after the first are dropped).
The routes check `guide` (and the tool schemas it is made of, `guide_parts`) with frontend/planning/guide_check.py
before the engine sees it, render with `template_tools`, give the engine `guide`, and run the answer through
`parsing`;
the serving layer runs that parsing (frontend/generation/serving.py `parse_answer`) and decides nothing itself.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Callable

from frontend.generation.engine import Guide
from frontend.api_types.errors import invalid_request
from frontend.models.registry import ModelContext
from frontend.parsing.reasoning import REASONING_PARSERS, prompt_opens_reasoning
from frontend.api_types.request_bodies import ChatCompletionRequest, NamedToolChoice
from frontend.generation.serving import AnswerParsing
from frontend.planning.structured import chat_guide, tool_schema_guides
from frontend.text.tokenizer import Tokenizer
from frontend.parsing.tool_parsers import PARSERS, ParsedDelta, ToolCall, ToolCallParser, named_parser

REASONING_PROMPT_TAIL = 16  # prompt tokens whose text says whether the template opened a <think>


class CallLimit:
    """A tool-call parser that gives at most `limit` calls: the later calls' markup is still taken out of
    the content (by the parser it wraps), and their deltas are dropped."""

    def __init__(self, parser: ToolCallParser, limit: int):
        self._parser = parser
        self._limit = limit

    def feed(self, text: str) -> ParsedDelta:
        return self._within(self._parser.feed(text))

    def finish(self) -> ParsedDelta:
        return self._within(self._parser.finish())

    @property
    def calls(self) -> list[ToolCall]:
        return self._parser.calls[:self._limit]

    def __getattr__(self, name: str) -> Any:
        """Anything else is the wrapped parser's (e.g. the special-token markers it reads calls after)."""
        return getattr(self._parser, name)

    def _within(self, parsed: ParsedDelta) -> ParsedDelta:
        if all(call.index < self._limit for call in parsed.tool_calls):
            return parsed
        return ParsedDelta(parsed.content, tuple(call for call in parsed.tool_calls if call.index < self._limit))


@dataclass(frozen=True)
class ChatPlan:
    template_tools: list[dict[str, Any]] | None  # what the chat template renders (None: no tools)
    guide: Guide | None  # the engine's grammar, from the answer's first token
    tool_parser: str | None = None  # PARSERS key: a family's markup (auto), "required" or "named"
    named_tool: str | None = None  # tool_parser "named": the tool the guide forces
    max_tool_calls: int | None = None  # None: any number
    reasoning_parser: str | None = None  # REASONING_PARSERS key
    starts_in_reasoning: bool | None = None  # None (with a reasoning parser): as the rendered prompt says
    guide_parts: tuple[Guide, ...] = ()  # the tool schemas the guide is made of, each under its own field

    @classmethod
    def build(cls, req: ChatCompletionRequest, context: ModelContext) -> ChatPlan:
        """The plan of this request on this model; what the request gets wrong (two guides, a schema that
        is not one, tool_choice auto on a model whose call markup is unknown) is a 400 naming the field."""
        guide = chat_guide(req)
        choice = req.effective_tool_choice
        template_tools = ([tool.as_template_input() for tool in req.tools]
                          if req.tools and choice != "none" else None)
        tool_parser, named_tool = None, None
        if isinstance(choice, NamedToolChoice):
            tool_parser, named_tool = "named", choice.function.name
        elif choice == "required":
            tool_parser = "required"
        elif choice == "auto" and not cls._answer_is_json(req):
            if context.tool_call_parser is None:
                raise invalid_request(
                    "tool_choice auto needs to know how this model writes tool calls, and its chat template "
                    "does not say: start the frontend with TOOL_CALL_PARSER (hermes, llama3_json or mistral), "
                    "or use tool_choice required or a named tool", "tool_choice")
            tool_parser = context.tool_call_parser
        max_tool_calls = 1 if tool_parser is not None and not req.parallel_tool_calls else None
        # Guided: the grammar holds from the first token, so the answer opens with no reasoning.
        starts_in_reasoning = False if context.reasoning_parser and guide is not None else None
        return cls(template_tools, guide, tool_parser, named_tool, max_tool_calls, context.reasoning_parser,
                   starts_in_reasoning, tuple(tool_schema_guides(req)) if guide is not None else ())

    @staticmethod
    def _answer_is_json(req: ChatCompletionRequest) -> bool:
        return req.response_format is not None and req.response_format.type != "text"

    def for_prompt(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> ChatPlan:
        """The plan once the prompt is rendered: whether the answer starts inside the reasoning (the
        template left a `<think>` open), where the plan did not decide it already."""
        if self.reasoning_parser is None or self.starts_in_reasoning is not None:
            return self
        opened = prompt_opens_reasoning(tokenizer.decode(prompt_ids[-REASONING_PROMPT_TAIL:]))
        return replace(self, starts_in_reasoning=opened)

    @property
    def parsing(self) -> AnswerParsing:
        """The parsers' factories (one parser per choice): the reasoning first, then tool calls in the rest."""
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning = functools.partial(REASONING_PARSERS[self.reasoning_parser],
                                          starts_in_reasoning=bool(self.starts_in_reasoning))
        return AnswerParsing(reasoning, self._tool_parser_factory())

    def _tool_parser_factory(self) -> Callable[[], ToolCallParser] | None:
        factory: Callable[[], ToolCallParser]
        if self.tool_parser is None:
            return None
        if self.tool_parser == "named":
            # Guided: the grammar makes the call certain as it comes, so its arguments stream as they arrive.
            name = self.named_tool or ""
            factory = functools.partial(named_parser, name, stream_arguments=True)
        elif self.tool_parser == "required":
            factory = functools.partial(PARSERS["required"], stream_arguments=True)
        else:
            factory = PARSERS[self.tool_parser]
        if self.max_tool_calls is None:
            return factory
        limit, make = self.max_tool_calls, factory
        return lambda: CallLimit(make(), limit)
