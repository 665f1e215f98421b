"""Pure wire-format logic of the frontend: incremental detokenization, stop strings, SSE framing."""

from __future__ import annotations

import json
import random
import time

import pytest

from frontend.text.detokenizer import IncrementalDetokenizer
from frontend.http.sse import DONE, sse_data, sse_json
from frontend.generation.stop_strings import StopStringMatcher


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


def test_a_memo_of_single_token_decodes_changes_no_delta() -> None:
    """The memoized single-token decode is only a shortcut: the deltas are those of `decode` alone."""
    rng = random.Random(7)
    text = "emoji 😀👍🏽 mixed 中文 text, plain words and 你好" * 3
    ids = byte_ids(text)
    steps = [rng.choice([1, 1, 1, 2, 3]) for _ in ids]
    memo: dict[int, str] = {}
    plain = IncrementalDetokenizer(byte_decode, prompt_tail=byte_ids("prompt: "))
    memoized = IncrementalDetokenizer(byte_decode, prompt_tail=byte_ids("prompt: "),
                                      decode_one=lambda t: memo.setdefault(t, byte_decode([t])))
    position = 0
    for step in steps:
        if position >= len(ids):
            break
        assert plain.add(ids[position:position + step]) == memoized.add(ids[position:position + step])
        position += step
    assert plain.flush() == memoized.flush()
    assert memo  # the shortcut was taken


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


class ReferenceStopMatcher:
    """The obvious (quadratic) matcher: find over held + text, longest partial suffix by trying every prefix
    of every stop. StopStringMatcher must give exactly its answers."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        buffer = self.held + text
        hits = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buffer[: min(hits)], True
        keep = max((size for stop in self.stops for size in range(1, len(stop))
                    if buffer.endswith(stop[:size])), default=0)
        self.held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


def test_stop_matching_gives_the_same_answers_as_the_obvious_matcher() -> None:
    """Random stops and texts over a two-letter alphabet (many overlaps and partial matches), cut into
    random pieces: every piece's safe text, the stop flag and the flush agree."""
    rng = random.Random(1234)
    for _ in range(3000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(0, 6))) for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 40)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        assert stream_through(StopStringMatcher(stops), pieces) == \
            stream_through(ReferenceStopMatcher(stops), pieces), (stops, pieces)  # type: ignore[arg-type]


class CountingList(list):
    """A failure function that counts its lookups: the matcher's work beyond one step per character."""

    lookups = 0

    def __getitem__(self, index):  # type: ignore[override]
        CountingList.lookups += 1
        return super().__getitem__(index)


def adversarial_text(stop_length: int, size: int) -> str:
    """Long runs of 'a' against the stop 'a'*999 + 'b': every character extends or breaks a partial match
    of up to 999 characters, which the obvious matcher rescans on every delta."""
    unit = "a" * (stop_length - 2) + "xa"
    return (unit * (size // len(unit) + 1))[:size]


def feed_in_pieces(matcher: StopStringMatcher, text: str, piece: int) -> str:
    out = [matcher.feed(text[i:i + piece])[0] for i in range(0, len(text), piece)]
    return "".join(out) + matcher.flush()


@pytest.mark.parametrize("piece", [1, 7, 1000])
def test_stop_matching_work_is_linear_in_the_text(monkeypatch, piece: int) -> None:
    """Counted, not timed: the failure links followed never exceed the characters fed, however long the
    stop string and however the text is cut."""
    stop = "a" * 999 + "b"
    for size in (20_000, 80_000):
        matcher = StopStringMatcher([stop])
        for automaton in matcher._automata:
            automaton.failure = CountingList(automaton.failure)
        CountingList.lookups = 0
        text = adversarial_text(1000, size)
        assert feed_in_pieces(matcher, text, piece) == text
        assert CountingList.lookups <= 2 * size, (size, CountingList.lookups)  # quadratic: ~500 x size


def test_stop_matching_time_grows_linearly_with_the_text() -> None:
    """n and 4n characters of adversarial text against a 1,000-character stop: linear is 4 times the
    time, quadratic 16; the bound is generous, and each size keeps its best of several runs."""
    stop = "a" * 999 + "b"

    def best_time(size: int) -> float:
        text = adversarial_text(1000, size)
        times = []
        for _ in range(5):
            started = time.thread_time()
            feed_in_pieces(StopStringMatcher([stop]), text, 3)
            times.append(time.thread_time() - started)
        return min(times)

    small, large = best_time(10_000), best_time(40_000)
    assert large / small < 9, (small, large)


def test_sse_frames_are_data_lines_separated_by_a_blank_line() -> None:
    frame = sse_json({"a": "línea\nnueva", "b": None})
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n") and frame.count(b"\n") == 2
    assert json.loads(frame[len(b"data: "):]) == {"a": "línea\nnueva", "b": None}
    assert DONE == b"data: [DONE]\n\n"
    with pytest.raises(ValueError):
        sse_data("two\nlines")


TRICKY_TEXTS = ["plain", " word", '"quoted" \\ back\\slash', "new\nline\r\ttab", "\x00\x01\x1f\x7f", "中文😀👍🏽",
                "\u2028\u2029", "</script>", "{\"json\": [1]}", "é" * 50, "text-marker"]


@pytest.mark.parametrize("renderer_kind", ["chat", "completion"])
def test_text_frames_are_byte_for_byte_the_full_models(renderer_kind: str) -> None:
    """The per-token fast path (a template rendered once per choice) must send exactly what building and
    serialising the chunk model sends, whatever the text holds."""
    from frontend.generation.serving import TextDelta
    from frontend.http.renderers import ChatRenderer, CompletionRenderer
    from frontend.api_types.reply_bodies import ChatChunkChoice, ChatDelta, CompletionChoice

    rng = random.Random(0)
    texts = TRICKY_TEXTS + ["".join(chr(rng.choice([rng.randrange(0x20, 0x7f), rng.randrange(0, 0x20),
                                                     rng.randrange(0xa0, 0xd7ff), rng.randrange(0x10000, 0x10ffff)]))
                                    for _ in range(rng.randrange(1, 8))) for _ in range(300)]
    for index in (0, 3):
        renderer = ChatRenderer('model "x"', [index], None, None) if renderer_kind == "chat" else \
            CompletionRenderer('model "x"', None, None, {})
        for text in texts:
            fast = renderer.stream_delta(index, TextDelta(text))
            if renderer_kind == "chat":
                full = renderer._chunk([ChatChunkChoice(index=index, delta=ChatDelta(content=text))])
            else:
                full = renderer._chunk([CompletionChoice(index=index, text=text)])
            assert fast == [full], text
            json.loads(fast[0][len(b"data: "):])
