"""Streaming tool-call parsers: recorded answers of each family, split at every point and at random, must
give exactly what the whole answer gives; look-alikes and broken calls are content; the JSON scanner
agrees with `json` on what is valid; a 200 KB answer fed one character at a time stays linear.

Both release policies are checked: the default (a call goes out whole once certain) and
stream_arguments=True (a call's fragments go out as they arrive once it is committed).
"""

from __future__ import annotations

import json
import random
import time
from typing import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from build_engine import demo_checkpoint

from frontend.parsing.tool_parsers import (DONE, PARSERS, JsonObjectScanner, ParsedDelta, ToolCall, ToolCallDelta,
                                   ToolCallParser, named_parser, parse_all, parser_for_template)

Factory = Callable[[], ToolCallParser]
Expected = tuple[str, list[ToolCall]]


def factory(family: str, stream: bool, tool: str = "get_weather") -> Factory:
    if family == "named":
        return lambda: named_parser(tool, stream_arguments=stream)
    return lambda: PARSERS[family](stream_arguments=stream)


def run_stream(make: Factory, pieces: list[str]) -> tuple[Expected, list[ParsedDelta]]:
    """Feed the pieces; rebuild content and calls from the deltas alone, checking their shape."""
    parser = make()
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    content = "".join(delta.content for delta in deltas)
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for delta in deltas:
        for call in delta.tool_calls:
            if call.index not in names:
                assert call.name is not None, "a call's first delta carries its name"
                assert call.index == len(names), "calls are indexed 0, 1, ... in order"
                names[call.index], arguments[call.index] = call.name, ""
            else:
                assert call.name is None, "the name comes on the first delta only"
            arguments[call.index] += call.arguments
    calls = [ToolCall(names[index], arguments[index]) for index in sorted(names)]
    assert calls == parser.calls, "the deltas add up to the parser's calls"
    return (content, calls), deltas


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def check_every_split(make: Factory, text: str, expected: Expected) -> None:
    assert parse_all(make(), text) == expected
    assert run_stream(make, [text])[0] == expected
    for cut in range(len(text) + 1):
        assert run_stream(make, [text[:cut], text[cut:]])[0] == expected, f"split at {cut}: {text[:cut]!r}"
    rng = random.Random(len(text))
    for _ in range(25):
        pieces = random_pieces(text, rng)
        assert run_stream(make, pieces)[0] == expected, pieces
    assert run_stream(make, list(text))[0] == expected


def call(name: str, arguments: dict | str) -> ToolCall:
    return ToolCall(name, arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


# Recorded answers, as the models write them (Qwen2.5's template puts "\n" around each JSON line and
# between blocks; Llama 3.1 may open with <|python_tag|>; Mistral v0.3 puts a space after [TOOL_CALLS]).
QWEN_WITH_TEXT = (
    "I'll look up the current weather in both cities.\n"
    "<tool_call>\n"
    '{"name": "get_current_weather", "arguments": {"location": "San Francisco, CA", "unit": "fahrenheit"}}\n'
    "</tool_call>\n"
    "<tool_call>\n"
    '{"name": "get_current_weather", "arguments": {"location": "東京都", "unit": "celsius"}}\n'
    "</tool_call>")
QWEN_BARE = (
    "<tool_call>\n"
    '{"name": "search_notes", "arguments": {"query": "meeting \\"Q3\\" 🎉 caf\\u00e9", "filters": '
    '{"tags": ["work{", "}plan", "[x]"], "limit": 5, "archived": false, "score": -1.5e-3, "owner": null, '
    '"path": "C:\\\\notes\\\\"}}}\n'
    "</tool_call>")
QWEN_BETWEEN = (
    "Sure.\n<tool_call>\n"
    '{"name": "a", "arguments": {}}\n</tool_call>\n'
    "And then:\n<tool_call>\n"
    '{"arguments": {"k": [1, [2, {"deep": "}"}]]}, "name": "b"}\n</tool_call>\n'
    "Done.")
LLAMA_TAG = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
LLAMA_BARE = ('{"name": "get_weather", "parameters": {"city": "Zürich"}}; '
              '{"name": "get_time", "parameters": {"tz": "Europe/Zurich"}}')
LLAMA_TEXT_THEN_TAG = 'Let me search for that. <|python_tag|>{"name": "web_search", "parameters": {"q": "日本 😀"}}'
MISTRAL_TWO = (
    '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": "celsius"}}, '
    '{"name": "get_current_weather", "arguments": {"location": "Москва", "format": "celsius"}}]')
MISTRAL_TEXT_BEFORE = 'Checking.[TOOL_CALLS][{"name": "lookup", "arguments": {"id": "a\\"b}"}}]'
REQUIRED_TWO = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
NAMED = '{"city": "北京", "unit": "celsius", "hours": [1, 2, 3]}'

VALID = [
    ("hermes", QWEN_WITH_TEXT, ("I'll look up the current weather in both cities.", [
        call("get_current_weather", {"location": "San Francisco, CA", "unit": "fahrenheit"}),
        call("get_current_weather", {"location": "東京都", "unit": "celsius"})])),
    ("hermes", QWEN_BARE, ("", [call("search_notes",
                                     QWEN_BARE[QWEN_BARE.index('{"query'):QWEN_BARE.rindex("}\n</tool_call>")])])),
    ("hermes", QWEN_BETWEEN, ("Sure.\nAnd then:\nDone.", [
        call("a", "{}"), call("b", '{"k": [1, [2, {"deep": "}"}]]}')])),
    ("llama3_json", LLAMA_TAG, ("", [call("get_weather", {"city": "Paris", "days": 3})])),
    ("llama3_json", LLAMA_BARE, ("", [call("get_weather", {"city": "Zürich"}),
                                      call("get_time", {"tz": "Europe/Zurich"})])),
    ("llama3_json", LLAMA_TEXT_THEN_TAG, ("Let me search for that.", [call("web_search", {"q": "日本 😀"})])),
    ("mistral", MISTRAL_TWO, ("", [call("get_current_weather", {"location": "Paris, France", "format": "celsius"}),
                                   call("get_current_weather", {"location": "Москва", "format": "celsius"})])),
    ("mistral", MISTRAL_TEXT_BEFORE, ("Checking.", [call("lookup", '{"id": "a\\"b}"}')])),
    ("required", REQUIRED_TWO, ("", [call("a", '{"x": 1}'), call("b", "{}")])),
    ("named", NAMED, ("", [call("get_weather", NAMED)])),
    ("named", "  " + NAMED + "\n", ("", [call("get_weather", NAMED)])),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole-calls", "stream-arguments"])
@pytest.mark.parametrize("family,text,expected", VALID, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(VALID)])
def test_recorded_answers_split_anywhere(family: str, text: str, expected: Expected, stream: bool) -> None:
    check_every_split(factory(family, stream), text, expected)
    for got in expected[1]:
        json.loads(got.arguments)  # what clients will do


# Text that only looks like a call: all of it is content, as written, under either policy.
LOOK_ALIKES = [
    ("hermes", "<tool_call> I cannot call tools here."),
    ("hermes", 'Use <tool_call> tags, like <tool_c'),
    ("hermes", '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"function": "f", "arguments": {}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "name": "g", "arguments": {}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f"}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"arguments": {"a": NaN}, "name": "f"}\n</tool_call>'),
    ("hermes", "<toolbox> and </tool_call> and <tool_call"),
    ("llama3_json", 'Here is the JSON: {"name": "f", "parameters": {}}'),
    ("llama3_json", '{"answer": 42, "name": "f"}'),
    ("llama3_json", '{"name": "f"}'),
    ("llama3_json", '<|python_tag|>brave_search.call(query="weather")'),
    ("llama3_json", "<|python_ta"),
    ("mistral", "[TOOL_CALLS] sorry, no tools"),
    ("mistral", "[TOOL_CALLS][]"),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": "x"}]'),
    ("mistral", '[TOOL_CALLS]{"name": "f", "arguments": {}}'),
    ("required", "Sorry, I can't."),
    ("required", "[]"),
    ("required", '[{"name": "f"}]'),
    ("named", "not json at all"),
    ("named", "[1, 2]"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole-calls", "stream-arguments"])
@pytest.mark.parametrize("family,text", LOOK_ALIKES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(LOOK_ALIKES)])
def test_look_alikes_are_content(family: str, text: str, stream: bool) -> None:
    check_every_split(factory(family, stream), text, (text, []))


GOOD = '{"name": "f", "arguments": {"a": 1}}'
# (family, text, expected by default, expected with stream_arguments): a call cut off or broken after its
# name and the start of its arguments is content by default; when streaming, its fragments already went out.
BROKEN = [
    ("hermes", 'Checking.\n<tool_call>\n{"name": "f", "arguments": {"a": "b',
     ('Checking.\n<tool_call>\n{"name": "f", "arguments": {"a": "b', []),
     ("Checking.", [call("f", '{"a": "b')])),
    ("hermes", '<tool_call>\n{"name": "f", "argu',
     ('<tool_call>\n{"name": "f", "argu', []),
     ('<tool_call>\n{"name": "f", "argu', [])),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>',
     ('<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>', []),
     ("}}\n</tool_call>", [call("f", '{"a": 1,')])),
    ("hermes", f"<tool_call>\n{GOOD}\n</tool_call>\n<tool_call>\n{{\"name\": \"g\"",
     ("<tool_call>\n{\"name\": \"g\"", [call("f", '{"a": 1}')]),
     ("<tool_call>\n{\"name\": \"g\"", [call("f", '{"a": 1}')])),
    ("hermes", f"<tool_call>\n{GOOD}\n</tool_c",
     ("</tool_c", [call("f", '{"a": 1}')]),
     ("</tool_c", [call("f", '{"a": 1}')])),
    ("hermes", f"A <tool_call>{GOOD} B",  # no closing tag: the call stands, the rest is content
     ("A B", [call("f", '{"a": 1}')]),
     ("A B", [call("f", '{"a": 1}')])),
    ("hermes", f"<tool_call><tool_call>{GOOD}</tool_call>",
     ("<tool_call>", [call("f", '{"a": 1}')]),
     ("<tool_call>", [call("f", '{"a": 1}')])),
    ("mistral", f'[TOOL_CALLS][{GOOD}, {{"name": "g", "arguments": {{"x"',
     (', {"name": "g", "arguments": {"x"', [call("f", '{"a": 1}')]),
     ("", [call("f", '{"a": 1}'), call("g", '{"x"')])),
    ("mistral", f"[TOOL_CALLS][{GOOD}, oops]",
     (", oops]", [call("f", '{"a": 1}')]),
     (", oops]", [call("f", '{"a": 1}')])),
    ("llama3_json", f"{GOOD}; not a call",
     ("; not a call", [call("f", '{"a": 1}')]),
     ("; not a call", [call("f", '{"a": 1}')])),
    ("llama3_json", f"{GOOD}\n\nThe weather is sunny.",
     ("The weather is sunny.", [call("f", '{"a": 1}')]),
     ("The weather is sunny.", [call("f", '{"a": 1}')])),
    ("required", '[{"name": "f", "parameters": {"a": [1, 2',
     ('[{"name": "f", "parameters": {"a": [1, 2', []),
     ("", [call("f", '{"a": [1, 2')])),
    ("named", '{"city": "Par',
     ('{"city": "Par', []),
     ("", [call("get_weather", '{"city": "Par')])),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole-calls", "stream-arguments"])
@pytest.mark.parametrize("family,text,whole,streamed", BROKEN, ids=[f"{f}-{i}" for i, (f, *_) in enumerate(BROKEN)])
def test_broken_and_incomplete_calls(family: str, text: str, whole: Expected, streamed: Expected,
                                     stream: bool) -> None:
    check_every_split(factory(family, stream), text, streamed if stream else whole)


def test_text_is_held_only_while_it_may_be_markup() -> None:
    parser = PARSERS["hermes"]()
    assert parser.feed("Hello wor").content == "Hello wor"
    assert parser.feed("ld <tool").content == "ld"          # " <tool" may be a call's markup
    assert parser.feed("box> ok").content == " <toolbox> ok"
    assert parser.feed("\n\n").content == ""                 # layout if a call follows
    assert parser.finish().content == "\n\n"

    parser = PARSERS["mistral"]()
    assert parser.feed("a [TOOL").content == "a"
    assert parser.feed("S] b").content == " [TOOLS] b"


def test_whole_call_goes_out_the_moment_its_object_closes() -> None:
    parser = PARSERS["hermes"]()
    assert parser.feed('<tool_call>\n{"name": "f", "arguments": {"a": 1}').tool_calls == ()
    assert parser.feed("}").tool_calls == (ToolCallDelta(0, "f", '{"a": 1}'),)
    assert parser.calls == [ToolCall("f", '{"a": 1}')]
    assert parser.feed("\n</tool_call>") == ParsedDelta()


def test_streamed_arguments_go_out_as_they_arrive() -> None:
    parser = PARSERS["hermes"](stream_arguments=True)
    assert parser.feed('<tool_call>\n{"name": "get_wea').tool_calls == ()
    assert parser.feed('ther", "arguments": ').tool_calls == ()
    assert parser.feed('{"city": "Pa').tool_calls == (ToolCallDelta(0, "get_weather", '{"city": "Pa'),)
    assert parser.feed('ris"}').tool_calls == (ToolCallDelta(0, None, 'ris"}'),)
    assert parser.calls == []                      # not complete until the call object closes
    assert parser.feed("}\n</tool_call>\nDone").content == "Done"
    assert parser.calls == [ToolCall("get_weather", '{"city": "Paris"}')]

    named = named_parser("f", stream_arguments=True)
    assert named.feed('{"a"').tool_calls == (ToolCallDelta(0, "f", '{"a"'),)
    assert named.feed(": 1}").tool_calls == (ToolCallDelta(0, None, ": 1}"),)


def test_arguments_before_name_wait_for_the_name_even_when_streaming() -> None:
    parser = PARSERS["hermes"](stream_arguments=True)
    assert parser.feed('<tool_call>{"arguments": {"a": 1}, ').tool_calls == ()
    assert parser.feed('"name": "f"}').tool_calls == (ToolCallDelta(0, "f", '{"a": 1}'),)


def test_nothing_leaks_a_marker_into_content_one_character_at_a_time() -> None:
    for family, text, _ in VALID:
        for stream in (False, True):
            _, deltas = run_stream(factory(family, stream), list(text))
            for delta in deltas:
                for marker in ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>"):
                    assert marker not in delta.content


FRAGMENTS = [
    "Hello", " ", "\n", "{", "}", "[", "]", '"', ",", ":", ";", "\\", '"name"', '"arguments"', '"parameters"',
    '"f"', '{"a": 1}', "{}", "tru", "e", "-1", ".5", "日本", "😀", "<", "/", ">", "<tool_call>", "</tool_call>",
    "<tool_c", "[TOOL_CALLS]", "[TOOL_", "<|python_tag|>", "<|python", GOOD, '"name": "g", ',
    '{"name": "f", "parameters": {"x": [1, {"y": "}"}]}}', '"arguments": {"s": "\\"]}"',
    "[TOOL_CALLS][" + GOOD, "[" + GOOD, ", " + GOOD, "]", "; " + GOOD, "<tool_call>\n" + GOOD + "\n</tool_call>",
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole-calls", "stream-arguments"])
@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral", "required", "named"])
def test_random_texts_split_anywhere(family: str, stream: bool) -> None:
    """Texts made of markup, partial markup, JSON pieces and prose: any split gives the whole's result,
    an answer without calls is its content unchanged, and (by default) every call is valid JSON taken
    verbatim from the answer."""
    make = factory(family, stream, tool="f")
    rng = random.Random(f"{family}-{stream}")
    for _ in range(150):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 14)))
        expected = parse_all(make(), text)
        content, calls = expected
        if not calls:
            assert content == text
        if not stream:
            for got in calls:
                assert isinstance(json.loads(got.arguments), dict) and got.arguments in text
        for _ in range(3):
            assert run_stream(make, random_pieces(text, rng))[0] == expected, text
        assert run_stream(make, list(text))[0] == expected, text


# ------------------------------------------------------------------------------------------------------
# The JSON scanner against Python's json (without NaN/Infinity, which are not JSON).

def _reject_constant(name: str) -> None:
    raise ValueError(name)


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def json_end(text: str) -> int | None:
    """Where json says a JSON object at the start of text ends; None if there is none."""
    if not text.startswith("{"):
        return None
    try:
        value, end = _DECODER.raw_decode(text)
    except ValueError:
        return None
    return end if isinstance(value, dict) else None


def scanner_end(pieces: list[str]) -> int | None:
    scanner = JsonObjectScanner()
    offset = 0
    for piece in pieces:
        end, outcome = scanner.scan(piece, 0)
        if outcome == DONE:
            return offset + end
        if end < len(piece):
            return None
        offset += len(piece)
    return None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**30, 10**30) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(codec="utf-8"), max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12)
SIGNIFICANT = list('{}[]",:\\ \n0123456789-+.eEtrufalsn') + ["\\u", "\x01", "é", "😀"]


@settings(max_examples=60, deadline=None)
@given(value=st.dictionaries(st.text(max_size=6), json_values, max_size=5),
       ascii_only=st.booleans(), indent=st.sampled_from([None, 2]),
       edits=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SIGNIFICANT + [""]), st.booleans()),
                      max_size=3),
       cut=st.integers(0, 10**6), tail=st.sampled_from(["", " x", "}", "\n;"]))
def test_scanner_agrees_with_json(value: dict, ascii_only: bool, indent: int | None,
                                  edits: list[tuple[int, str, bool]], cut: int, tail: str) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only, indent=indent)
    assert scanner_end([text]) == len(text)
    for position, insert, delete in edits:  # mutate: the scanner must still agree with json
        position %= len(text) + 1
        text = text[:position] + insert + text[position + delete:]
    text += tail
    expected = json_end(text)
    assert scanner_end([text]) == expected
    cut %= len(text) + 1
    assert scanner_end([text[:cut], text[cut:]]) == expected


@pytest.mark.parametrize("text", [
    '{"a": 01}', '{"a": 1.}', '{"a": .5}', '{"a": -}', '{"a": 1e}', '{"a": 1e+}', '{"a": tru}', '{"a": True}',
    '{"a": "\\x"}', '{"a": "\\u12G4"}', '{"a": "tab\there"}', "{'a': 1}", '{"a": 1,}', '{"a" 1}', '{a: 1}',
    '{"a": [1,]}', '{"a": Infinity}', '{"a": -0.0e-0, "b": [true, false, null, "\\ud83d\\ude00", {}], "c": []}',
])
def test_scanner_edge_cases(text: str) -> None:
    assert scanner_end([text]) == json_end(text)
    assert all(scanner_end([text[:cut], text[cut:]]) == json_end(text) for cut in range(len(text) + 1))


# ------------------------------------------------------------------------------------------------------
# Linear work: a 200 KB answer fed one character at a time.

BIG, SMALL = 200_000, 20_000
GROWTH = 4  # the same answer at a quarter of the size: linear work takes ~4x as long for the whole, quadratic ~16x


def _big_call(size: int) -> str:
    return '<tool_call>\n{"name": "write_file", "arguments": {"content": "' + "x\\n日{" * (size // 12) + '"}}\n</tool_call>'


ANSWERS: dict[str, tuple[str, bool, Callable[[int], str]]] = {
    # prose, a call whose fragments stream out, then partial markers and a long whitespace run, all held
    # back one character at a time
    "hermes-200k-streamed": ("hermes", True, lambda size: "plain prose. " * (size // 52) + _big_call(size)
                             + "<tool_cal" * (size // 72) + " " * (size // 8) + "."),
    # held whole: a call, then text that may each time still be markup
    "hermes-200k-whole": ("hermes", False, lambda size: _big_call(size) + "\n<tool_cal \t" * (size // 28)),
    # the other formats' states, smaller: quadratic work would show here too
    "mistral": ("mistral", False, lambda size: "[TOOL_CALLS][" + ", ".join([GOOD] * (size // 4 // 10)) + "]"),
    "llama3_json": ("llama3_json", True,
                    lambda size: "; ".join([GOOD.replace("arguments", "parameters")] * (size // 4 // 10))),
    "named": ("named", True, lambda size: '{"rows": [' + ", ".join(['{"k": [1, 2.5, true, null]}'] * (size // 28))
              + "]}"),
}


def _one_character_feeds(make: Factory, text: str) -> tuple[float, tuple[str, list[ToolCall]]]:
    """The best of three timings of feeding `text` one character at a time, and the result. This thread's
    CPU time, not wall time: on a busy machine the time the thread waits for a core is not the parser's."""
    best = float("inf")
    for _ in range(3):
        started = time.thread_time()
        parser = make()
        content = "".join([parser.feed(char).content for char in text]) + parser.finish().content
        best = min(best, time.thread_time() - started)
    return best, (content, parser.calls)


@pytest.mark.parametrize("name", list(ANSWERS))
def test_one_character_at_a_time_is_linear(name: str) -> None:
    """Relative, so that no machine is too slow for it: the whole answer may take at most twice the linear
    GROWTH times its quarter (a parser that re-read what it holds would take GROWTH squared)."""
    family, stream, make_text = ANSWERS[name]
    size = BIG if name.startswith("hermes") else SMALL
    make = factory(family, stream)
    text, quarter = make_text(size), make_text(size // GROWTH)
    whole_s, result = _one_character_feeds(make, text)
    assert result == parse_all(make(), text)
    quarter_s, _ = _one_character_feeds(make, quarter)
    assert whole_s < 2 * GROWTH * quarter_s + 0.01, f"{len(text)} chars: {whole_s:.3f}s, a quarter: {quarter_s:.3f}s"


# ------------------------------------------------------------------------------------------------------
# Recognising the family from a chat template.

QWEN25_TEMPLATE = (
    '{%- if tools %}\n    {{- \'<|im_start|>system\\n\' }}\n    {{- "\\n\\n# Tools\\n\\nYou may call one or more '
    'functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> '
    'XML tags:\\n<tools>" }}\n    {%- for tool in tools %}\n        {{- "\\n" }}\n        {{- tool | tojson }}\n'
    '    {%- endfor %}\n    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and '
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}')
QWEN3_CODER_TEMPLATE = "<tool_call>\n<function={{ tool_call.name }}>\n<parameter=x>\n</parameter>\n</function>\n</tool_call>"
LLAMA32_TEMPLATE = (
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n{{- \'Respond in the format {"name": function name, '
    '"parameters": dictionary of argument name and its value}.\' }}')
LLAMA31_TEMPLATE = LLAMA32_TEMPLATE + '\n{{- "<|python_tag|>" + tool_call.name + ".call(" }}'
MISTRAL_V3_TEMPLATE = '{{- "[AVAILABLE_TOOLS] [" }}...{{- "[TOOL_CALLS] [" }}{{- tool_calls | tojson }}'
MISTRAL_V11_TEMPLATE = '{{- "[TOOL_CALLS]" + tool_call.function.name + "[ARGS]" + arguments }}'
CHATML_TEMPLATE = "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"


@pytest.mark.parametrize("template,family", [
    (QWEN25_TEMPLATE, "hermes"), (QWEN3_CODER_TEMPLATE, None), (LLAMA32_TEMPLATE, "llama3_json"),
    (LLAMA31_TEMPLATE, "llama3_json"), (MISTRAL_V3_TEMPLATE, "mistral"), (MISTRAL_V11_TEMPLATE, None),
    (CHATML_TEMPLATE, None), ("", None), (None, None),
    (demo_checkpoint.CHATML_TEMPLATE, "llama3_json"), (demo_checkpoint.HERMES_TEMPLATE, "hermes"),
])
def test_parser_for_template(template: str | None, family: str | None) -> None:
    assert parser_for_template(template) == family
    if family is not None:
        assert family in PARSERS
