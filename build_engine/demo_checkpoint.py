"""A deterministic, download-free demo checkpoint: byte-level BPE tokenizer + randomly initialised Llama (or Qwen2).

The weights are random on purpose: the demo exists to exercise the serving stack (tokenization, batching,
streaming, detokenization) offline, not to produce sensible text. Every run yields the same bytes for the
same preset and Python installation, so tests and benchmarks are reproducible.
"""

from __future__ import annotations

import json
import shutil
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Bump when anything below changes the generated files, so stale demo checkpoints are regenerated.
GENERATOR_VERSION = 2
STAMP_FILE = "demo_checkpoint_stamp.json"

BOS_TOKEN = "<|begin_of_text|>"
IM_START_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"  # chat turns end here, so generation stops here
END_OF_TEXT_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [BOS_TOKEN, IM_START_TOKEN, EOS_TOKEN, END_OF_TEXT_TOKEN, PAD_TOKEN]

# ChatML turns. With tools, Llama 3.1's JSON tool calling (an answer that is only `{"name": ..., "parameters":
# {...}}`, calls separated by "; "): the frontend's llama3_json parser reads it.
CHATML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou can call these functions. To call one, answer with nothing but "
    '{"name": <function name>, "parameters": <arguments object>}; separate several calls with "; ".\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}{% if not loop.first %}; {% endif %}"
    '{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}{% endfor %}'
    "{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen2.5's ChatML with Hermes-style tool calling (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
# results in `<tool_response>`): the frontend's hermes parser reads it.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n"
    "{% endif %}# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\nFor each function call, return "
    "a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{% if message.content %}{{ message.content }}\n{% endif %}"
    "{% for call in message.tool_calls %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{% if not loop.last %}\n{% endif %}{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

VOCAB_SIZE = 4096
# Enough stdlib source for a useful merge table while keeping training to a few seconds.
TRAINING_TEXT_BYTES = 4 * 1024 * 1024
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


@dataclass(frozen=True)
class Preset:
    """Model shape of one demo preset."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    family: str = "llama"  # llama: LlamaForCausalLM, ChatML; qwen2: Qwen2ForCausalLM, Hermes tool calling


PRESETS: dict[str, Preset] = {
    # A few million parameters: fast enough for unit and integration tests.
    "tiny": Preset(128, 384, 4, 4, 2, 1024),
    # About 80M parameters: large enough that batching matters in benchmarks.
    "small": Preset(768, 2048, 12, 12, 4, 2048),
    # The tiny shape as Qwen2 (q/k/v biases) with Qwen2.5's Hermes-style tool calling in its template.
    "qwen-tiny": Preset(128, 384, 4, 4, 2, 1024, family="qwen2"),
}
TEMPLATES = {"llama": CHATML_TEMPLATE, "qwen2": HERMES_TEMPLATE}


def demo_checkpoint_dir(output_dir: Path, preset: str) -> Path:
    """Where the demo checkpoint of ``preset`` lives under a build output folder."""
    return output_dir / "checkpoints" / f"demo-{preset}"


def ensure_demo_checkpoint(output_dir: Path, preset: str) -> Path:
    """Return the demo checkpoint directory for ``preset``, generating it only if it is missing or stale."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    target = demo_checkpoint_dir(output_dir, preset).resolve()
    if _is_complete(target, preset):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and swap in at the end, so an interrupted run never leaves a half checkpoint
    # that a later run would trust.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}-") as tmp:
        staging = Path(tmp) / target.name
        write_demo_checkpoint(staging, preset)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    return target


def write_demo_checkpoint(directory: Path, preset: str) -> None:
    """Generate tokenizer and model for ``preset`` into ``directory`` (created), stamp written last."""
    directory.mkdir(parents=True, exist_ok=False)
    tokenizer = _train_tokenizer(PRESETS[preset].max_position_embeddings, TEMPLATES[PRESETS[preset].family])
    tokenizer.save_pretrained(directory)
    _save_model(directory, PRESETS[preset], tokenizer)
    stamp = {"preset": preset, "generator_version": GENERATOR_VERSION}
    (directory / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")


def _is_complete(directory: Path, preset: str) -> bool:
    stamp_path = directory / STAMP_FILE
    if not stamp_path.is_file() or not all((directory / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        stamp = json.loads(stamp_path.read_text())
    except json.JSONDecodeError:
        return False
    return stamp == {"preset": preset, "generator_version": GENERATOR_VERSION}


def stdlib_training_text(limit_bytes: int = TRAINING_TEXT_BYTES) -> list[str]:
    """Stdlib sources in a fixed order: text that ships with every Python, so no download is needed."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text.encode("utf-8"))
        if total >= limit_bytes:
            break
    return texts


def _train_tokenizer(model_max_length: int, chat_template: str):  # -> PreTrainedTokenizerFast (lazy import)
    """Byte-level BPE, so any Unicode (CJK, emoji) encodes and decodes back exactly.

    ``model_max_length`` is recorded so tokenizer users see the model's real context length.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(stdlib_training_text(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=model_max_length,
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def _save_model(directory: Path, preset: Preset, tokenizer) -> None:
    """Random float32 weights (Llama or Qwen2) from a fixed seed, with the tokenizer's special ids wired in."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as transformers_logging

    bos_id = tokenizer.convert_tokens_to_ids(BOS_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    end_of_text_id = tokenizer.convert_tokens_to_ids(END_OF_TEXT_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM),
                                 "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[preset.family]
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    torch.manual_seed(0)
    model = model_class(config).to(torch.float32)
    # Generation stops at the end of a chat turn or the end of a document.
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=[eos_id, end_of_text_id], pad_token_id=pad_id
    )
    transformers_logging.disable_progress_bar()  # a one-shard progress bar is noise in build output
    model.save_pretrained(directory, safe_serialization=True)
