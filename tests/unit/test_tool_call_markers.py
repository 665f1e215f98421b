"""Parsers see their markers: a family whose calls start with a special token (Mistral's `[TOOL_CALLS]`,
Llama 3.1's `<|python_tag|>`) finds it in the text its parser reads, although the detokenizer drops
special tokens (skip_special_tokens). Tiny tokenizers are built here (no download) with the marker as a
special token, and a fake engine emits the marker's id followed by the call's JSON tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import AsyncIterator

import pytest

from frontend.generation.engine import EngineRequest, SamplingOptions, TokenChunk
from frontend.http.renderers import ChatRenderer
from frontend.http.generation_response import GenerationResponse
from frontend.generation.serving import AnswerParsing, ChoiceJob, Generation
from frontend.text.tokenizer import Tokenizer
from frontend.parsing.tool_parsers import PARSERS, ToolCall
from tests.unit.test_serving import Client, FakeEngine

SPACE = "\u2581"


def mistral_like(directory: Path) -> Tokenizer:
    """SentencePiece-style with byte fallback, like Mistral v0.3: one piece per ASCII character, `▁` for
    a space, the Llama-2 decoder chain, and `[INST]`, `[/INST]`, `[TOOL_CALLS]` as special tokens."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), SPACE, *map(chr, range(33, 127))]
    backend = Backend(models.BPE({piece: i for i, piece in enumerate(pieces)}, [], unk_token="<unk>",
                                 byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first")
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]"])
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(directory)
    return Tokenizer(directory)


def llama3_like(directory: Path) -> Tokenizer:
    """Byte-level BPE like Llama 3 (one token per byte), with `<|python_tag|>` and the turn ends special."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Backend(models.BPE({char: i for i, char in enumerate(alphabet)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|begin_of_text|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"])
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>",
                            eos_token="<|eot_id|>").save_pretrained(directory)
    return Tokenizer(directory)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return mistral_like(tmp_path_factory.mktemp("mistral"))


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return llama3_like(tmp_path_factory.mktemp("llama3"))


def special(tokenizer: Tokenizer, token: str) -> int:
    return tokenizer._tok.convert_tokens_to_ids(token)


def emitting(ids: list[int]) -> FakeEngine:
    async def script(request: EngineRequest) -> AsyncIterator[TokenChunk]:
        for token in ids[:request.options.max_tokens]:
            yield TokenChunk([token])
    return FakeEngine(script)


def choice(prompt_ids: list[int]) -> ChoiceJob:
    return ChoiceJob(0, EngineRequest("req-0", prompt_ids, SamplingOptions(max_tokens=1000)))


CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'


def mistral_answer(tok: Tokenizer) -> tuple[list[int], list[int]]:
    """(prompt, answer) as Mistral v0.3 writes a call: text, `[TOOL_CALLS]`, " [" + calls + "]", `</s>`."""
    prompt = [special(tok, "[INST]"), *tok.encode("Weather in Paris?"), special(tok, "[/INST]")]
    answer = [*tok.encode("Checking."), special(tok, "[TOOL_CALLS]"), *tok.encode(f" [{CALL}]"), tok.eos_token_id]
    return prompt, answer


async def test_mistral_auto_tool_call_is_parsed_after_its_special_marker(mistral: Tokenizer) -> None:
    prompt, answer = mistral_answer(mistral)
    generation = Generation(emitting(answer), mistral, [choice(prompt)], [], len(prompt),
                            parsing=AnswerParsing(None, PARSERS["mistral"]))
    result = (await generation.collect())[0]
    assert result.tool_calls == [ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')]
    assert result.finish_reason == "tool_calls"
    assert result.text == " Checking."  # the content before the marker, as the detokenizer writes it


async def test_without_a_marker_parser_the_text_is_unchanged(mistral: Tokenizer) -> None:
    """Plain chat (and completions): special tokens are dropped as before, marker included."""
    prompt, answer = mistral_answer(mistral)
    generation = Generation(emitting(answer), mistral, [choice(prompt)], [], len(prompt))
    result = (await generation.collect())[0]
    assert result.text == mistral.decode(prompt + answer)[len(mistral.decode(prompt)):]
    assert "[TOOL_CALLS]" not in result.text and "</s>" not in result.text and not result.tool_calls
    assert result.text == f" Checking. [{CALL}]"


async def test_streamed_mistral_call_assembles_to_the_non_streamed_one(mistral: Tokenizer) -> None:
    prompt, answer = mistral_answer(mistral)
    client = Client()
    generation = Generation(emitting(answer), mistral, [choice(prompt)], [], len(prompt),
                            parsing=AnswerParsing(None, PARSERS["mistral"]))
    await GenerationResponse(generation, ChatRenderer("m", [0], None, mistral), stream=True, include_usage=False,
                             request_id="r")({}, client.receive, client.send)
    deltas = [json.loads(event)["choices"][0] for event in client.events()[:-1]]
    calls = [call for d in deltas for call in d["delta"].get("tool_calls") or []]
    assert [c["function"]["name"] for c in calls if "id" in c] == ["get_weather"]
    assert json.loads("".join(c["function"].get("arguments", "") for c in calls)) == {"city": "Paris",
                                                                                    "unit": "celsius"}
    assert "".join(d["delta"].get("content") or "" for d in deltas) == " Checking."
    assert deltas[-1]["finish_reason"] == "tool_calls"


async def test_llama31_python_tag_after_text_opens_a_call(llama3: Tokenizer) -> None:
    """Without `<|python_tag|>` in the parser's text, JSON after prose would be content."""
    answer = [*llama3.encode("Let me check. "), special(llama3, "<|python_tag|>"),
              *llama3.encode('{"name": "get_weather", "parameters": {"city": "Paris"}}'), special(llama3, "<|eom_id|>")]
    generation = Generation(emitting(answer), llama3, [choice(llama3.encode("hi"))], [], 2,
                            parsing=AnswerParsing(None, PARSERS["llama3_json"]))
    result = (await generation.collect())[0]
    assert result.tool_calls == [ToolCall("get_weather", '{"city": "Paris"}')]
    assert (result.text, result.finish_reason) == ("Let me check.", "tool_calls")


def test_the_detokenizer_keeps_only_the_markers_asked_for(mistral: Tokenizer) -> None:
    prompt, answer = mistral_answer(mistral)

    def text(markers: tuple[str, ...]) -> str:
        detokenizer = mistral.detokenizer(prompt, markers) if markers else mistral.detokenizer(prompt)
        return "".join(detokenizer.add([token]) for token in answer) + detokenizer.flush()

    assert text(()) == f" Checking. [{CALL}]"
    assert text(("[TOOL_CALLS]",)) == f" Checking.[TOOL_CALLS] [{CALL}]"  # `</s>` still dropped
    assert text(("<tool_call>", "[INST]")) == text(())  # not in the answer, or not a special token here
    assert AnswerParsing(None, PARSERS["mistral"]).markers == ("[TOOL_CALLS]",)
    assert AnswerParsing(None, PARSERS["llama3_json"]).markers == ("<|python_tag|>",)
    assert AnswerParsing(None, PARSERS["hermes"]).markers == ()  # Qwen's `<tool_call>` is no special token
    assert AnswerParsing(None, PARSERS["required"]).markers == () == AnswerParsing().markers
