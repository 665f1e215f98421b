"""Pure wire-format logic of the frontend: incremental detokenization, stop strings, SSE framing."""

from __future__ import annotations

import json

import pytest

from frontend.detokenizer import IncrementalDetokenizer
from frontend.sse import DONE, sse_data, sse_json
from frontend.stop_strings import StopStringMatcher


def byte_decode(ids: list[int]) -> str:
    """A byte-level 'tokenizer': one token per UTF-8 byte, like byte-fallback tokenizers at worst."""
    return bytes(ids).decode("utf-8", errors="replace")


def byte_ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


@pytest.mark.parametrize("text", ["Hello world", "你好，世界", "emoji 😀👍🏽 mixed 中文 text", "a\nb\tc  d"])
@pytest.mark.parametrize("step", [1, 2, 5])
def test_streamed_deltas_join_to_the_full_text_and_never_split_characters(text: str, step: int) -> None:
    ids = byte_ids(text)
    detok = IncrementalDetokenizer(byte_decode, prompt_tail=byte_ids("prompt: "))
    deltas = [detok.add(ids[i:i + step]) for i in range(0, len(ids), step)] + [detok.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_incomplete_character_is_held_back_until_complete() -> None:
    detok = IncrementalDetokenizer(byte_decode)
    smile = byte_ids("😀")
    assert detok.add(smile[:2]) == ""
    assert detok.add(smile[2:3]) == ""
    assert detok.add(smile[3:]) == "😀"


def test_flush_releases_a_truncated_character_as_replacement() -> None:
    detok = IncrementalDetokenizer(byte_decode)
    assert detok.add(byte_ids("ok") + byte_ids("世")[:2]) == ""
    assert detok.flush() == "ok\ufffd"


def stream_through(matcher: StopStringMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    out = []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            return out, True
    out.append(matcher.flush())
    return out, False


def test_stop_string_split_across_pieces_never_leaks() -> None:
    matcher = StopStringMatcher(["STOP"])
    out, stopped = stream_through(matcher, ["abc S", "T", "O", "P and more"])
    assert stopped and "".join(out) == "abc "
    assert not any(c in "".join(out) for c in "STOP")


def test_partial_match_that_turns_out_not_to_be_a_stop_is_released() -> None:
    matcher = StopStringMatcher(["STOP"])
    out, stopped = stream_through(matcher, ["x ST", "ART", " end ST"])
    assert not stopped and "".join(out) == "x START end ST"
    assert out[0] == "x " and out[1] == "START"


def test_earliest_of_several_stop_strings_wins() -> None:
    matcher = StopStringMatcher(["world", "lo w"])
    out, stopped = stream_through(matcher, ["hello world"])
    assert stopped and "".join(out) == "hel"


def test_no_stop_strings_passes_text_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == ("anything", False)


def test_sse_frames_are_data_lines_separated_by_a_blank_line() -> None:
    frame = sse_json({"a": "línea\nnueva", "b": None})
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n") and frame.count(b"\n") == 2
    assert json.loads(frame[len(b"data: "):]) == {"a": "línea\nnueva", "b": None}
    assert DONE == b"data: [DONE]\n\n"
    with pytest.raises(ValueError):
        sse_data("two\nlines")
