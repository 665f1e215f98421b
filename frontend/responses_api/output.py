"""A generation's deltas as the response's output items, and the stream events that build them.

One state machine for streamed and non-streamed responses alike (a non-streamed response feeds the same
deltas and drops the events), so that a streamed response's items are exactly the non-streamed ones. The
chat pipeline's parsers have already split each delta into reasoning, text and tool-call fragments
(frontend/generation/serving.py `parse_answer`); here each kind becomes an output item, opened when its
first fragment comes and closed when another kind begins or the answer ends:
reasoning -> `reasoning`, text -> `message` (one `output_text` part), each tool call -> `function_call`
(with its `namespace` for a namespaced function), or `custom_tool_call` for a custom tool (its input streamed
as `response.custom_tool_call_input.*`); with a custom tool forced, the text is that call's input.
With include `reasoning.encrypted_content`, each finished reasoning item also carries its text sealed
(`seal`, frontend/responses_api/sealing.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from frontend.generation.serving import TextDelta, TokenInfo
from frontend.responses_api import events
from frontend.responses_api.events import Event
from frontend.responses_api.objects import (custom_tool_call_item, function_call_item, local_shell_call_item,
                                        message_item, new_id, output_text_part, reasoning_item)
from frontend.responses_api.request import OfferedTool
from frontend.responses_api.tools import custom_input, shell_action


class TokenStrings(Protocol):
    """What logprobs need of a tokenizer (frontend.text.tokenizer.Tokenizer, or a test's fake)."""

    def token_text(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


def logprob_entries(tokens: list[TokenInfo], strings: TokenStrings, top_n: int) -> list[dict[str, Any]]:
    """`output_text` logprobs: each token's text, raw bytes and log-probability, with its alternatives."""
    def entry(token_id: int, logprob: float | None) -> dict[str, Any]:
        return {"token": strings.token_text(token_id), "bytes": list(strings.token_bytes(token_id)),
                "logprob": logprob}

    return [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(alt, lp) for alt, lp in t.top[:top_n]]}
            for t in tokens]


@dataclass
class _OpenItem:
    kind: str  # "reasoning", "message", "function_call" or "custom_tool_call"
    output_index: int
    item_id: str
    text: str = ""  # reasoning or message text; a call's arguments
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    name: str = ""  # function_call
    call_id: str = ""
    call_index: int = -1  # the parser's index of this call
    namespace: str | None = None
    from_text: bool = False  # a forced custom tool's call: its input is the answer's text


class OutputAssembler:
    """Feed it the answer's deltas; it returns the events each causes and keeps the output items."""

    def __init__(self, strings: TokenStrings | None = None, top_logprobs: int | None = None):
        self.strings = strings
        self.top_logprobs = top_logprobs  # None: no logprobs
        self.output: list[dict[str, Any]] = []  # closed items, in order (an open one is not in it yet)
        self.finish_reason: str | None = None
        self.reasoning_tokens = 0
        self._open: _OpenItem | None = None
        self.tools: dict[str, OfferedTool] = {}  # the offered tools by the name the model calls them
        self.freeform: OfferedTool | None = None  # a forced custom tool: the text is its input
        self.seal: Callable[[str], str] | None = None  # include reasoning.encrypted_content

    def configure(self, tools: list[OfferedTool], forced: OfferedTool | None,
                  seal: Callable[[str], str] | None) -> None:
        self.tools = {tool.model_name: tool for tool in tools}
        self.freeform = forced if forced is not None and forced.kind == "custom" else None
        self.seal = seal

    # ----- deltas ------------------------------------------------------------------------------------
    def feed(self, delta: TextDelta) -> list[Event]:
        out: list[Event] = []
        if delta.reasoning:
            item = self._ensure(out, "reasoning")
            item.text += delta.reasoning
            out.append(events.reasoning_text_delta(item.item_id, item.output_index, 0, delta.reasoning))
            if not delta.text and not delta.tool_calls:
                self.reasoning_tokens += len(delta.tokens)
        if delta.text and self.freeform is not None:
            item = self._ensure(out, "custom_tool_call")
            item.text += delta.text
            out.append(events.custom_tool_call_input_delta(item.item_id, item.output_index, delta.text))
        elif delta.text:
            item = self._ensure(out, "message")
            logprobs = self._logprobs(delta.tokens)
            item.text += delta.text
            item.logprobs += logprobs
            out.append(events.output_text_delta(item.item_id, item.output_index, 0, delta.text, logprobs))
        for call in delta.tool_calls:
            open_item = self._open
            if (open_item is None or open_item.kind not in ("function_call", "custom_tool_call", "local_shell_call")
                    or open_item.from_text or open_item.call_index != call.index):
                item = self._start(out, "function_call", call.name or "", call.index)
            else:
                item = open_item
            if call.arguments:
                item.text += call.arguments
                if item.kind == "function_call":  # a custom tool's input is known once its call is whole
                    out.append(events.function_call_arguments_delta(item.item_id, item.output_index,
                                                                    call.arguments))
        if delta.finish_reason is not None:
            out += self.finish(delta.finish_reason)
        return out

    def finish(self, finish_reason: str) -> list[Event]:
        """Close the open item (incomplete if the answer was cut at its token limit). An answer with no
        output at all still gets its (empty) message, as chat answers with an empty content."""
        self.finish_reason = finish_reason
        out: list[Event] = []
        if self._open is None and not self.output:
            self._start(out, "message" if self.freeform is None else "custom_tool_call")
        self._close(out, "incomplete" if finish_reason == "length" else "completed")
        return out

    def interrupted(self) -> list[Event]:
        """The answer stopped without finishing (an error, a cancel): its open item ends incomplete."""
        out: list[Event] = []
        self._close(out, "incomplete")
        return out

    @property
    def items(self) -> list[dict[str, Any]]:
        """The output so far, the open item included as it stands."""
        return self.output + ([self._item(self._open, "in_progress")] if self._open is not None else [])

    # ----- items -------------------------------------------------------------------------------------
    def _logprobs(self, tokens: list[TokenInfo]) -> list[dict[str, Any]]:
        if self.top_logprobs is None or self.strings is None:
            return []
        return logprob_entries(tokens, self.strings, self.top_logprobs)

    def _ensure(self, out: list[Event], kind: str) -> _OpenItem:
        if self._open is not None and self._open.kind == kind:
            return self._open
        return self._start(out, kind)

    def _start(self, out: list[Event], kind: str, name: str = "", call_index: int = -1) -> _OpenItem:
        self._close(out, "completed")
        namespace, from_text = None, False
        if kind == "custom_tool_call" and self.freeform is not None:  # the answer's text is its input
            name, namespace, from_text = self.freeform.name, self.freeform.namespace, True
        elif kind == "function_call" and name in self.tools:  # the name the model knows it by
            tool = self.tools[name]
            kind = {"custom": "custom_tool_call", "local_shell": "local_shell_call"}.get(tool.kind, kind)
            name, namespace = tool.name, tool.namespace
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc", "custom_tool_call": "ctc",
                  "local_shell_call": "lsh"}[kind]
        item = _OpenItem(kind, len(self.output), new_id(prefix), name=name, call_index=call_index,
                         call_id=new_id("call") if kind.endswith("call") else "", namespace=namespace,
                         from_text=from_text)
        self._open = item
        out.append(events.output_item_added(item.output_index, self._item(item, "in_progress", added=True)))
        if kind == "message":
            out.append(events.content_part_added(item.item_id, item.output_index, 0, self._part(item, added=True)))
        elif kind == "reasoning":
            out.append(events.content_part_added(item.item_id, item.output_index, 0,
                                                 {"type": "reasoning_text", "text": ""}))
        return item

    def _close(self, out: list[Event], status: str) -> None:
        item = self._open
        if item is None:
            return
        self._open = None
        if item.kind == "message":
            out.append(events.output_text_done(item.item_id, item.output_index, 0, item.text, item.logprobs))
            out.append(events.content_part_done(item.item_id, item.output_index, 0, self._part(item)))
        elif item.kind == "reasoning":
            out.append(events.reasoning_text_done(item.item_id, item.output_index, 0, item.text))
            out.append(events.content_part_done(item.item_id, item.output_index, 0,
                                                {"type": "reasoning_text", "text": item.text}))
        elif item.kind == "local_shell_call":
            pass  # OpenAI streams a shell call as its items alone (added, then done with its action)
        elif item.kind == "custom_tool_call":
            if not item.from_text:
                item.text = custom_input(item.text)
                if item.text:
                    out.append(events.custom_tool_call_input_delta(item.item_id, item.output_index, item.text))
            out.append(events.custom_tool_call_input_done(item.item_id, item.output_index, item.text))
        else:
            out.append(events.function_call_arguments_done(item.item_id, item.output_index, item.name, item.text))
        done = self._item(item, status)
        self.output.append(done)
        out.append(events.output_item_done(item.output_index, done))

    def _part(self, item: _OpenItem, added: bool = False) -> dict[str, Any]:
        logprobs = None if self.top_logprobs is None else ([] if added else item.logprobs)
        return output_text_part("" if added else item.text, logprobs)

    def _item(self, item: _OpenItem, status: str, added: bool = False) -> dict[str, Any]:
        """The item as it stands; as announced by `output_item.added`, with no content yet."""
        if item.kind == "message":
            return message_item(item.item_id, "assistant", [] if added else [self._part(item)], status)
        if item.kind == "reasoning":
            sealed = None
            if self.seal is not None and not added and status != "in_progress":
                sealed = self.seal(item.text)
            return reasoning_item(item.item_id, "" if added else item.text, status=status, encrypted_content=sealed)
        if item.kind == "local_shell_call":
            return local_shell_call_item(item.item_id, item.call_id, {} if added else shell_action(item.text), status)
        if item.kind == "custom_tool_call":
            return custom_tool_call_item(item.item_id, item.call_id, item.name, "" if added else item.text, status,
                                         item.namespace)
        return function_call_item(item.item_id, item.call_id, item.name, "" if added else item.text, status,
                                  item.namespace)
