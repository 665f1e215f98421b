"""benchmarks/compile_bench.py compares torch.compile against the engine's step only if its layer functions
are the engine's math: checked here, eager (no compile: that takes tens of seconds), on a small random Llama."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.compile_bench import PROMPT, LayerFunctions, post_attention, pre_attention
from cpu_engine.config import EngineConfig
from cpu_engine.runner import Chunk, LlamaRunner


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         architectures=["LlamaForCausalLM"])
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_the_layer_functions_give_the_runners_logits(checkpoint: Path) -> None:
    runner = LlamaRunner(EngineConfig(checkpoint_dir=checkpoint, max_batch_size=2, max_seq_len=64, kv_block_size=8))
    functions = LayerFunctions(runner, checkpoint, pre_attention, post_attention)
    tables = [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    with torch.inference_mode():
        for table in tables:
            runner.forward(PROMPT, [], [], [Chunk(table, 0, len(PROMPT))], [len(PROMPT) - 1])
        expected = runner.forward([5, 6], tables, [len(PROMPT)] * 2, [], [0, 1])
        # The runner's step wrote this position's K/V; writing them again is idempotent.
        got = functions.step([5, 6], tables, [len(PROMPT)] * 2)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert not torch.equal(got[0], got[1])  # the two sequences' tokens differ: a wrong row would show
