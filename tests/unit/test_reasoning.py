"""The `<think>` reasoning parser: recorded answers split at every point and at random give exactly what
the whole answer gives; partial tags are held only while they may be tags; templates that open `<think>`
in the prompt; chained into a tool-call parser; linear in one-character feeds."""

from __future__ import annotations

import random
import time

import pytest

from frontend.parsing.reasoning import REASONING_PARSERS, ReasoningParser, prompt_opens_reasoning
from frontend.parsing.tool_parsers import PARSERS, ToolCall, ToolCallParser


def run(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    parts = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


def check_every_split(starts_in_reasoning: bool, text: str, expected: tuple[str, str]) -> None:
    def make() -> ReasoningParser:
        return REASONING_PARSERS["think"](starts_in_reasoning=starts_in_reasoning)

    assert run(make(), [text]) == expected
    for cut in range(len(text) + 1):
        assert run(make(), [text[:cut], text[cut:]]) == expected, f"split at {cut}: {text[:cut]!r}"
    rng = random.Random(len(text))
    for _ in range(25 if len(text) > 1 else 0):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 10))))
        bounds = [0, *cuts, len(text)]
        assert run(make(), [text[a:b] for a, b in zip(bounds, bounds[1:])]) == expected
    assert run(make(), list(text)) == expected


CASES = [
    # DeepSeek-R1 style: the model opens <think> itself
    (False, "<think>\nThe user wants 17 × 23. 17 × 20 = 340, 17 × 3 = 51.\n</think>\n\n17 × 23 = 391.",
     ("The user wants 17 × 23. 17 × 20 = 340, 17 × 3 = 51.", "17 × 23 = 391.")),
    # Qwen3-2507 thinking / QwQ style: the prompt opened <think>, only </think> is generated
    (True, "Okay, the user asks for the weather in 東京. I should call the tool.\n</think>\n\n"
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call>',
     ("Okay, the user asks for the weather in 東京. I should call the tool.",
      '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call>')),
    (True, "<think>\nhmm 🤔\n</think>\nok", ("hmm 🤔", "ok")),                 # a repeated <think> is dropped
    (True, "</think>Hi", ("", "Hi")),
    (False, "<think>\n\n</think>\n\nHello!", ("", "Hello!")),                 # thinking switched off
    (False, "  Hello <think> is only a tag at the start.", ("", "  Hello <think> is only a tag at the start.")),
    (False, "<thinking>not the tag</thinking>", ("", "<thinking>not the tag</thinking>")),
    (False, "<think>a </thin k> b <<//think> c</think>d</think>", ("a </thin k> b <<//think> c", "d</think>")),
    (False, "<think>\nlong thought, cut off by the token limit\n", ("long thought, cut off by the token limit", "")),
    (False, "<think>abc</thi", ("abc</thi", "")),
    (False, "<thi", ("", "<thi")),
    (False, "\n\n<thi", ("", "\n\n<thi")),
    (True, "<thi", ("<thi", "")),
    (True, "</thi", ("</thi", "")),
    (False, "", ("", "")),
    (True, "", ("", "")),
]


@pytest.mark.parametrize("starts_in_reasoning,text,expected", CASES, ids=[str(i) for i in range(len(CASES))])
def test_recorded_answers_split_anywhere(starts_in_reasoning: bool, text: str, expected: tuple[str, str]) -> None:
    check_every_split(starts_in_reasoning, text, expected)


FRAGMENTS = ["<think>", "</think>", "<thi", "</thi", "nk>", "<", "/", ">", " ", "\n", "\n\n", "plan", "é", "😀"]


@pytest.mark.parametrize("starts_in_reasoning", [False, True])
def test_random_texts_split_anywhere(starts_in_reasoning: bool) -> None:
    rng = random.Random(f"think-{starts_in_reasoning}")
    for _ in range(400):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 12)))
        expected = run(ReasoningParser(starts_in_reasoning), [text])
        if not starts_in_reasoning and not text.lstrip(" \n").startswith("<think>"):
            assert expected == ("", text)   # no reasoning: the answer is content, untouched
        for cut in range(len(text) + 1):
            assert run(ReasoningParser(starts_in_reasoning), [text[:cut], text[cut:]]) == expected, (text, cut)
        assert run(ReasoningParser(starts_in_reasoning), list(text)) == expected, text


def test_text_is_held_only_while_it_may_be_a_tag() -> None:
    parser = ReasoningParser()
    assert parser.feed("<thi") == ("", "")
    assert parser.feed("nk>\nStep one") == ("Step one", "")
    assert parser.feed(". </th") == (".", "")     # " </th" may be the closing tag (and its layout)
    assert parser.feed("eory>") == (" </theory>", "")
    assert parser.feed("</think>\n") == ("", "")
    assert parser.feed("\nAnswer") == ("", "Answer")

    parser = ReasoningParser()
    assert parser.feed("Hi") == ("", "Hi")           # no <think> at the start: content from the first letter


def test_prompt_opens_reasoning() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


def test_chained_into_a_tool_parser_split_anywhere() -> None:
    """The lead's chain: reasoning first, its content into the tool-call parser."""
    text = ("The user wants both cities.\n</think>\n\nChecking both.\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>')
    expected = ("The user wants both cities.", "Checking both.",
                [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("get_weather", '{"city": "Zürich"}')])

    def chain(pieces: list[str]) -> tuple[str, str, list[ToolCall]]:
        thinking = ReasoningParser(starts_in_reasoning=True)
        tools: ToolCallParser = PARSERS["hermes"]()
        reasoning, content = [], []
        for piece in pieces:
            r, c = thinking.feed(piece)
            reasoning.append(r)
            content.append(tools.feed(c).content)
        r, c = thinking.finish()
        reasoning.append(r)
        content.append(tools.feed(c).content + tools.finish().content)
        return "".join(reasoning), "".join(content), tools.calls

    for cut in range(len(text) + 1):
        assert chain([text[:cut], text[cut:]]) == expected
    assert chain(list(text)) == expected


def _answer(size: int) -> str:
    return ("<think>" + "why? " * (size // 10) + ("</thin" + " " * (size // 40)) * 10 + "</think>"
            + "answer " * (size // 14))


def _one_character_feeds(text: str) -> tuple[float, object]:
    """The best of three timings of feeding `text` one character at a time, and the result."""
    best = float("inf")
    for _ in range(3):
        started = time.thread_time()
        got = run(ReasoningParser(), list(text))
        best = min(best, time.thread_time() - started)
    return best, got


def test_one_character_at_a_time_is_linear() -> None:
    """Relative, so that no machine is too slow for it: 4x the text may take at most 8x the time (re-reading
    what is held would take 16x)."""
    text = _answer(200_000)
    whole_s, got = _one_character_feeds(text)
    assert got == run(ReasoningParser(), [text]) and len(text) > 200_000
    quarter_s, _ = _one_character_feeds(_answer(50_000))
    assert whole_s < 8 * quarter_s + 0.01, f"{len(text)} chars: {whole_s:.3f}s, a quarter: {quarter_s:.3f}s"