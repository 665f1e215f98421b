"""Tool calls out of a model's streamed answer: content text for the message and calls for `tool_calls`.

Each model family writes its calls in its own markup (Qwen's `<tool_call>` blocks, Llama's bare JSON,
Mistral's `[TOOL_CALLS]` array; the guided formats of OpenAI `tool_choice` have none). A parser is fed the
answer's text in pieces split anywhere and returns what is certain so far; `finish()` releases the rest.
Every decision depends on the characters only, never on where a piece ends, so streamed and non-streamed
(`feed(text)`, `finish()`) agree exactly. No text is lost or invented: a call's `arguments` are the JSON
text the model wrote, text that only looks like a call is content as written, and only the markup of
calls and the layout whitespace around them (the newlines chat templates put there) is dropped.

A call is certain only when complete (until then the answer may end or go wrong, and its text must then
be content, which a streamed client could not un-receive), so by default a call goes out as one delta
when its object closes: the object is buffered from its "{" while a depth counter that knows strings
follows it, and `json` decodes it once, when the depth returns to 0. `stream_arguments=True` (the guided
modes, whose grammar makes the JSON valid) trades that for latency: once `{"name": "f", "arguments": {`
is read the arguments go out as they come, and a call that breaks stays a call with the arguments it had
(as OpenAI's calls cut off by the token limit do).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable, Protocol


@dataclass(frozen=True)
class ToolCallDelta:
    index: int                 # which call of this answer: 0, 1, ...
    name: str | None = None    # set on the call's first delta only (the renderer then adds the call id and type)
    arguments: str = ""        # the next fragment of the call's JSON arguments text


@dataclass(frozen=True)
class ParsedDelta:
    content: str = ""                                # text for message `content`
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str             # the JSON text of the arguments object, exactly the concatenation of its fragments


class ToolCallParser(Protocol):
    def feed(self, text: str) -> ParsedDelta: ...
    def finish(self) -> ParsedDelta: ...
    @property
    def calls(self) -> list[ToolCall]: ...


_NOTHING = ParsedDelta()
_WHITESPACE = " \t\n\r"
_SPACE_RUN = re.compile(r"[ \t\n\r]+")

# --- JSON: where an object ends, whether it is valid, whether it is a call --------------------------------

MORE, DONE, FAIL = 0, 1, 2   # scan outcomes: needs more text / the object closed / not valid JSON
_OPENED, _CLOSED = 3, 4      # step() only: the inner container (a call's arguments) opened / closed
_STRING_RUN = re.compile(r'[^"\\]+')
_PLAIN_RUN = re.compile(r"[ \t\n\r0-9eE.+\-truefalsn,:]+")  # what JSON may have outside strings and brackets
_INVALID = object()


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")  # NaN, Infinity: `json` reads them, no client's parser does


# Objects decode as tuples of (key, value) pairs, so that a repeated key shows and an object is told from
# an array; numbers as their length, as only the shape matters (no int() digit limit, no float work).
_DECODER = json.JSONDecoder(object_pairs_hook=tuple, parse_constant=_no_constant, parse_int=len, parse_float=len)


def _decode(text: str) -> object:
    """`text` decoded when it is exactly one JSON value, else _INVALID."""
    try:
        value, end = _DECODER.raw_decode(text)
    except (ValueError, RecursionError):
        return _INVALID
    return value if end == len(text) else _INVALID


class JsonObjectScanner:
    """Finds where a JSON object arriving in pieces ends, and whether it is valid JSON.

    A depth counter that knows strings follows the brackets, skipping runs of other characters with one
    regex match; when the depth returns to 0, `json` decodes the buffered text once. A character that
    cannot stand outside a JSON string (the `<` of a tag, prose) fails the object at once, so that what
    follows a broken call is read again as markup or content. `inner` is where the first container at
    depth `inner_depth` starts and ends: a call object's arguments (or, at depth 0, the object itself)."""

    def __init__(self, inner_depth: int = 1) -> None:
        self._pieces: list[str] = []
        self._size = self._depth = 0
        self._in_string = self._escaped = False
        self._inner_depth = inner_depth
        self.inner = [-1, -1]
        self.value: object = _INVALID  # the decoded object once DONE (objects as tuples of pairs)

    def scan(self, text: str, i: int) -> tuple[int, int]:
        """Consume text from index i. Returns (len(text), MORE) when all of it was consumed and the object
        is still open, (j, DONE) when it closed just before index j, or (j, FAIL) when text[j] cannot
        continue valid JSON (text[i:j] was consumed)."""
        while True:
            i, outcome = self.step(text, i)
            if outcome <= FAIL:
                return i, outcome

    def step(self, text: str, i: int) -> tuple[int, int]:
        """scan(), also stopping just after the inner container's opening (_OPENED) and closing (_CLOSED)."""
        start, n, outcome = i, len(text), MORE
        while i < n and outcome == MORE:
            c = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped, i = False, i + 1
                elif (run := _STRING_RUN.match(text, i)) is not None:
                    i = run.end()
                else:  # a quote ends the string, a backslash escapes the next character
                    self._escaped = self._in_string = c == "\\"
                    i += 1
            elif c == '"' and self._depth:
                self._in_string, i = True, i + 1
            elif c == "{" or (c == "[" and self._depth):
                if self._depth == self._inner_depth and self.inner[0] < 0:
                    self.inner[0], outcome = self._size + i - start, _OPENED
                self._depth, i = self._depth + 1, i + 1
            elif c in "]}" and self._depth:
                self._depth, i = self._depth - 1, i + 1
                if self._depth == self._inner_depth and self.inner[1] < 0:
                    self.inner[1], outcome = self._size + i - start, _CLOSED
                if not self._depth:
                    outcome = DONE
            elif self._depth and (run := _PLAIN_RUN.match(text, i)) is not None:
                i = run.end()
            else:
                outcome = FAIL
        self._pieces.append(text[start:i])
        self._size += i - start
        if outcome == DONE:
            self.value = _decode(self.text())
            if self.value is _INVALID:
                return i - 1, FAIL
        return i, outcome

    def text(self) -> str:
        """The object's text consumed so far (joined once, then kept joined)."""
        if len(self._pieces) != 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0]


_ARGUMENT_KEYS = {"name": "name", "arguments": "arguments", "parameters": "arguments"}
_NAME_THEN_ARGUMENTS = re.compile(
    r'\{S"name"S:S("(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*")S,S"(?:arguments|parameters)"S:S\{'
    .replace("S", r"[ \t\n\r]*"))


def _call_name(value: object) -> str | None:
    """The tool name of a decoded call object: exactly `{"name": "f", "arguments": {...}}` (or
    "parameters"), in any order; None for anything else."""
    if not isinstance(value, tuple) or len(value) != 2:
        return None
    members = {_ARGUMENT_KEYS.get(key): member for key, member in value}
    name = members.get("name")
    is_call = members.keys() == {"name", "arguments"} and isinstance(members["arguments"], tuple)
    return name if is_call and isinstance(name, str) and name else None


def _name_before_arguments(text: str) -> str | None:
    """The name of a call whose text so far is `{"name": "f", "arguments": {`, what a streamed call is
    committed on (one that writes its arguments first waits for its whole object)."""
    match = _NAME_THEN_ARGUMENTS.fullmatch(text)
    return (json.loads(match.group(1)) if match else "") or None


# --- text plumbing ---------------------------------------------------------------------------------------

def held_prefix_length(text: str, marker: str) -> int:
    """How many characters at the end of text are the start of marker (a proper prefix of it)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


class _Output:
    """One feed()'s content and tool-call deltas, with the template's layout kept out of the content.

    Whitespace at the end of the content is held back: if call markup follows, the parser takes it into
    the markup (dropped with it); otherwise it goes out with the next content. Whitespace after a call is
    dropped when it would begin the content, sit between two calls or end the answer, and kept when it
    separates content before the call from content after it."""

    def __init__(self) -> None:
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self.held_space: list[str] = []
        self.after_call = False     # nothing but whitespace since the last call
        self._any_content = False   # some non-whitespace content has gone out

    def content(self, text: str) -> None:
        kept = len(text.rstrip(_WHITESPACE))
        if not kept:
            if text:
                self.held_space.append(text)
            return
        start = 0
        if self.after_call:
            self.after_call = False
            if not self._any_content:
                self.held_space.clear()
                start = len(text) - len(text.lstrip(_WHITESPACE))
        self._content += self.held_space
        self.held_space = [text[kept:]] if kept < len(text) else []
        self._content.append(text[start:kept])
        self._any_content = True

    def finish(self) -> None:
        if not self.after_call:
            self._content += self.held_space
        self.held_space = []

    def tool_call(self, index: int, name: str | None, arguments: str) -> None:
        deltas = self._deltas
        if deltas and deltas[-1].index == index and name is None:
            deltas[-1] = ToolCallDelta(index, deltas[-1].name, deltas[-1].arguments + arguments)
        elif name is not None or arguments:
            deltas.append(ToolCallDelta(index, name, arguments))

    def take(self) -> ParsedDelta:
        if not self._content and not self._deltas:
            return _NOTHING
        delta = ParsedDelta("".join(self._content), tuple(self._deltas))
        self._content, self._deltas = [], []
        return delta


# --- the parsers: one state machine, the formats differing in class attributes ------------------------------

class _CallParser:
    """States are methods `state(text, i) -> next index`: a state consumes text from i, or switches state
    and returns i to have the same character read again."""

    MARKER = ""      # markup that opens calls anywhere in the content
    OPENER = ""      # "{" or "[": opens calls at the very start of the answer (after whitespace)
    ARRAY = False    # the calls sit in a JSON array
    SEPARATOR = ""   # markup between calls outside an array
    END = ""         # an optional closing tag after each call
    # Special tokens of the family's tokenizer that the parser must read although the detokenizer drops
    # special tokens from content: the serving layer has them kept in this parser's text.
    SPECIAL_MARKERS: tuple[str, ...] = ()

    def __init__(self, stream_arguments: bool = False, name: str | None = None) -> None:
        self._stream = stream_arguments
        self._name = name                   # the named format: the object read is this tool's arguments
        self._out = _Output()
        self._calls: list[ToolCall] = []
        self._state: Callable[[str, int], int] = self._start if self.OPENER else self._content
        self._held = ""                     # a possible beginning of MARKER or END: read again with the next text
        self._attempt: list[str] = []       # the raw markup of the call being read: content if it fails
        self._expected = ""                 # in call markup: the characters that may come next
        self._scanner: JsonObjectScanner | None = None
        self._committed: str | None = None  # streaming: the name of the call whose arguments go out
        self._arguments: list[str] = []     # streaming: its fragments so far
        self._arguments_open = False        # streaming: the text being read is its arguments

    def feed(self, text: str) -> ParsedDelta:
        text, self._held = self._held + text, ""
        i = 0
        while i < len(text):
            i = self._state(text, i)
        return self._out.take()

    def finish(self) -> ParsedDelta:
        if self._scanner is not None:
            self._break(0)
        elif self._attempt:
            self._fail(0)
        self._out.content(self._held)
        self._held = ""
        self._out.finish()
        self._state = self._content
        return self._out.take()

    @property
    def calls(self) -> list[ToolCall]:
        return list(self._calls)

    def _start(self, text: str, i: int) -> int:
        """The answer's beginning, in formats whose calls may open it: whitespace, then OPENER."""
        run = _SPACE_RUN.match(text, i)
        if run is not None:
            self._out.content(run.group())  # held: the layout before a call, if one follows
            return run.end()
        if text[i] == self.OPENER:
            self._begin("", self.OPENER)
        else:
            self._state = self._content
        return i

    def _content(self, text: str, i: int) -> int:
        """Content, up to MARKER; a possible beginning of it at the end waits for the next text."""
        self._state = self._content
        at = text.find(self.MARKER, i) if self.MARKER else -1
        if at >= 0:
            self._out.content(text[i:at])
            self._begin(self.MARKER, "[" if self.ARRAY else "{")
            return at + len(self.MARKER)
        n = len(text)
        keep = held_prefix_length(text[max(i, n - len(self.MARKER) + 1):], self.MARKER)
        self._out.content(text[i:n - keep])
        self._held = text[n - keep:]
        return n

    def _begin(self, markup: str, expected: str) -> None:
        self._attempt, self._out.held_space = self._out.held_space + [markup], []
        self._expected, self._state = expected, self._markup

    def _fail(self, i: int) -> int:
        """The markup read since the last certain point is not a call: it is content, and text[i] is read
        again as content (it may start real markup)."""
        self._out.content("".join(self._attempt))
        self._attempt = []
        self._state = self._content
        return i

    def _markup(self, text: str, i: int) -> int:
        """In call markup: whitespace, then one of the expected characters, or the attempt fails."""
        run = _SPACE_RUN.match(text, i)
        if run is not None:
            self._attempt.append(run.group())
            return run.end()
        if text[i] not in self._expected:
            return self._fail(i)
        if text[i] == "{":
            self._scanner = JsonObjectScanner(0 if self._name else 1)
            self._state = self._in_call
            return i
        self._attempt.append(text[i])  # an array's "[" or "," before a call, or its "]" after the last
        self._expected = "{"
        if text[i] == "]":
            self._attempt = []
            self._state = self._content
        return i + 1

    def _after_call(self, text: str, i: int) -> int:
        """After a call: the array goes on, or a separator opens the next call, or END (optional) ends it."""
        if self.ARRAY:
            self._expected, self._state = ",]", self._markup
            return i
        run = _SPACE_RUN.match(text, i)
        if run is not None:
            self._out.content(run.group())  # held: layout unless content follows
            return run.end()
        if self.SEPARATOR and text[i] == self.SEPARATOR:
            self._begin(self.SEPARATOR, "{")
            return i + 1
        end = text[i:i + len(self.END)]
        if self.END and end == self.END:
            self._out.held_space = []
            i += len(end)
        elif self.END and self.END.startswith(end) and i + len(end) == len(text):
            self._held = end
            return len(text)
        self._state = self._content
        return i

    def _in_call(self, text: str, i: int) -> int:
        """Inside a call object (named: the arguments object). A failing character or one closing invalid
        JSON (or no call) breaks the call and is read again as content."""
        scanner = self._scanner
        assert scanner is not None
        j, event = scanner.step(text, i)
        piece, name = text[i:j], self._name
        if event == _OPENED and self._stream:
            name = name or _name_before_arguments(scanner.text())
            if name is not None:  # committed: the markup before the arguments is part of a certain call now
                self._attempt, piece = [], piece[-1]
                self._committed, self._arguments, self._arguments_open = name, [], True
                self._out.tool_call(len(self._calls), name, "")
        elif event == _CLOSED and self._arguments_open:  # streamed arguments: only valid JSON goes out
            start, end = scanner.inner
            if _decode(scanner.text()[start:end]) is _INVALID:
                piece, j, event = piece[:-1], j - 1, FAIL
        elif event == DONE:
            name = name or _call_name(scanner.value)
            if name is None:
                piece, j, event = piece[:-1], j - 1, FAIL
        self._take(piece)
        if event == FAIL:
            return self._break(j)
        if event == _CLOSED:
            self._arguments_open = False
        elif event == DONE:
            assert name is not None
            start, end = scanner.inner
            arguments = scanner.text()[start:end]
            if self._committed is None:
                self._out.tool_call(len(self._calls), name, arguments)
            self._calls.append(ToolCall(name, arguments))
            self._end_call()
            self._attempt, self._out.after_call, self._state = [], True, self._after_call
        return j

    def _take(self, piece: str) -> None:
        """Text of the call: out at once while its arguments stream, else kept in case the call fails."""
        if self._arguments_open:
            self._arguments.append(piece)
            self._out.tool_call(len(self._calls), None, piece)
        else:
            self._attempt.append(piece)

    def _break(self, i: int) -> int:
        """The call being read cannot complete. A committed call stays a call with the arguments it
        streamed; otherwise its whole text is content."""
        if self._committed is not None:
            self._calls.append(ToolCall(self._committed, "".join(self._arguments)))
        self._end_call()
        return self._fail(i)

    def _end_call(self) -> None:
        self._scanner, self._committed, self._arguments, self._arguments_open = None, None, [], False


class HermesToolParser(_CallParser):
    """Qwen2/2.5/3 and Hermes: `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, any number
    of blocks, content before, between and after them. The closing tag is optional (a call is complete
    when its object closes; a model stopped at `</tool_call>` still made its call)."""

    MARKER, END = "<tool_call>", "</tool_call>"


class Llama3JsonToolParser(_CallParser):
    """Llama 3.1/3.2 JSON tool calling: the answer is `{"name": "f", "parameters": {...}}` (or
    "arguments"), several separated by `;`, optionally after `<|python_tag|>`. A call is recognised only
    at the start of the answer (after whitespace) or right after `<|python_tag|>`; text before the tag
    is content, and so is a JSON object anywhere else (prose that quotes JSON is not a call)."""

    MARKER, OPENER, SEPARATOR = "<|python_tag|>", "{", ";"
    SPECIAL_MARKERS = (MARKER,)


class MistralToolParser(_CallParser):
    """Mistral (v0.3 tokenizer and its chat template): `[TOOL_CALLS][{"name": "f", "arguments": {...}},
    ...]`, content before the marker. The arguments must be an object (not a JSON string)."""

    MARKER, ARRAY = "[TOOL_CALLS]", True
    SPECIAL_MARKERS = (MARKER,)


class RequiredToolParser(_CallParser):
    """Guided output for `tool_choice: "required"`: the answer is a JSON array of one or more
    `{"name": "f", "parameters": {...}}` (or "arguments"), no markup. An answer that does not start
    (after whitespace) with "[" is content."""

    OPENER, ARRAY = "[", True


class NamedToolParser(_CallParser):
    """Guided output for `tool_choice: {"type": "function", "function": {"name": ...}}`: the whole answer
    is the arguments object of that one tool, call 0. An answer that is not one JSON object is content."""

    OPENER = "{"

    def __init__(self, name: str, stream_arguments: bool = False) -> None:
        super().__init__(stream_arguments, name)


def named_parser(name: str, stream_arguments: bool = False) -> NamedToolParser:
    return NamedToolParser(name, stream_arguments)


# Factories: PARSERS[family]() for the markup formats, PARSERS["named"](tool_name) for the guided one.
PARSERS: dict[str, Callable[..., ToolCallParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "required": RequiredToolParser,
    "named": named_parser,
}

# The model families' own markup (TOOL_CALL_PARSER): the parsers tool_choice "auto" reads answers with.
FAMILY_PARSERS = ("hermes", "llama3_json", "mistral")


def parse_all(parser: ToolCallParser, text: str) -> tuple[str, list[ToolCall]]:
    """The non-streamed result: the same parser fed the whole answer at once."""
    first = parser.feed(text)
    last = parser.finish()
    return first.content + last.content, parser.calls


def parser_for_template(chat_template: str | None) -> str | None:
    """The tool-call family a chat template teaches its model, from the markup it renders; None when the
    template shows none we parse (or one we do not: Qwen3-Coder's `<function=...>` XML inside
    `<tool_call>`, Mistral's newer `[TOOL_CALLS]name[ARGS]{...}`)."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return None if "<function=" in chat_template else "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return None if "[ARGS]" in chat_template else "mistral"
    # Llama 3.1's JSON calls (`{"name": ..., "parameters": ...}`), in its own turn markup or in another's
    # (the demo checkpoint's ChatML template).
    if "<|python_tag|>" in chat_template or ('"parameters"' in chat_template and (
            "<|start_header_id|>" in chat_template or "tools" in chat_template)):
        return "llama3_json"
    return None
