"""Tool calls out of a model's streamed answer: content text for the message and calls for `tool_calls`.

Each model family writes its calls in its own markup (Qwen's `<tool_call>` blocks, Llama's bare JSON,
Mistral's `[TOOL_CALLS]` array; the guided formats of OpenAI `tool_choice` have no markup at all). A
parser is fed the answer's text as the detokenizer releases it, in pieces split anywhere, and returns
what is certain so far; `finish()` releases what was held back.

Three promises shape everything here:

* Streamed and non-streamed agree exactly, for any split of the text into pieces: the parser is one
  character-driven state machine whose decisions depend only on the characters, never on where a piece
  ends, and the non-streamed result is nothing but `feed(text)` and `finish()`.
* No text is lost and no text is invented. A call's `arguments` are the raw JSON text the model wrote,
  checked by a validating JSON scanner (so clients can parse them); text that only looks like a call
  (`<tool_call>` then prose, `{"name": 3}`, an unknown key, an answer that ends mid-call) goes to
  `content` as written. The only text dropped is the markup of calls (and, when streaming arguments,
  of a committed call that broke), and the layout whitespace around calls (the newlines the chat
  templates put between content and calls).
* Linear work: every character is looked at a bounded number of times; held-back text is kept as a list
  of pieces and joined once, when it is released. A 200 KB answer fed one character at a time costs
  what it costs fed at once, times a constant.

When is a call certain? Only when it is complete: until then the answer may still end (the token
limit) or go wrong (`{"a": 1,}`), and then, by the promise above, its text must be content, which a
streamed client could not un-receive if its fragments had already gone out as a tool call. So by
default each call is released as one delta (name and whole arguments) the moment its JSON closes;
content around it streams as it comes. `stream_arguments=True` trades that guarantee for latency: a call
is committed once its name is complete and its arguments object has begun, its fragments then go out
as they arrive, and a committed call that breaks stays a call with the arguments it had (the behaviour
OpenAI shows for a call cut off by the token limit); streamed and non-streamed still agree exactly.
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

# ---------------------------------------------------------------------------------------------------------
# An incremental, validating JSON scanner: where a JSON object ends, and whether it is valid JSON (RFC 8259,
# as `json.loads` reads it but without NaN/Infinity, which no client's JSON parser accepts).

MORE, DONE, FAIL = 0, 1, 2  # scan() outcomes: needs more text / the object closed / not valid JSON

_JSON_SPACE = " \t\n\r"
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
_SPACE_RUN = re.compile(r"[ \t\n\r]+")
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')  # string characters needing no attention
_DIGIT_RUN = re.compile(r"[0-9]+")

# Scanner modes: what the next character may be.
_VALUE, _FIRST_ITEM, _FIRST_KEY, _KEY, _COLON, _AFTER_VALUE, _STRING, _ESCAPE, _UNICODE, _LITERAL, _NUMBER = range(11)
# Number sub-states (JSON's number grammar); the ones a number may end in are _ENDABLE.
_MINUS, _ZERO, _INT, _DOT, _FRAC, _E, _E_SIGN, _EXP = range(8)
_ENDABLE = frozenset((_ZERO, _INT, _FRAC, _EXP))
_DIGIT_RUN_STATES = frozenset((_INT, _FRAC, _EXP))


class JsonObjectScanner:
    """Finds where a JSON object ends in text arriving in pieces, validating it on the way.

    Each character is examined once (runs of plain string characters, digits and whitespace are skipped
    by one regex match), so the cost of a whole object is linear however it is split. Subclasses may
    watch the object's top-level members through the `_member_*` hooks, called only at member
    boundaries so the common path pays nothing for them.
    """

    _watches_members = False

    def __init__(self) -> None:
        self._stack: list[str] = []   # the open containers, "{" or "["
        self._mode = _VALUE
        self._in_key = False          # the string being scanned is an object key
        self._number = _INT
        self._literal = ""            # the rest of true/false/null still expected
        self._hex_left = 0

    def scan(self, text: str, i: int) -> tuple[int, int]:
        """Consume text from index i. Returns (j, MORE) when all of text was consumed and the object is
        still open, (j, DONE) when it closed just before index j, or (j, FAIL) when text[j] cannot
        continue valid JSON (text[i:j] was consumed)."""
        n = len(text)
        stack = self._stack
        mode = self._mode
        watch = self._watches_members
        if watch:
            self._member_resume(i)
        while i < n:
            c = text[i]
            if mode == _STRING:
                run = _STRING_RUN.match(text, i)
                if run is not None:
                    i = run.end()
                    if i == n:
                        break
                    c = text[i]
                if c == '"':
                    i += 1
                    if self._in_key:
                        mode = _COLON
                        if watch and len(stack) == 1 and not self._member_key_end(text, i):
                            return self._fail(text, i - 1, mode)
                    else:
                        mode = _AFTER_VALUE
                        if watch and len(stack) == 1 and not self._member_value_end(text, i):
                            return self._fail(text, i - 1, mode)
                elif c == "\\":
                    mode = _ESCAPE
                    i += 1
                else:  # a raw control character: JSON requires it escaped
                    return self._fail(text, i, mode)
            elif mode == _ESCAPE:
                if c in '"\\/bfnrt':
                    mode = _STRING
                elif c == "u":
                    mode = _UNICODE
                    self._hex_left = 4
                else:
                    return self._fail(text, i, mode)
                i += 1
            elif mode == _UNICODE:
                if c not in _HEX_DIGITS:
                    return self._fail(text, i, mode)
                i += 1
                self._hex_left -= 1
                if not self._hex_left:
                    mode = _STRING
            elif mode == _NUMBER:
                state = self._number
                if "0" <= c <= "9":
                    if state in _DIGIT_RUN_STATES:
                        i = _DIGIT_RUN.match(text, i).end()
                        continue
                    if state == _ZERO:  # a leading zero is a whole integer part: "01" is not JSON
                        return self._fail(text, i, mode)
                    self._number = (_ZERO if c == "0" else _INT) if state == _MINUS else \
                        _FRAC if state == _DOT else _EXP
                    i += 1
                elif c == "." and state in (_ZERO, _INT):
                    self._number = _DOT
                    i += 1
                elif c in "eE" and state in (_ZERO, _INT, _FRAC):
                    self._number = _E
                    i += 1
                elif c in "+-" and state == _E:
                    self._number = _E_SIGN
                    i += 1
                elif state in _ENDABLE:  # the number ended before c: c is read again after the value
                    mode = _AFTER_VALUE
                    if watch and len(stack) == 1 and not self._member_value_end(text, i):
                        return self._fail(text, i, mode)
                else:
                    return self._fail(text, i, mode)
            elif mode == _LITERAL:
                if c != self._literal[0]:
                    return self._fail(text, i, mode)
                i += 1
                self._literal = self._literal[1:]
                if not self._literal:
                    mode = _AFTER_VALUE
                    if watch and len(stack) == 1 and not self._member_value_end(text, i):
                        return self._fail(text, i - 1, mode)
            elif c in _JSON_SPACE:
                if not stack:  # the object must start right here: the callers skip what comes before it
                    return self._fail(text, i, mode)
                i = _SPACE_RUN.match(text, i).end()
            elif mode == _AFTER_VALUE:
                if c == ",":
                    mode = _KEY if stack[-1] == "{" else _VALUE
                    i += 1
                elif c == ("}" if stack[-1] == "{" else "]"):
                    i += 1
                    stack.pop()
                    if not stack:
                        if watch and not self._member_object_end():
                            return self._fail(text, i - 1, mode)
                        self._mode = _AFTER_VALUE
                        return i, DONE
                    if watch and len(stack) == 1 and not self._member_value_end(text, i):
                        return self._fail(text, i - 1, mode)
                else:
                    return self._fail(text, i, mode)
            elif mode == _FIRST_KEY or mode == _KEY:
                if c == '"':
                    if watch and len(stack) == 1:
                        self._member_key_start(i)
                    self._in_key = True
                    mode = _STRING
                    i += 1
                elif c == "}" and mode == _FIRST_KEY:
                    i += 1
                    stack.pop()
                    if not stack:
                        if watch and not self._member_object_end():
                            return self._fail(text, i - 1, mode)
                        self._mode = _AFTER_VALUE
                        return i, DONE
                    mode = _AFTER_VALUE
                    if watch and len(stack) == 1 and not self._member_value_end(text, i):
                        return self._fail(text, i - 1, mode)
                else:
                    return self._fail(text, i, mode)
            elif mode == _COLON:
                if c != ":":
                    return self._fail(text, i, mode)
                mode = _VALUE
                i += 1
            else:  # _VALUE or _FIRST_ITEM: a value starts here
                if mode == _FIRST_ITEM and c == "]":
                    i += 1
                    stack.pop()
                    mode = _AFTER_VALUE
                    if watch and len(stack) == 1 and not self._member_value_end(text, i):
                        return self._fail(text, i - 1, mode)
                    continue
                if not stack and c != "{":
                    return self._fail(text, i, mode)
                if watch and len(stack) == 1 and not self._member_value_start(i, c):
                    return self._fail(text, i, mode)
                if c == "{":
                    stack.append("{")
                    mode = _FIRST_KEY
                elif c == "[":
                    stack.append("[")
                    mode = _FIRST_ITEM
                elif c == '"':
                    self._in_key = False
                    mode = _STRING
                elif c == "-" or "0" <= c <= "9":
                    mode = _NUMBER
                    self._number = _MINUS if c == "-" else _ZERO if c == "0" else _INT
                elif c == "t":
                    mode, self._literal = _LITERAL, "rue"
                elif c == "f":
                    mode, self._literal = _LITERAL, "alse"
                elif c == "n":
                    mode, self._literal = _LITERAL, "ull"
                else:
                    return self._fail(text, i, mode)
                i += 1
        self._mode = mode
        if watch:
            self._member_suspend(text, n)
        return n, MORE

    def _fail(self, text: str, i: int, mode: int) -> tuple[int, int]:
        self._mode = mode
        if self._watches_members:
            self._member_suspend(text, i)
        return i, FAIL

    # Member hooks (only for subclasses that set _watches_members); a False return fails the scan.
    def _member_key_start(self, i: int) -> None: ...
    def _member_key_end(self, text: str, end: int) -> bool: return True
    def _member_value_start(self, i: int, first: str) -> bool: return True
    def _member_value_end(self, text: str, end: int) -> bool: return True
    def _member_object_end(self) -> bool: return True
    def _member_resume(self, i: int) -> None: ...
    def _member_suspend(self, text: str, end: int) -> None: ...


_ARGUMENT_KEYS = {"name": "name", "arguments": "arguments", "parameters": "arguments"}


class _CallObjectScanner(JsonObjectScanner):
    """Scans one call object, `{"name": "f", "arguments": {...}}` (or "parameters"), in any key order.

    It fails as soon as the object cannot be a call (an unknown or repeated key, a name that is not a
    non-empty string, arguments that are not an object), so a look-alike is released as content without
    waiting for its end. The arguments' raw text is collected piece by piece in `arguments_pieces`."""

    _watches_members = True

    def __init__(self) -> None:
        super().__init__()
        self.name: str | None = None
        self.arguments_pieces: list[str] = []
        self.arguments_started = False
        self.arguments_done = False
        self.arguments_after_name = False   # the name was complete when the arguments began
        self.arguments_end = -1             # where the arguments ended in the text of the latest scan
        self._seen: set[str] = set()
        self._member: str | None = None     # "name" or "arguments": whose value comes next
        self._capture_into: list[str] | None = None
        self._capture_from = 0

    def _member_key_start(self, i: int) -> None:
        self._capture_into, self._capture_from = [], i

    def _member_key_end(self, text: str, end: int) -> bool:
        member = _ARGUMENT_KEYS.get(self._take_capture(text, end))
        if member is None or member in self._seen:
            return False
        self._seen.add(member)
        self._member = member
        return True

    def _member_value_start(self, i: int, first: str) -> bool:
        if self._member == "name":
            if first != '"':
                return False
            self._capture_into = []
        else:
            if first != "{":
                return False
            self.arguments_started = True
            self.arguments_after_name = self.name is not None
            self._capture_into = self.arguments_pieces
        self._capture_from = i
        return True

    def _member_value_end(self, text: str, end: int) -> bool:
        if self._member == "name":
            self.name = self._take_capture(text, end)
            return bool(self.name)
        self.arguments_pieces.append(text[self._capture_from:end])
        self._capture_into = None
        self.arguments_done = True
        self.arguments_end = end
        return True

    def _member_object_end(self) -> bool:
        return len(self._seen) == 2

    def _member_resume(self, i: int) -> None:
        self._capture_from = i  # a value or key continued from the previous text
        self.arguments_end = -1

    def _member_suspend(self, text: str, end: int) -> None:
        if self._capture_into is not None and end > self._capture_from:
            self._capture_into.append(text[self._capture_from:end])

    def _take_capture(self, text: str, end: int) -> str:
        pieces = self._capture_into or []
        pieces.append(text[self._capture_from:end])
        self._capture_into = None
        return json.loads("".join(pieces))  # a complete JSON string: the scanner has validated it


class _ArgumentsObjectScanner:
    """The guided `named` format: the object scanned is the arguments themselves, of a known tool."""

    def __init__(self, name: str) -> None:
        self.name: str | None = name
        self.arguments_pieces: list[str] = []
        self.arguments_started = True
        self.arguments_done = False
        self.arguments_after_name = True
        self.arguments_end = -1
        self._scanner = JsonObjectScanner()

    def scan(self, text: str, i: int) -> tuple[int, int]:
        j, outcome = self._scanner.scan(text, i)
        if j > i:
            self.arguments_pieces.append(text[i:j])
        self.arguments_done = outcome == DONE
        self.arguments_end = j if self.arguments_done else -1
        return j, outcome


_CallScanner = _CallObjectScanner | _ArgumentsObjectScanner

# ---------------------------------------------------------------------------------------------------------
# Text plumbing shared by the parsers.


def held_prefix_length(text: str, marker: str) -> int:
    """How many characters at the end of text are the start of marker (a proper prefix of it)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


class _Output:
    """Collects one feed()'s content and tool-call deltas, and keeps the template's layout out of content.

    Whitespace at the end of the content is held back: if call markup follows, it is the layout before
    the call and is dropped; otherwise it goes out with the next content. Whitespace after a call is
    dropped when it would begin the content, sit between two calls or end the answer, and kept when it
    separates content before the call from content after it."""

    def __init__(self) -> None:
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self._held_space: list[str] = []
        self._after_call = False    # nothing but whitespace since the last call
        self._any_content = False   # some non-whitespace content has gone out

    def content(self, text: str) -> None:
        kept = len(text.rstrip(_JSON_SPACE))
        if not kept:
            if text:
                self._held_space.append(text)
            return
        start = 0
        if self._after_call:
            self._after_call = False
            if not self._any_content:
                self._held_space.clear()
                start = len(text) - len(text.lstrip(_JSON_SPACE))
        if self._held_space:
            self._content.extend(self._held_space)
            self._held_space.clear()
        self._content.append(text[start:kept])
        self._any_content = True
        if kept < len(text):
            self._held_space.append(text[kept:])

    def call_done(self) -> None:
        self._after_call = True

    def drop_held_space(self) -> None:
        self._held_space.clear()

    def finish(self) -> None:
        if not self._after_call:
            self._content.extend(self._held_space)
        self._held_space.clear()

    def take_held_space(self) -> list[str]:
        """The held whitespace, now part of call markup (returned in case the call fails)."""
        held, self._held_space = self._held_space, []
        return held

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
        self._content.clear()
        self._deltas.clear()
        return delta


# ---------------------------------------------------------------------------------------------------------
# The parsers: one state machine each, states being methods `state(text, i) -> next index`. A state
# consumes text from i (or switches state and returns i to have the same character read again).

_State = Callable[[str, int], int]


class _CallParser:
    """What every format shares: content, call attempts, the release policy, finish()."""

    def __init__(self, stream_arguments: bool = False) -> None:
        self._stream = stream_arguments
        self._out = _Output()
        self._calls: list[ToolCall] = []
        self._next_index = 0
        self._state: _State = self._start
        self._attempt: list[str] = []       # raw text of the call markup being read: content if it fails
        self._scanner: _CallScanner | None = None
        self._committed: int | None = None  # streaming: index of the call whose fragments are going out
        self._streamed = 0                   # streaming: how many of its argument pieces went out

    # -- the protocol
    def feed(self, text: str) -> ParsedDelta:
        self._run(text)
        return self._out.take()

    def finish(self) -> ParsedDelta:
        self._finish()
        return self._out.take()

    @property
    def calls(self) -> list[ToolCall]:
        return list(self._calls)

    # -- format-specific parts
    def _start(self, text: str, i: int) -> int:
        raise NotImplementedError

    def _content_state(self, text: str, i: int) -> int:
        """Where text goes after a failed attempt: content, still watching for markup if the format has any."""
        raise NotImplementedError

    def _after_call(self, text: str, i: int) -> int:
        raise NotImplementedError

    def _finish_state(self) -> None:
        """Release what the current state holds back (a partial marker)."""

    # -- the machinery
    def _run(self, text: str) -> None:
        i, n = 0, len(text)
        while i < n:
            i = self._state(text, i)

    def _passthrough(self, text: str, i: int) -> int:
        self._out.content(text[i:])
        return len(text)

    def _begin_attempt(self, markup: str) -> None:
        self._attempt = self._out.take_held_space()
        if markup:
            self._attempt.append(markup)

    def _fail_attempt(self, i: int) -> int:
        """The markup read since the last certain point is not a call: it is content, and text[i] is read
        again as content (it may start real markup)."""
        self._out.content("".join(self._attempt))
        self._attempt = []
        self._state = self._content_state
        return i

    def _skip_space_into_attempt(self, text: str, i: int) -> int:
        run = _SPACE_RUN.match(text, i)
        if run is None:
            return i
        self._attempt.append(run.group())
        return run.end()

    def _expect_call_object(self, text: str, i: int) -> int:
        i = self._skip_space_into_attempt(text, i)
        if i == len(text):
            return i
        if text[i] != "{":
            return self._fail_attempt(i)
        self._scanner = self._new_scanner()
        self._state = self._in_call
        return i

    def _new_scanner(self) -> _CallScanner:
        return _CallObjectScanner()

    def _in_call(self, text: str, i: int) -> int:
        """Inside a call object. By default its text is only collected (the call goes out whole when the
        object closes). When streaming arguments, the call is committed the moment its arguments begin
        after a complete name; from then on each scanned piece of the arguments goes out at once, and
        only the markup after the arguments is kept in case the call breaks."""
        scanner = self._scanner
        assert scanner is not None
        arguments_were_done = scanner.arguments_done
        j, outcome = scanner.scan(text, i)
        if self._committed is None and self._stream and scanner.arguments_started \
                and scanner.arguments_after_name:
            self._committed = self._next_index
            self._next_index += 1
            self._attempt = []  # the markup before the arguments is now part of a certain call
            self._out.tool_call(self._committed, scanner.name, "")
        if self._committed is not None:
            pieces = scanner.arguments_pieces
            for piece in pieces[self._streamed:]:
                self._out.tool_call(self._committed, None, piece)
            self._streamed = len(pieces)
            # the text after the arguments (the rest of the call's markup) is content if the call breaks
            if arguments_were_done:
                self._attempt.append(text[i:j])
            elif scanner.arguments_end >= 0:
                self._attempt.append(text[scanner.arguments_end:j])
        else:
            self._attempt.append(text[i:j])
        if outcome == MORE:
            return j
        if outcome == DONE:
            self._complete_call()
            self._state = self._after_call
            return j
        return self._break_call(j)

    def _complete_call(self) -> None:
        scanner = self._scanner
        assert scanner is not None and scanner.name is not None
        arguments = "".join(scanner.arguments_pieces)
        if self._committed is None:
            self._out.tool_call(self._next_index, scanner.name, arguments)
            self._next_index += 1
        self._calls.append(ToolCall(scanner.name, arguments))
        self._attempt = []
        self._scanner = None
        self._committed = None
        self._streamed = 0
        self._out.call_done()

    def _break_call(self, i: int) -> int:
        """The call being read cannot complete. A committed call stays a call with the arguments it
        streamed; otherwise its whole text is content."""
        if self._committed is not None:
            scanner = self._scanner
            assert scanner is not None and scanner.name is not None
            self._calls.append(ToolCall(scanner.name, "".join(scanner.arguments_pieces)))
            self._committed = None
            self._streamed = 0
        self._scanner = None
        return self._fail_attempt(i)

    def _finish(self) -> None:
        if self._scanner is not None:
            self._break_call(0)
        elif self._attempt:
            self._fail_attempt(0)
        else:
            self._finish_state()
        self._out.finish()
        self._state = self._passthrough

    # -- shared states for formats whose calls sit in a JSON array (mistral, required)
    def _expect_array_open(self, text: str, i: int) -> int:
        i = self._skip_space_into_attempt(text, i)
        if i == len(text):
            return i
        if text[i] != "[":
            return self._fail_attempt(i)
        self._attempt.append("[")
        self._state = self._expect_array_item
        return i + 1

    def _expect_array_item(self, text: str, i: int) -> int:
        return self._expect_call_object(text, i)  # "]" here (an empty array, a trailing comma) is not a call

    def _after_array_item(self, text: str, i: int) -> int:
        i = self._skip_space_into_attempt(text, i)
        if i == len(text):
            return i
        if text[i] == ",":
            self._attempt.append(",")
            self._state = self._expect_array_item
            return i + 1
        if text[i] == "]":
            self._attempt = []
            self._state = self._content_state
            return i + 1
        return self._fail_attempt(i)


class _MarkerContent:
    """The content state of formats whose calls follow a marker: text goes out as content except the
    marker's possible beginning at the end, held until the next text shows whether it is the marker."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.held = ""

    def split(self, text: str, i: int) -> tuple[str, int]:
        """Returns (content before the marker, index just past the marker in text), or (content, -1)
        when text holds no whole marker."""
        held_before = self.held
        buffer = held_before + text[i:] if held_before else text[i:]
        at = buffer.find(self.marker)
        if at >= 0:
            self.held = ""
            return buffer[:at], i + at + len(self.marker) - len(held_before)
        keep = held_prefix_length(buffer, self.marker)
        self.held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep], -1


class _MarkedCallParser(_CallParser):
    """Formats whose calls follow a marker anywhere in the content (the text before it is content)."""

    MARKER = ""

    def __init__(self, stream_arguments: bool = False) -> None:
        super().__init__(stream_arguments)
        self._marker = _MarkerContent(self.MARKER)

    def _start(self, text: str, i: int) -> int:
        return self._content_state(text, i)

    def _content_state(self, text: str, i: int) -> int:
        self._state = self._content_state
        before, after = self._marker.split(text, i)
        self._out.content(before)
        if after < 0:
            return len(text)
        self._begin_attempt(self.MARKER)
        self._state = self._after_marker
        return after

    def _after_marker(self, text: str, i: int) -> int:
        return self._expect_call_object(text, i)

    def _finish_state(self) -> None:
        self._out.content(self._marker.held)
        self._marker.held = ""


class HermesToolParser(_MarkedCallParser):
    """Qwen2/2.5/3 and Hermes: `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, any number
    of blocks, content before, between and after them. The closing tag is optional (a call is complete
    when its object closes; a model stopped at `</tool_call>` still made its call)."""

    MARKER, END = "<tool_call>", "</tool_call>"

    def __init__(self, stream_arguments: bool = False) -> None:
        super().__init__(stream_arguments)
        self._end_held = ""   # the beginning of a closing tag after a call

    def _after_call(self, text: str, i: int) -> int:
        if not self._end_held:
            run = _SPACE_RUN.match(text, i)  # layout, unless no closing tag follows
            if run is not None:
                self._out.content(run.group())
                return run.end()
        want = self.END[len(self._end_held):]
        got = text[i:i + len(want)]
        if want.startswith(got):
            if len(got) == len(want):
                self._end_held = ""
                self._out.drop_held_space()
                self._state = self._content_state
            else:
                self._end_held += got
            return i + len(got)
        held, self._end_held = self._end_held, ""
        self._state = self._content_state
        if held:  # not a closing tag after all: read it again as content
            self._run(held)
        return i

    def _finish_state(self) -> None:
        self._marker.held += self._end_held
        self._end_held = ""
        super()._finish_state()


class Llama3JsonToolParser(_MarkedCallParser):
    """Llama 3.1/3.2 JSON tool calling: the answer is `{"name": "f", "parameters": {...}}` (or
    "arguments"), several separated by `;`, optionally after `<|python_tag|>`. A call is recognised only
    at the start of the answer (after whitespace) or right after `<|python_tag|>`; text before the tag
    is content, and so is a JSON object anywhere else (prose that quotes JSON is not a call)."""

    MARKER = "<|python_tag|>"

    def _start(self, text: str, i: int) -> int:
        run = _SPACE_RUN.match(text, i)
        if run is not None:
            self._out.content(run.group())  # held: dropped if a call follows
            return run.end()
        if text[i] == "{":
            self._begin_attempt("")
            return self._expect_call_object(text, i)
        self._state = self._content_state
        return i

    def _after_call(self, text: str, i: int) -> int:
        run = _SPACE_RUN.match(text, i)
        if run is not None:
            self._out.content(run.group())  # held: layout unless content follows
            return run.end()
        if text[i] == ";":
            self._begin_attempt(";")
            self._state = self._expect_call_object
            return i + 1
        self._state = self._content_state
        return i


class MistralToolParser(_MarkedCallParser):
    """Mistral (v0.3 tokenizer and its chat template): `[TOOL_CALLS][{"name": "f", "arguments": {...}},
    ...]`, content before the marker. The arguments must be an object (not a JSON string)."""

    MARKER = "[TOOL_CALLS]"

    def _after_marker(self, text: str, i: int) -> int:
        return self._expect_array_open(text, i)

    def _after_call(self, text: str, i: int) -> int:
        return self._after_array_item(text, i)


class RequiredToolParser(_CallParser):
    """Guided output for `tool_choice: "required"`: the answer is a JSON array of one or more
    `{"name": "f", "parameters": {...}}` (or "arguments"), no markup. An answer that does not start
    (after whitespace) with "[" is content."""

    def _start(self, text: str, i: int) -> int:
        run = _SPACE_RUN.match(text, i)
        if run is not None:
            self._out.content(run.group())
            return run.end()
        if text[i] == "[":
            self._begin_attempt("[")
            self._state = self._expect_array_item
            return i + 1
        self._state = self._passthrough
        return i

    def _content_state(self, text: str, i: int) -> int:
        self._state = self._passthrough
        return i

    def _after_call(self, text: str, i: int) -> int:
        return self._after_array_item(text, i)


class NamedToolParser(_CallParser):
    """Guided output for `tool_choice: {"type": "function", "function": {"name": ...}}`: the whole answer
    is the arguments object of that one tool, call 0. An answer that is not one JSON object is content."""

    def __init__(self, name: str, stream_arguments: bool = False) -> None:
        super().__init__(stream_arguments)
        self._name = name

    def _start(self, text: str, i: int) -> int:
        run = _SPACE_RUN.match(text, i)
        if run is not None:
            self._out.content(run.group())
            return run.end()
        if text[i] == "{":
            self._begin_attempt("")
            self._scanner = self._new_scanner()
            self._state = self._in_call
            return i
        self._state = self._passthrough
        return i

    def _new_scanner(self) -> _CallScanner:
        return _ArgumentsObjectScanner(self._name)

    def _content_state(self, text: str, i: int) -> int:
        self._state = self._passthrough
        return i

    def _after_call(self, text: str, i: int) -> int:
        self._state = self._passthrough
        return i


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
