"""A copy of the tiny demo model whose greedy output is scripted: CJK + emoji text chosen by the tests.

The demo weights are random, so the demo model's output is arbitrary; a test about how split UTF-8
characters are reported needs a model that is known to produce them. This module rewrites the tiny
demo checkpoint so that greedy decoding follows a fixed successor chain, token by token:

* every layer's `o_proj` and `down_proj` are zero, so attention and MLP add nothing and the residual
  stream at every position is the current token's embedding;
* each token x that has a scripted successor gets an embedding u_x from one orthonormal set;
* the (untied) `lm_head` row of succ(x) is SCALE * u_x, all other rows zero; after the final RMSNorm
  the hidden state is sqrt(hidden) * u_x (norm weight one), so the logit of succ(x) is
  SCALE * sqrt(hidden) (about 23) and every other logit is exactly 0.

Greedy decoding therefore generates succ(x) after x whatever came before, i.e. it walks the chain from
its start token to its end token, where generation stops: for the demo chain the second end id of
`generation_config.json` (`<|end_of_text|>`, not the tokenizer's eos: every end id must end an answer),
for the SentencePiece chain the tokenizer's eos id. Two chains live
in one model, one per tokenizer (the demo byte-level BPE, and a SentencePiece byte-fallback tokenizer
of the same 4096-entry vocabulary size, tests/sentencepiece_tokenizer.py); their ids must not overlap
(asserted), since succ is a function of the token alone. Each chain starts at the last token of that
tokenizer's chat prompt, so the same chain answers /v1/chat/completions and /v1/completions.

`add_scripted_model` builds it all, checks with plain transformers that greedy generation follows the
chains, builds a CPU engine with `python -m build_engine --model`, and adds a Triton model
`tensorrt_llm_scripted` to an already rendered model repository, before tritonserver starts.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.servers import repository_parameter
from tests.sentencepiece_tokenizer import build_sentencepiece_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTED_MODEL = "tensorrt_llm_scripted"
SERVED_MODEL_NAME = "scripted-tiny"
ENGINE_MODEL = "tensorrt_llm"  # the rendered model the scripted one is copied from
SCALE = 2.0
# The texts: each has a character split across tokens (the demo tokenizer spells these CJK characters
# and emoji byte by byte; 🚀 is in no SentencePiece training text, so it is four byte-fallback tokens)
# and, for SentencePiece, a whole-word piece with its `▁` (`▁你好`) and a whole-emoji piece (👍).
DEMO_TEXT = "中文😀"
SENTENCEPIECE_TEXT = "你好🚀👍"
CHAT_MESSAGES = [{"role": "user", "content": "Say something in Chinese, with emoji."}]


@dataclass(frozen=True)
class ScriptedChain:
    """One scripted answer: what to send and what must come back."""

    tokenizer_dir: Path  # the frontend's TOKENIZER_DIR for this chain
    chat_messages: list[dict[str, str]]  # a chat request whose prompt ends with the chain's start token
    prompt_ids: list[int]  # a completion prompt (the same prompt, as token ids) ending with the start token
    token_ids: list[int]  # the generated tokens (the end token, which is not emitted, excluded)
    text: str  # the response text: the tokens decoded after the prompt
    end_id: int  # where generation stops: an end id that is not emitted


@dataclass(frozen=True)
class ScriptedModel:
    model_name: str  # the Triton model (the frontend's ENGINE_MODEL)
    served_model_name: str
    checkpoint_dir: Path
    engine_dir: Path
    sentencepiece_dir: Path  # TOKENIZER_DIR of a frontend that serves the SentencePiece chain
    demo: ScriptedChain  # served with the demo tokenizer (the model repository's own)
    sentencepiece: ScriptedChain


def add_scripted_model(model_repository: Path, work_dir: Path) -> ScriptedModel:
    """Build the scripted model under `work_dir` and add it to `model_repository` as `tensorrt_llm_scripted`.

    `model_repository` is a rendered repository (`python -m build_engine ... --output-dir X` gives
    X/model_repository) whose `tensorrt_llm` model is a CPU engine of the tiny demo checkpoint; call this
    before tritonserver starts. Takes about 10 s (tokenizer training, a transformers check, the build).
    """
    model_repository, work_dir = Path(model_repository), Path(work_dir)
    if (model_repository / SCRIPTED_MODEL).exists():
        raise FileExistsError(f"{model_repository / SCRIPTED_MODEL} already exists")
    work_dir.mkdir(parents=True, exist_ok=True)
    engine_config = _engine_config(model_repository)
    demo_dir = Path(engine_config["checkpoint_dir"])
    sentencepiece_dir = work_dir / "sentencepiece"
    vocab_size = json.loads((demo_dir / "config.json").read_text())["vocab_size"]
    build_sentencepiece_tokenizer(sentencepiece_dir, vocab_size=vocab_size)
    end_ids = json.loads((demo_dir / "generation_config.json").read_text())["eos_token_id"]
    demo = _chain(demo_dir, DEMO_TEXT, end_id=end_ids[1])  # the demo lists [eos, <|end_of_text|>]
    sentencepiece = _chain(sentencepiece_dir, SENTENCEPIECE_TEXT)
    checkpoint_dir = work_dir / SERVED_MODEL_NAME  # build_engine serves a checkpoint under its folder name
    write_scripted_checkpoint(demo_dir, checkpoint_dir, [demo, sentencepiece])
    verify_with_transformers(checkpoint_dir, [demo, sentencepiece])
    build_dir = work_dir / "build"
    subprocess.run([sys.executable, "-m", "build_engine", "--model", str(checkpoint_dir), "--output-dir",
                    str(build_dir), "--max-batch-size", str(engine_config["max_batch_size"]),
                    "--max-seq-len", str(engine_config["max_seq_len"])],
                   check=True, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    engine_dir = (build_dir / "engine").resolve()
    _add_model_directory(model_repository, engine_dir)
    return ScriptedModel(SCRIPTED_MODEL, SERVED_MODEL_NAME, checkpoint_dir, engine_dir, sentencepiece_dir,
                         demo, sentencepiece)


def _engine_config(model_repository: Path) -> dict[str, Any]:
    """The engine_config.json of the repository's engine model (it names the demo checkpoint)."""
    engine_dir = repository_parameter(model_repository, ENGINE_MODEL, "gpt_model_path")
    if not engine_dir:
        raise ValueError(f"{model_repository}/{ENGINE_MODEL}/config.pbtxt names no gpt_model_path")
    config = json.loads((Path(engine_dir) / "engine_config.json").read_text())
    if config.get("backend") != "cpu":
        raise ValueError(f"the scripted model needs a CPU engine build, not {config.get('backend')!r}")
    return config


def _chain(tokenizer_dir: Path, text: str, end_id: int | None = None) -> ScriptedChain:
    """The chain for `text` under one tokenizer, starting at its chat prompt's last token and ending at
    `end_id` (by default the tokenizer's eos)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    prompt_ids = [int(t) for t in tokenizer.apply_chat_template(
        CHAT_MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)]
    token_ids = list(tokenizer.encode(text, add_special_tokens=False))

    def decode(ids: list[int]) -> str:  # as the frontend decodes (frontend.text.tokenizer.Tokenizer.decode)
        return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    # The frontend decodes generated tokens after the prompt: what they add is the response text
    # (with SentencePiece, the `▁` of the first piece is a space there).
    prefix = decode(prompt_ids)
    full = decode(prompt_ids + token_ids)
    assert full.startswith(prefix), (prefix, full)
    return ScriptedChain(tokenizer_dir, CHAT_MESSAGES, prompt_ids, token_ids, full[len(prefix):],
                         tokenizer.eos_token_id if end_id is None else end_id)


def successors(chains: list[ScriptedChain]) -> dict[int, int]:
    """token -> the token greedy decoding must produce after it, over all chains (checked consistent)."""
    succ: dict[int, int] = {}
    for chain in chains:
        walk = [chain.prompt_ids[-1], *chain.token_ids]
        assert len(set(walk)) == len(walk), f"chain {walk} repeats a token, so it would loop"
        for current, following in zip(walk, [*walk[1:], chain.end_id]):
            assert current not in succ, f"token {current} is in two chains; pick other texts or start tokens"
            succ[current] = following
    ends = {chain.end_id for chain in chains}
    assert not ends & succ.keys(), "an end token must not be inside a chain"
    return succ


def write_scripted_checkpoint(source_dir: Path, target_dir: Path, chains: list[ScriptedChain]) -> None:
    """A copy of the demo checkpoint at `source_dir` whose greedy decoding follows `chains`."""
    import torch
    from safetensors.torch import load_file, save_file

    succ = successors(chains)
    config = json.loads((source_dir / "config.json").read_text())
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    assert len(succ) <= hidden, "more scripted tokens than orthonormal directions"
    assert all(0 <= t < vocab for pair in succ.items() for t in pair), "a chain id outside the vocabulary"
    shutil.copytree(source_dir, target_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.bin",
                                                                          "demo_checkpoint_stamp.json"))
    weights = {name: tensor.clone() for name, tensor in load_file(str(source_dir / "model.safetensors")).items()}
    for name in weights:
        if name.endswith("self_attn.o_proj.weight") or name.endswith("mlp.down_proj.weight"):
            weights[name].zero_()
    weights["model.norm.weight"].fill_(1.0)
    generator = torch.Generator().manual_seed(0)
    basis, _ = torch.linalg.qr(torch.randn(hidden, len(succ), generator=generator, dtype=torch.float64))
    embed = weights["model.embed_tokens.weight"]
    lm_head = torch.zeros(vocab, hidden, dtype=embed.dtype)
    for column, (token, following) in enumerate(sorted(succ.items())):
        direction = basis[:, column].to(embed.dtype)
        embed[token] = direction
        lm_head[following] += SCALE * direction  # an end token may follow several chains: rows add up
    weights["lm_head.weight"] = lm_head
    config["tie_word_embeddings"] = False  # the demo's are untied already; the rewrite relies on it
    (target_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(weights, str(target_dir / "model.safetensors"), metadata={"format": "pt"})


def verify_with_transformers(checkpoint_dir: Path, chains: list[ScriptedChain]) -> None:
    """Greedy `generate` of plain transformers must produce each chain exactly, then its end token."""
    import torch
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a one-shard "Loading weights" bar is noise in test output
    model = LlamaForCausalLM.from_pretrained(str(checkpoint_dir), dtype=torch.float32).eval()
    for chain in chains:
        with torch.inference_mode():
            output = model.generate(torch.tensor([chain.prompt_ids]), do_sample=False,
                                    max_new_tokens=len(chain.token_ids) + 4, eos_token_id=chain.end_id,
                                    pad_token_id=chain.end_id)
        generated = output[0, len(chain.prompt_ids):].tolist()
        assert generated == [*chain.token_ids, chain.end_id], (
            f"scripted checkpoint generated {generated}, expected {chain.token_ids} then {chain.end_id}")


def _add_model_directory(model_repository: Path, engine_dir: Path) -> None:
    """Copy the repository's engine model as SCRIPTED_MODEL, pointed at the scripted engine."""
    target = model_repository / SCRIPTED_MODEL
    shutil.copytree(model_repository / ENGINE_MODEL, target)
    config_path = target / "config.pbtxt"
    text = config_path.read_text()
    text = _replace_once(r'^name:\s*"[^"]*"', f'name: "{SCRIPTED_MODEL}"', text)
    for key, value in (("gpt_model_path", str(engine_dir)), ("served_model_name", SERVED_MODEL_NAME)):
        text = _replace_once(r'(key:\s*"' + key + r'"\s*value:\s*\{\s*string_value:\s*")[^"]*(")',
                             lambda m, v=value: m.group(1) + v + m.group(2), text)
    config_path.write_text(text)


def _replace_once(pattern: str, replacement: Any, text: str) -> str:
    new, count = re.subn(pattern, replacement, text, flags=re.M)
    if count != 1:
        raise ValueError(f"expected one match of {pattern!r} in the engine model's config.pbtxt, found {count}")
    return new
