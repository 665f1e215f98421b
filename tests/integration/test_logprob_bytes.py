"""Chat logprob bytes join to the exact UTF-8 of CJK + emoji output, on the real stack (tritonserver, the
frontend, the official `openai` client), for the demo byte-level tokenizer and for a SentencePiece
byte-fallback tokenizer.

The output is controlled by the scripted model (tests/integration/scripted_model.py): a copy of the tiny
demo model whose greedy decoding spells "中文😀" (demo tokenizer: one token per UTF-8 byte) or " 你好🚀👍"
(SentencePiece: `▁你好`, four byte-fallback tokens for 🚀, one `👍` piece). Several of those tokens hold
part of a character; OpenAI's contract is that `bytes` are the token's own bytes, so that the entries'
bytes joined are the text's UTF-8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import openai
import pytest

from launcher.ports import find_free_port
from tests.integration.conftest import Stack, start_frontend, stop_process, wait_http_ok
from tests.integration.scripted_model import ScriptedChain, ScriptedModel

pytestmark = pytest.mark.integration

REPLACEMENT_BYTES = "\ufffd".encode("utf-8")
MAX_TOKENS = 32  # far more than a chain: a broken script ends on "length", not on a hang


@dataclass(frozen=True)
class ScriptedStack:
    model: ScriptedModel
    clients: dict[str, openai.OpenAI]  # per chain ("demo", "sentencepiece"): a frontend with its tokenizer

    def chain(self, name: str) -> ScriptedChain:
        return getattr(self.model, name)


@pytest.fixture(scope="module")
def scripted_stack(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptedStack]:
    """Two frontends on the session Triton's scripted model: one with the repository's (demo) tokenizer,
    one with the SentencePiece tokenizer."""
    logs = tmp_path_factory.mktemp("scripted_logs")
    scripted = stack.scripted
    frontends = []
    try:
        clients = {}
        for name, env in (("demo", {}), ("sentencepiece", {"TOKENIZER_DIR": str(scripted.sentencepiece_dir)})):
            port = find_free_port()
            frontend = start_frontend(stack.triton_grpc_url, port, logs / f"frontend-{name}.log",
                                      ENGINE_MODEL=scripted.model_name, **env)
            frontends.append(frontend)
            wait_http_ok(f"http://127.0.0.1:{port}/health/ready", 120, frontend)
            clients[name] = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                                          max_retries=0, timeout=120)
        yield ScriptedStack(scripted, clients)
    finally:
        for frontend in frontends:
            stop_process(frontend)


CHAINS = ["demo", "sentencepiece"]
EXPECTED_TEXTS = {"demo": "中文😀", "sentencepiece": " 你好🚀👍"}  # the SentencePiece `▁你好` mid-text: " 你好"


@pytest.mark.parametrize("name", CHAINS)
def test_the_scripted_text_splits_characters(scripted_stack: ScriptedStack, name: str) -> None:
    """The premise: some tokens hold part of a character, so on their own they decode to U+FFFD (the
    case where bytes taken from the token's text were wrong); without such tokens this file proves nothing."""
    from transformers import AutoTokenizer

    chain = scripted_stack.chain(name)
    assert chain.text == EXPECTED_TEXTS[name]
    tokenizer = AutoTokenizer.from_pretrained(str(chain.tokenizer_dir))
    assert any(tokenizer.decode([t]) == "\ufffd" for t in chain.token_ids)


def test_the_demo_chain_ends_at_the_second_end_id(scripted_stack: ScriptedStack) -> None:
    """The demo chain's answer ends with `<|end_of_text|>`, the second id of generation_config.json's
    `eos_token_id` (not the tokenizer's eos): the answer must end there, `stop`, without the id in its text
    or usage (the other tests here check the text and the counts), streamed or not."""
    import json

    from transformers import AutoTokenizer

    chain = scripted_stack.chain("demo")
    tokenizer = AutoTokenizer.from_pretrained(str(chain.tokenizer_dir))
    end_ids = json.loads((scripted_stack.model.checkpoint_dir / "generation_config.json").read_text())["eos_token_id"]
    assert chain.end_id == end_ids[1] != tokenizer.eos_token_id
    client = scripted_stack.clients["demo"]
    for stream in (False, True):
        reply = client.completions.create(model=scripted_stack.model.served_model_name, prompt=chain.prompt_ids,
                                          temperature=0, max_tokens=MAX_TOKENS, stream=stream)
        choices = [c for chunk in reply for c in chunk.choices] if stream else reply.choices
        assert "".join(c.text for c in choices) == chain.text
        assert [c.finish_reason for c in choices if c.finish_reason] == ["stop"]


@pytest.mark.parametrize("name", CHAINS)
def test_chat_logprob_bytes_join_to_the_text(scripted_stack: ScriptedStack, name: str) -> None:
    chain = scripted_stack.chain(name)
    reply = scripted_stack.clients[name].chat.completions.create(
        model=scripted_stack.model.served_model_name, messages=chain.chat_messages, temperature=0,
        max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=2)
    choice = reply.choices[0]
    text = choice.message.content
    assert (text, choice.finish_reason) == (chain.text, "stop")
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens == len(chain.token_ids)
    assert b"".join(bytes(entry.bytes) for entry in content) == text.encode("utf-8")
    assert all(REPLACEMENT_BYTES not in bytes(entry.bytes) for entry in content)
    for entry in content:
        # Greedy: the most likely alternative is the token itself, with the same bytes.
        top = entry.top_logprobs[0]
        assert (top.token, top.bytes, top.logprob) == (entry.token, entry.bytes, entry.logprob)
        assert len(entry.top_logprobs) == 2


@pytest.mark.parametrize("name", CHAINS)
def test_streamed_chat_logprob_bytes_join_to_the_text(scripted_stack: ScriptedStack, name: str) -> None:
    """Streaming holds text back until a character is complete; the bytes of the tokens still add up."""
    chain = scripted_stack.chain(name)
    stream = scripted_stack.clients[name].chat.completions.create(
        model=scripted_stack.model.served_model_name, messages=chain.chat_messages, temperature=0,
        max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=2, stream=True,
        stream_options={"include_usage": True})
    text, entries, usage = "", [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs is not None and choice.logprobs.content:
                entries += choice.logprobs.content
    assert text == chain.text
    assert usage is not None and len(entries) == usage.completion_tokens == len(chain.token_ids)
    assert b"".join(bytes(entry.bytes) for entry in entries) == text.encode("utf-8")


@pytest.mark.parametrize("name", CHAINS)
def test_completion_from_prompt_ids_gives_the_text_and_one_entry_per_token(
        scripted_stack: ScriptedStack, name: str) -> None:
    """Legacy completions have no `bytes`; this checks the same scripted output through /v1/completions
    with the prompt as token ids, and one logprobs entry per completion token."""
    chain = scripted_stack.chain(name)
    reply = scripted_stack.clients[name].completions.create(
        model=scripted_stack.model.served_model_name, prompt=chain.prompt_ids, temperature=0,
        max_tokens=MAX_TOKENS, logprobs=1)
    choice = reply.choices[0]
    assert (choice.text, choice.finish_reason) == (chain.text, "stop")
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == reply.usage.completion_tokens
    assert reply.usage.completion_tokens == len(chain.token_ids)
    assert [next(iter(top)) for top in logprobs.top_logprobs] == logprobs.tokens
