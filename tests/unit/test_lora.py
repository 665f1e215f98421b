"""LoRA on the CPU engine, against PEFT itself: PEFT adapter -> the frontend's conversion -> the engine's cache ->
one batch with base rows and adapter rows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from build_engine.cpu_engine_builder import write_int8_weights
from cpu_engine.config import EngineConfig
from cpu_engine.int8 import load_int8_weights
from cpu_engine.lora import LoraBatch, LoraCache, not_in_cache
from cpu_engine.runner import Chunk, LlamaRunner, fused_projections
from cpu_engine.sampling import SamplingParams
from cpu_engine.scheduler import GenerationRequest, RequestError, Scheduler
from frontend.models.lora import AdapterError, BaseShapes, convert_peft

peft = pytest.importorskip("peft")

VOCAB = 256
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def llama(**overrides) -> LlamaConfig:
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, architectures=["LlamaForCausalLM"])
    return LlamaConfig(**{**shape, **overrides})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    LlamaForCausalLM(llama()).save_pretrained(path)
    return path


def make_adapter(base: LlamaForCausalLM, path: Path, seed: int, rank: int = 4, modules=MODULES) -> Path:
    """A PEFT adapter with random A and nonzero random B (init_lora_weights=False), saved as users have them."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(modules), init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():  # B big enough that the adapter moves the logits well past the tolerance
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    model.save_pretrained(path)
    base = model.unload()  # the base model as it was, for the next adapter
    return path


@pytest.fixture(scope="module")
def adapters(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    base = LlamaForCausalLM.from_pretrained(checkpoint)
    root = tmp_path_factory.mktemp("adapters")
    modules = [MODULES, ["q_proj", "v_proj"], ["o_proj", "down_proj"], ["gate_proj", "up_proj", "k_proj"]]
    return [make_adapter(base, root / f"a{i}", seed=i + 1, modules=modules[i]) for i in range(4)]


def cache_for(runner: LlamaRunner) -> LoraCache:
    return LoraCache(runner.lora_shapes, budget_bytes=1 << 30, max_rank=64)


def load(cache: LoraCache, task_id: int, path: Path, checkpoint: Path):
    tensors = convert_peft(path, max_rank=64, base=BaseShapes.from_checkpoint(checkpoint))
    # float16: lora_weights as both engines' config declares it (upstream's TYPE_FP16), as the frontend sends them.
    return cache.resolve(task_id, tensors.weights.astype(np.float16), tensors.config)


def dequantized(checkpoint: Path, int8_file: Path) -> LlamaForCausalLM:
    """The checkpoint with every projection replaced by its int8 copy's values (q x scale): the model the int8
    engine runs, as PEFT's reference."""
    model = LlamaForCausalLM.from_pretrained(checkpoint)
    quantized = load_int8_weights(int8_file)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for fused, parts in (("qkv", [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
                                 ("o_proj", [layer.self_attn.o_proj]),
                                 ("gate_up", [layer.mlp.gate_proj, layer.mlp.up_proj]), ("down", [layer.mlp.down_proj])):
                q, scale = quantized[f"layers.{i}.{fused}"]
                weight = q.float() * scale.float()[:, None]
                for part, rows in zip(parts, weight.split([p.out_features for p in parts])):
                    part.weight.copy_(rows)
    return model


@pytest.mark.parametrize("weights", ["float32", "int8"])
def test_logprobs_through_a_peft_adapter_match_peft_and_base_rows_are_unchanged(
        checkpoint: Path, adapters: list[Path], weights: str, tmp_path: Path) -> None:
    int8_file = write_int8_weights(checkpoint, tmp_path) if weights == "int8" else None
    runner = LlamaRunner(EngineConfig(checkpoint_dir=checkpoint, max_batch_size=2, max_seq_len=64, kv_block_size=4,
                                      int8_weights=int8_file))
    reference = dequantized(checkpoint, int8_file) if int8_file else LlamaForCausalLM.from_pretrained(checkpoint)
    adapter = load(cache_for(runner), 7, adapters[0], checkpoint)
    with_adapter = peft.PeftModel.from_pretrained(reference, adapters[0]).eval()
    prompt = [(5 * i + 3) % (VOCAB - 1) + 1 for i in range(9)]
    with torch.no_grad():
        expected = torch.log_softmax(with_adapter(torch.tensor([prompt])).logits[0], -1)
        with with_adapter.disable_adapter():
            base_expected = torch.log_softmax(with_adapter(torch.tensor([prompt])).logits[0], -1)
    assert (expected - base_expected).abs().max() > 0.05  # the adapter really moves the model
    rows = list(range(2 * len(prompt)))
    base_alone = runner.forward(prompt, [], [], [Chunk([0, 1, 2], 0, len(prompt))], rows[:len(prompt)])
    both = runner.forward(prompt + prompt, [], [], [Chunk([3, 4, 5], 0, len(prompt)), Chunk([6, 7, 8], 0, len(prompt))],
                          rows, lora=LoraBatch.of([None] * len(prompt) + [adapter] * len(prompt)))
    got = torch.log_softmax(both[len(prompt):], -1)
    tolerance = 1e-4 if weights == "float32" else 2e-2  # int8: the engine quantizes activations too
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    assert torch.equal(both[:len(prompt)], base_alone)  # base rows: the same bits as without any adapter
    # A decode step through the adapter, after its prompt: the next position's log-probs too.
    step = runner.forward([prompt[-1]], [[6, 7, 8]], [len(prompt) - 1], [], [0], lora=LoraBatch.of([adapter]))
    torch.testing.assert_close(torch.log_softmax(step[0], -1), expected[-1], atol=tolerance, rtol=tolerance)


class Sink:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.errors: list[str] = []

    def send(self, tokens, finish) -> None:
        self.tokens += [t.token for t in tokens]

    def send_error(self, message: str) -> None:
        self.errors.append(message)


def test_sixteen_streams_over_four_adapters_and_the_base_each_decode_as_alone(
        checkpoint: Path, adapters: list[Path]) -> None:
    """One prompt for all: the prefix cache must never hand one adapter's (or the base's) K/V to another."""
    runner = LlamaRunner(EngineConfig(checkpoint_dir=checkpoint, max_batch_size=16, max_seq_len=64, kv_block_size=4))
    cache = cache_for(runner)
    loaded = [None] + [load(cache, 100 + i, path, checkpoint) for i, path in enumerate(adapters)]
    scheduler = Scheduler(runner, max_num_tokens=64)
    prompt = [(3 * i + 1) % (VOCAB - 1) + 1 for i in range(10)]

    def request(i: int) -> GenerationRequest:
        return GenerationRequest(f"r{i}", prompt, 6, Sink(), SamplingParams(temperature=0.0), lora=loaded[i % 5])

    def run(requests: list[GenerationRequest]) -> None:
        for r in requests:
            scheduler.add(r)
        while scheduler.has_work:
            scheduler.step()

    alone = []
    for i in range(16):
        run([r := request(i)])
        alone.append(r.sink.tokens)
    batch = [request(i) for i in range(16)]
    run(batch)
    assert [r.sink.tokens for r in batch] == alone
    assert all(len(tokens) == 6 for tokens in alone)
    assert len({tuple(tokens) for tokens in alone[:5]}) == 5  # each adapter really decodes otherwise


def test_the_cache_answers_tensorrt_llms_error_for_an_unknown_task_and_evicts_the_oldest(
        checkpoint: Path, adapters: list[Path]) -> None:
    tensors = convert_peft(adapters[1], max_rank=64, base=None)
    shapes = LlamaRunner(EngineConfig(checkpoint_dir=checkpoint, max_batch_size=1, max_seq_len=16)).lora_shapes
    size = LoraCache(shapes, 1 << 30, 64).resolve(1, tensors.weights, tensors.config).nbytes
    cache = LoraCache(shapes, budget_bytes=int(size * 2.5), max_rank=64)
    with pytest.raises(RequestError, match="LoRA task 1 not found in cache. Please send LoRA weights with request"):
        cache.resolve(1, None, None)
    for task in (1, 2):
        cache.resolve(task, tensors.weights, tensors.config)
    cache.resolve(1, None, None)  # used: now the newest
    cache.resolve(3, tensors.weights, tensors.config)
    assert cache.task_ids() == [1, 3]
    with pytest.raises(RequestError, match=not_in_cache(2)):
        cache.resolve(2, None, None)
    with pytest.raises(RequestError, match="rank 4 is outside 1..2"):
        LoraCache(shapes, 1 << 30, max_rank=2).resolve(9, tensors.weights, tensors.config)


def test_bad_adapters_are_refused_at_conversion(checkpoint: Path, adapters: list[Path], tmp_path: Path) -> None:
    base = BaseShapes.from_checkpoint(checkpoint)
    other = tmp_path / "other"
    other_model = LlamaForCausalLM(llama(hidden_size=32, intermediate_size=64))
    make_adapter(other_model, other, seed=5, modules=["q_proj"])
    with pytest.raises(AdapterError, match="another model"):
        convert_peft(other, 64, base)
    with pytest.raises(AdapterError, match="rank 4 is over the maximum of 2"):
        convert_peft(adapters[0], 2, base)
    embed = tmp_path / "embed"
    make_adapter(LlamaForCausalLM.from_pretrained(checkpoint), embed, seed=6, modules=["lm_head"])
    with pytest.raises(AdapterError, match="lm_head"):
        convert_peft(embed, 64, base)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((adapters[1] / "adapter_config.json").read_text())
    data = (adapters[1] / "adapter_model.safetensors").read_bytes()
    (broken / "adapter_model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(AdapterError, match="truncated or corrupt"):
        convert_peft(broken, 64, base)
    (broken / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="cannot read"):
        convert_peft(broken, 64, base)
    dora = json.loads((adapters[1] / "adapter_config.json").read_text()) | {"use_dora": True}
    (broken / "adapter_config.json").write_text(json.dumps(dora))
    with pytest.raises(AdapterError, match="use_dora"):
        convert_peft(broken, 64, base)


def test_an_adapters_prompt_never_reuses_blocks_cached_by_the_base_or_another_adapter(
        checkpoint: Path, adapters: list[Path]) -> None:
    """K/V through an adapter are not the base model's: the prefix cache keys an adapter's blocks apart."""
    runner = LlamaRunner(EngineConfig(checkpoint_dir=checkpoint, max_batch_size=2, max_seq_len=64, kv_block_size=4))
    cache = cache_for(runner)
    first, second = (load(cache, 200 + i, adapters[i], checkpoint) for i in range(2))
    scheduler = Scheduler(runner, max_num_tokens=64)
    prompt = [(5 * i + 2) % (VOCAB - 1) + 1 for i in range(13)]

    def hits_of(lora) -> int:
        before = scheduler.prefix_cache_hits_tokens_total
        scheduler.add(GenerationRequest("r", prompt, 2, Sink(), SamplingParams(temperature=0.0), lora=lora))
        while scheduler.has_work:
            scheduler.step()
        return scheduler.prefix_cache_hits_tokens_total - before

    assert hits_of(None) == 0
    assert hits_of(first) == 0 and hits_of(second) == 0  # neither the base's blocks nor each other's
    assert hits_of(first) == 12 and hits_of(None) == 12  # each reuses its own (3 full blocks)
