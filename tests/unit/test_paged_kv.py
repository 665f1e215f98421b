"""The scheduler over the paged KV cache: prefix reuse, admission by free blocks, preemption, no leaks.

The block pool alone is tested in test_kv_blocks.py; here the real runner (a two-layer Llama) runs the steps,
so "exact" means what a user sees: the same greedy and seeded tokens with reuse on and off, preempted or not.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from cpu_engine.config import EngineConfig
from cpu_engine.runner import Chunk, LlamaRunner, kv_pool
from cpu_engine.sampling import SamplingParams
from cpu_engine.scheduler import FinishReason, RequestError, Scheduler
from tests.unit.test_cpu_engine import (VOCAB, checkpoint, int8_weights, kv_cache_dtype, prompt_of,  # noqa: F401
                                        request, run_until_done, weights)

BLOCK = 4


def paged_scheduler(checkpoint: Path, kv_tokens: int = 0, reuse: bool = True, slots: int = 4,
                    max_num_tokens: int = 64, int8_weights: Path | None = None,
                    kv_cache_dtype: str = "auto") -> Scheduler:
    runner = LlamaRunner(EngineConfig(checkpoint_dir=checkpoint, max_batch_size=slots, max_seq_len=128,
                                      max_num_tokens=max_num_tokens, kv_block_size=BLOCK, kv_cache_tokens=kv_tokens,
                                      int8_weights=int8_weights, kv_cache_dtype=kv_cache_dtype))
    assert runner.k_cache.dtype == (torch.bfloat16 if kv_cache_dtype == "bfloat16" else torch.float32)
    return Scheduler(runner, max_num_tokens, enable_prefix_reuse=reuse)


def assert_no_blocks_held(scheduler: Scheduler) -> None:
    scheduler.blocks.check()
    assert scheduler.blocks.num_used == 0 and not scheduler.has_work


def test_a_cached_prompt_skips_its_full_blocks_and_answers_the_same(checkpoint: Path, weights: Path | None,
                                                                     kv_cache_dtype: str) -> None:
    system = prompt_of(37)
    answers = {}
    for reuse in (True, False):
        scheduler = paged_scheduler(checkpoint, reuse=reuse, int8_weights=weights, kv_cache_dtype=kv_cache_dtype)
        first, second = request("a", system + [5, 6], 12), request("b", system + [7], 12)
        scheduler.add(first)
        run_until_done(scheduler)
        before = scheduler.stats()
        scheduler.add(second)
        run_until_done(scheduler)
        after = scheduler.stats()
        hits = after.prefix_cache_hits_tokens_total - before.prefix_cache_hits_tokens_total
        # 38 tokens: 9 full blocks to look up (the last token is always computed), all 9 of the system prompt's.
        assert hits == (36 if reuse else 0)
        assert after.prompt_tokens_total - before.prompt_tokens_total == 38 - hits
        assert after.prefix_cache_queries_tokens_total - before.prefix_cache_queries_tokens_total == 38
        answers[reuse] = (first.sink.tokens, second.sink.tokens)
        assert_no_blocks_held(scheduler)
    assert answers[True] == answers[False]
    assert all(len(tokens) == 12 for tokens in answers[True])


def test_running_requests_share_their_common_prefix(checkpoint: Path) -> None:
    scheduler = paged_scheduler(checkpoint)
    system = prompt_of(40)  # 10 full blocks
    first = request("a", system + [1, 2, 3], 30)
    scheduler.add(first)
    while not first.sink.tokens:  # the first has read its prompt: its blocks are registered
        scheduler.step()
    held_alone = scheduler.blocks.num_used
    second = request("b", system + [9], 30)
    scheduler.add(second)
    scheduler.step()
    # The second holds only its own tail: one block for tokens 40..41 (its last token and its first decode).
    assert scheduler.blocks.num_used == held_alone + 1
    assert all(scheduler.blocks.refcount(b) == 2 for b in scheduler.running[0].blocks[:10])
    run_until_done(scheduler)
    assert first.sink.finish is second.sink.finish is FinishReason.LENGTH
    assert_no_blocks_held(scheduler)


def test_diverging_prompts_share_only_the_blocks_before_the_difference(checkpoint: Path) -> None:
    scheduler = paged_scheduler(checkpoint)
    base = prompt_of(33)
    scheduler.add(request("a", base, 2))
    run_until_done(scheduler)
    changed = list(base)
    changed[13] += 1  # inside block 3
    hits = scheduler.prefix_cache_hits_tokens_total
    scheduler.add(request("b", changed, 2))
    run_until_done(scheduler)
    assert scheduler.prefix_cache_hits_tokens_total - hits == 3 * BLOCK


def test_a_request_larger_than_the_whole_cache_is_refused_at_once(checkpoint: Path) -> None:
    scheduler = paged_scheduler(checkpoint, kv_tokens=64)  # 16 blocks, less than max_seq_len
    with pytest.raises(RequestError, match="exceeds the engine's KV cache: it needs 17 blocks of 4 tokens"):
        scheduler.add(request("big", prompt_of(60), 6))  # 65 token places (its last token is never read back)
    scheduler.add(request("fits", prompt_of(60), 5))
    assert len(scheduler.waiting) == 1


def test_a_request_that_fits_the_cache_but_not_now_waits(checkpoint: Path) -> None:
    scheduler = paged_scheduler(checkpoint, kv_tokens=128, reuse=False)
    first, second = request("a", prompt_of(90), 20), request("b", prompt_of(60, offset=3), 10)
    scheduler.add(first)
    scheduler.step()
    scheduler.add(second)
    scheduler.step()
    assert [s.request for s in scheduler.running] == [first] and list(scheduler.waiting) == [second]
    run_until_done(scheduler)
    assert first.sink.finish is second.sink.finish is FinishReason.LENGTH
    assert_no_blocks_held(scheduler)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_k=40, seed=11)],
                         ids=["greedy", "seeded"])
def test_preempted_sequences_resume_and_answer_as_if_never_preempted(checkpoint: Path,
                                                                     sampling: SamplingParams,
                                                                     weights: Path | None,
                                                                     kv_cache_dtype: str) -> None:
    def run(kv_tokens: int) -> tuple[list[list[int]], int]:
        scheduler = paged_scheduler(checkpoint, kv_tokens=kv_tokens, reuse=kv_tokens > 0, int8_weights=weights,
                                    kv_cache_dtype=kv_cache_dtype)
        requests = [request(f"r{i}", prompt_of(10 + 3 * i, offset=i), 40, sampling=sampling) for i in range(4)]
        for r in requests:
            scheduler.add(r)
        run_until_done(scheduler)
        assert all(r.sink.finish is FinishReason.LENGTH for r in requests)
        assert_no_blocks_held(scheduler)
        return [r.sink.tokens for r in requests], scheduler.preemptions_total

    roomy, none = run(0)  # 4 x 128 tokens: nobody waits for memory
    tight, preemptions = run(128)  # together they need ~220 token places: some must give theirs back
    assert none == 0 and preemptions > 0
    assert tight == roomy


def test_a_preempted_request_can_be_cancelled(checkpoint: Path) -> None:
    scheduler = paged_scheduler(checkpoint, kv_tokens=128, reuse=False)
    requests = [request(f"r{i}", prompt_of(30, offset=i), 60) for i in range(3)]
    for r in requests:
        scheduler.add(r)
    while not scheduler.preempted:
        scheduler.step()
    victim = scheduler.preempted[0].request
    scheduler.cancel(victim)
    run_until_done(scheduler)
    assert victim.sink.finish is FinishReason.CANCELLED
    assert all(r.sink.finish is FinishReason.LENGTH for r in requests if r is not victim)
    assert_no_blocks_held(scheduler)


class RandomForward:
    """A runner with the real one's shapes and no model: random logits, for fast scheduler lifetimes."""

    vocab_size, max_seq_len, max_batch_size, block_size = VOCAB, 96, 6, BLOCK

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, token_ids, decode_blocks, decode_positions, chunks, logits_rows) -> torch.Tensor:
        for table, position in zip(decode_blocks, decode_positions):
            assert position // BLOCK < len(table), "a decode token without a block to write to"
        for chunk in chunks:
            assert -(-(chunk.start + chunk.length) // BLOCK) <= len(chunk.blocks)
        return torch.randn(len(logits_rows), VOCAB, generator=self.generator)


def test_no_block_leaks_after_many_random_lifetimes() -> None:
    """Requests with shared prefixes, cancelled at random points (waiting, reading, decoding, preempted), in a
    pool small enough to preempt and evict: every block comes back, and every request ends exactly once."""
    rng = random.Random(7)
    scheduler = Scheduler(RandomForward(num_blocks=48), max_num_tokens=24)
    prefixes = [prompt_of(n, offset=n) for n in (9, 20, 33)]
    live = []
    for i in range(600):
        prompt = rng.choice(prefixes)[:rng.randint(1, 33)] + [rng.randint(1, VOCAB - 1) for _ in range(rng.randint(0, 6))]
        r = request(f"r{i}", prompt, rng.randint(1, 90 - len(prompt)), end_id=rng.choice([None, 3]))
        scheduler.add(r)
        live.append(r)
        for _ in range(rng.randint(0, 3)):
            scheduler.step()
            scheduler.blocks.check()
        if live and rng.random() < 0.3:
            scheduler.cancel(live.pop(rng.randrange(len(live))))
        live = [r for r in live if not r.sink.done.is_set()]
    run_until_done(scheduler)
    assert_no_blocks_held(scheduler)
    assert scheduler.preemptions_total > 0 and scheduler.prefix_cache_hits_tokens_total > 0
    assert all(r.sink.done.is_set() for r in live)


def test_in_place_decode_attention_matches_pytorch_over_gathered_blocks() -> None:
    """The numba kernel against F.scaled_dot_product_attention over the same blocks gathered: ragged
    lengths (one a single position), scattered block tables, grouped-query heads."""
    from cpu_engine.paged_attention import paged_decode_attention

    generator = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, block, blocks = 6, 2, 16, 4, 40
    k_pool = torch.randn(blocks * block, kv_heads, dim, generator=generator)
    v_pool = torch.randn(blocks * block, kv_heads, dim, generator=generator)
    lengths = torch.tensor([1, 13, 32, 7])
    tables = torch.randperm(blocks, generator=generator)[:4 * 8].view(4, 8)
    q = torch.randn(4, heads, dim, generator=generator)
    got = paged_decode_attention(q, k_pool, v_pool, tables, lengths, block, 0.25)
    for row, length in enumerate(lengths.tolist()):
        places = (tables[row, torch.arange(length) // block] * block + torch.arange(length) % block)
        keys, values = k_pool[places].transpose(0, 1), v_pool[places].transpose(0, 1)  # [kv_heads, L, dim]
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[row][:, None, :], keys, values, scale=0.25, enable_gqa=True)[:, 0]
        torch.testing.assert_close(got[row], expected, atol=1e-5, rtol=1e-5)


def test_in_place_decode_and_the_gather_path_give_the_same_logits(checkpoint: Path) -> None:
    runner = LlamaRunner(EngineConfig(checkpoint_dir=checkpoint, max_batch_size=3, max_seq_len=64, kv_block_size=4))
    assert runner.in_place_decode  # float32
    tables = [[9, 2, 14, 5], [0, 7, 11, 3], [6, 1, 12, 8]]
    prompts = [prompt_of(n, offset=n) for n in (5, 11, 14)]
    for table, prompt in zip(tables, prompts):
        runner.forward(prompt, [], [], [Chunk(table, 0, len(prompt))], [len(prompt) - 1])
    positions = [len(p) for p in prompts]
    in_place = runner.forward([3, 4, 5], tables, positions, [], [0, 1, 2])
    runner.in_place_decode = False
    runner.plan_fused_ops()  # no decode step in one call either: it reads the pool in place
    assert runner.one_call_decode is None
    gathered = runner.forward([3, 4, 5], tables, positions, [], [0, 1, 2])
    torch.testing.assert_close(in_place, gathered, atol=1e-4, rtol=1e-4)


def test_a_bfloat16_engine_stays_within_tolerance_of_float32(checkpoint: Path) -> None:
    """The bfloat16 setting (`--dtype bfloat16`: weights and KV cache in bf16, fast where the CPU has native
    bf16) against float32 on the same prompt, through prefill and decode (the gather path)."""
    def logits(dtype: str) -> torch.Tensor:
        runner = LlamaRunner(EngineConfig(checkpoint_dir=checkpoint, dtype=dtype, max_batch_size=1, max_seq_len=64,
                                          kv_block_size=4))
        prompt, table = prompt_of(21), [4, 0, 7, 2, 9, 1]
        first = runner.forward(prompt[:-1], [], [], [Chunk(table, 0, 20)], list(range(20)))
        last = runner.forward(prompt[-1:], [table], [20], [], [0])
        return torch.cat([first, last])

    reference, reduced = logits("float32"), logits("bfloat16")
    assert reduced.dtype == torch.float32  # logits always come back as float32
    error = (reduced - reference).abs().max() / reference.abs().max()
    assert 0 < error < 0.05, error  # not the same numbers (bf16 did run), but close
    cosine = torch.nn.functional.cosine_similarity(reduced, reference, dim=-1)
    assert cosine.min() > 0.99, cosine.min()


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_runner_matches_hugging_face_for_the_qwen_families(family: str, tmp_path: Path) -> None:
    """q/k/v biases (Qwen2) and per-head q/k RMSNorms before the rotary embedding (Qwen3), through the fused
    norms and the joint q/k rotary of the runner."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

    config_class, architecture = {"qwen2": (Qwen2Config, "Qwen2ForCausalLM"),
                                  "qwen3": (Qwen3Config, "Qwen3ForCausalLM")}[family]
    torch.manual_seed(5)
    config = config_class(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                          architectures=[architecture])
    model = AutoModelForCausalLM.from_config(config)
    if family == "qwen3":  # non-trivial norm weights, so that a misplaced q/k norm shows
        for layer in model.model.layers:
            torch.nn.init.uniform_(layer.self_attn.q_norm.weight, 0.5, 1.5)
            torch.nn.init.uniform_(layer.self_attn.k_norm.weight, 0.5, 1.5)
    model.save_pretrained(tmp_path)
    prompt = prompt_of(10)
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0]
    runner = LlamaRunner(EngineConfig(checkpoint_dir=tmp_path, max_batch_size=1, max_seq_len=32, kv_block_size=4))
    table = [3, 1, 6]
    first = runner.forward(prompt[:9], [], [], [Chunk(table, 0, 9)], list(range(9)))
    last = runner.forward(prompt[9:], [table], [9], [], [0])
    torch.testing.assert_close(first, expected[:9], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(last[0], expected[9], atol=1e-4, rtol=1e-4)


def _vm_flags_of(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kv_pool_is_zeroed_writable_and_advised_onto_huge_pages(dtype: torch.dtype) -> None:
    shape = (2, 4096, 4, 64)
    pool = kv_pool(shape, dtype)
    assert pool.shape == shape and pool.dtype == dtype and pool.is_contiguous()
    assert not pool.any()
    pool[1, 4095, 3, 63] = 1.5
    assert pool.float().sum().item() == 1.5
    # "hg": advised MADV_HUGEPAGE. Whether the kernel then finds free huge pages depends on the machine's memory,
    # not on us, so the advice is what is asserted (the speed it buys is measured: benchmarks/README.md).
    assert "hg" in _vm_flags_of(pool.data_ptr())
