"""Reasoning out of a thinking model's streamed answer: `<think>...</think>` text for `reasoning_content`,
the rest for `content` (which then goes to the tool-call parser).

Two kinds of chat template: those after which the model opens `<think>` itself (DeepSeek-R1's distills,
Qwen3 before 2507), and those that end the prompt with `<think>` so the answer starts inside the
reasoning and only `</think>` is generated (Qwen3-2507 thinking, QwQ): `starts_in_reasoning=True`, which
`prompt_opens_reasoning(prompt)` tells from the rendered prompt. In that case a `<think>` the model
writes anyway is dropped too.

Like the tool parsers: the same characters give the same result however they are split, held-back text
is only what may still be a tag (released as soon as it is not), and each feed costs its own length plus
what was held. The whitespace the templates put around the tags (`<think>\\n...\\n</think>\\n\\n`) is
layout, dropped as the Qwen3 template does when it renders the history; an answer that never closes its
reasoning (the token limit) is all reasoning.
"""

from __future__ import annotations

import re
from typing import Callable

from frontend.parsing.tool_parsers import held_prefix_length

_SPACE = " \t\n\r"
_SPACE_RUN = re.compile(r"[ \t\n\r]+")


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt leaves a `<think>` open, so the answer starts inside the reasoning."""
    return prompt.rstrip(_SPACE).endswith(ReasoningParser.START)


class _TrimmedText:
    """Accumulates one side's text of a feed, dropping whitespace at its start (after a tag) and holding
    whitespace at its end (it may be followed by a tag, or by the end of the reasoning)."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.held_space: list[str] = []
        self.skip_space = False

    def add(self, text: str) -> None:
        if self.skip_space:
            text = text.lstrip(_SPACE)
            if not text:
                return
            self.skip_space = False
        kept = len(text.rstrip(_SPACE))
        if not kept:
            if text:
                self.held_space.append(text)
            return
        if self.held_space:
            self.pieces.extend(self.held_space)
            self.held_space.clear()
        self.pieces.append(text[:kept])
        if kept < len(text):
            self.held_space.append(text[kept:])

    def take(self) -> str:
        text = "".join(self.pieces)
        self.pieces.clear()
        return text


class ReasoningParser:
    START, END = "<think>", "</think>"

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self._starts_in_reasoning = starts_in_reasoning
        self._reasoning = _TrimmedText()
        self._reasoning.skip_space = True
        self._content: list[str] = []
        self._skip_content_space = False
        self._lead: list[str] = []   # whitespace before a possible opening tag
        self._held = ""              # the start of a tag, held until the text shows whether it is one
        self._state: Callable[[str, int], int] = self._opening

    def feed(self, text: str) -> tuple[str, str]:
        """Returns (reasoning, content) that this text makes certain."""
        self._run(text)
        return self._take()

    def finish(self) -> tuple[str, str]:
        """The answer ended: a partial tag is text after all; an unclosed reasoning ends here."""
        if self._state == self._opening:
            if self._starts_in_reasoning:
                self._reasoning.add(self._held)
            else:
                self._content.append("".join(self._lead) + self._held)
        elif self._state == self._in_reasoning:
            self._reasoning.add(self._held)
        self._lead, self._held = [], ""
        self._reasoning.held_space.clear()  # reasoning's trailing whitespace is layout
        self._state = self._in_content
        return self._take()

    def _take(self) -> tuple[str, str]:
        content = "".join(self._content)
        self._content.clear()
        return self._reasoning.take(), content

    def _run(self, text: str) -> None:
        i, n = 0, len(text)
        while i < n:
            i = self._state(text, i)

    def _opening(self, text: str, i: int) -> int:
        """At the start of the answer: whitespace, then maybe `<think>`."""
        if not self._held:
            run = _SPACE_RUN.match(text, i)
            if run is not None:
                self._lead.append(run.group())
                return run.end()
        want = self.START[len(self._held):]
        got = text[i:i + len(want)]
        if want.startswith(got):
            if len(got) < len(want):
                self._held += got
            else:
                self._lead, self._held = [], ""
                self._state = self._in_reasoning
            return i + len(got)
        held, self._held = self._held, ""
        if self._starts_in_reasoning:
            self._lead = []
            self._state = self._in_reasoning
        else:
            self._content.append("".join(self._lead))
            self._lead = []
            self._state = self._in_content
        if held:  # not the opening tag: read it again in the new state (it may start `</think>`)
            self._run(held)
        return i

    def _in_reasoning(self, text: str, i: int) -> int:
        held_before = self._held
        buffer = held_before + text[i:] if held_before else text[i:]
        at = buffer.find(self.END)
        if at < 0:
            keep = held_prefix_length(buffer, self.END)
            self._held = buffer[len(buffer) - keep:] if keep else ""
            self._reasoning.add(buffer[:len(buffer) - keep])
            return len(text)
        self._held = ""
        self._reasoning.add(buffer[:at])
        self._reasoning.held_space.clear()
        self._skip_content_space = True
        self._state = self._in_content
        return i + at + len(self.END) - len(held_before)

    def _in_content(self, text: str, i: int) -> int:
        if self._skip_content_space:
            run = _SPACE_RUN.match(text, i)
            if run is not None:
                i = run.end()
                if i == len(text):
                    return i
            self._skip_content_space = False
        self._content.append(text[i:])
        return len(text)


REASONING_PARSERS: dict[str, Callable[..., ReasoningParser]] = {"think": ReasoningParser}
