"""The CPU engine without a server: the runner against Hugging Face, and the scheduler step by step."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import threading
import types
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from build_engine.cpu_engine_builder import write_int8_weights
from cpu_engine import float32_gemm, fused_step, paged_attention, vnni_gemm
from cpu_engine.config import EngineConfig
from cpu_engine.engine import Engine, EngineFailedError
from cpu_engine.int8 import default_kernel
from cpu_engine import runner as runner_module
from cpu_engine.runner import Chunk, LlamaRunner, Projection
from cpu_engine.sampling import SampledToken, SamplingParams, SamplingRow, sample
from cpu_engine.scheduler import (STOPPED_BY_ID, FinishReason, GenerationRequest, PrefillBudget, RequestError,
                                  Scheduler, StepCosts)

VOCAB = 512


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         architectures=["LlamaForCausalLM"])
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def int8_weights(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint's projections quantized as `build_engine --weights int8` does."""
    return write_int8_weights(checkpoint, tmp_path_factory.mktemp("int8-engine"))


@pytest.fixture(params=["float32", "int8"])
def weights(request: pytest.FixtureRequest, int8_weights: Path) -> Path | None:
    """Runs a test once per weight format: the `int8_weights` of an EngineConfig (None: float32)."""
    return int8_weights if request.param == "int8" else None


@pytest.fixture(params=["auto", "bfloat16"], ids=["kv-float32", "kv-bfloat16"])
def kv_cache_dtype(request: pytest.FixtureRequest) -> str:
    """Runs a test once per KV cache dtype (cpu_kv_cache_dtype) where the bfloat16 cache can be had here."""
    if request.param == "bfloat16" and paged_attention.bfloat16_kernel() is None:
        pytest.skip("a bfloat16 KV cache needs AVX-512 (F, BW, DQ) and a C compiler; the engine keeps float32")
    return request.param


def make_scheduler(checkpoint: Path, slots: int = 4, max_seq_len: int = 256,
                   max_num_tokens: int = 64, int8_weights: Path | None = None,
                   kv_cache_dtype: str = "auto") -> Scheduler:
    runner = LlamaRunner(EngineConfig(checkpoint_dir=checkpoint, max_batch_size=slots, max_seq_len=max_seq_len,
                                      max_num_tokens=max_num_tokens, int8_weights=int8_weights,
                                      kv_cache_dtype=kv_cache_dtype))
    assert runner.k_cache.dtype == (torch.bfloat16 if kv_cache_dtype == "bfloat16" else torch.float32)
    return Scheduler(runner, max_num_tokens)


class ListSink:
    """Collects what the engine sends; `done` is set by the last response (final or error), so tests
    that run the engine thread wait on it instead of polling."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.finish: FinishReason | None = None
        self.error: str | None = None
        self.done = threading.Event()

    def send(self, tokens: list[SampledToken], finish: FinishReason | None) -> None:
        assert not self.done.is_set(), "nothing may follow the final response"
        self.tokens += [t.token for t in tokens]
        self.logprobs += [t.logprob for t in tokens]
        self.top += [t.top for t in tokens]
        self.finish = finish
        if finish is not None:
            self.done.set()

    def send_error(self, message: str) -> None:
        assert not self.done.is_set(), "nothing may follow the final response"
        self.error = message
        self.done.set()


def request(rid: str, prompt: list[int], max_new: int, **kwargs) -> GenerationRequest:
    return GenerationRequest(request_id=rid, prompt=prompt, max_new_tokens=max_new, sink=ListSink(), **kwargs)


def run_until_done(scheduler: Scheduler, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not scheduler.has_work:
            return
        scheduler.step()
    raise AssertionError("scheduler did not finish")


def prompt_of(length: int, offset: int = 0) -> list[int]:
    return [(7 * i + offset) % (VOCAB - 1) + 1 for i in range(length)]


@pytest.mark.parametrize("chunks_as_rows", [True, False], ids=["chunks-as-decode-rows", "chunk-kernel"])
def test_runner_matches_hugging_face_forward(checkpoint: Path, chunks_as_rows: bool,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways a prompt chunk is read (runner._chunks_as_decode_rows): as decode rows, and by the chunk
    attention kernel (the bound at 0: every chunk takes it)."""
    if not chunks_as_rows:
        monkeypatch.setattr(runner_module, "ROWS_AS_DECODE_MAX_KV_BYTES", 0)
    model = LlamaForCausalLM.from_pretrained(checkpoint)
    runner = LlamaRunner(EngineConfig(checkpoint_dir=checkpoint, max_batch_size=2, max_seq_len=64, kv_block_size=4))
    prompt = prompt_of(11)
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0]
    table = [17, 3, 30]  # blocks anywhere in the pool, in any order
    first = runner.forward(prompt[:5], [], [], [Chunk(table, 0, 5)], [0, 1, 2, 3, 4])
    second = runner.forward(prompt[5:10], [], [], [Chunk(table, 5, 5)], [4])
    third = runner.forward(prompt[10:], [table], [10], [], [0])  # the last token as a decode token
    assert first.is_inference() and third.is_inference()  # no autograd bookkeeping in a step
    torch.testing.assert_close(first, expected[:5], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(second[0], expected[9], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(third[0], expected[10], atol=1e-4, rtol=1e-4)


def test_a_steps_chunks_run_as_decode_rows_only_under_the_attention_bound(
        checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed step's chunk runs as decode rows exactly when every row's attention reads under
    ROWS_AS_DECODE_MAX_KV_BYTES of K/V a layer (counted: the chunk attention kernel is called or not), and the two
    ways give the same logits within float32 rounding and the same greedy tokens."""
    runner = LlamaRunner(EngineConfig(checkpoint_dir=checkpoint, max_batch_size=2, max_seq_len=64, kv_block_size=4))
    tables, prompt = [list(range(0, 8)), list(range(8, 16))], prompt_of(20)
    runner.forward(prompt, [], [], [Chunk(tables[0], 0, 20)], [19])
    runner.forward(prompt[:9], [], [], [Chunk(tables[1], 0, 9)], [8])
    # decode row at 20 (21 positions read) beside a chunk of 3 after 9 cached tokens (10 + 11 + 12)
    reads = (21 + 10 + 11 + 12) * runner.kv_bytes_per_position
    chunk_calls = []
    sdpa = runner_module.F.scaled_dot_product_attention
    monkeypatch.setattr(runner_module.F, "scaled_dot_product_attention",
                        lambda *args, **kwargs: chunk_calls.append(1) or sdpa(*args, **kwargs))

    def mixed_step_with_bound(bound: int) -> torch.Tensor:
        monkeypatch.setattr(runner_module, "ROWS_AS_DECODE_MAX_KV_BYTES", bound)
        chunk_calls.clear()
        return runner.forward([6, 8, 9, 10], tables[:1], [20], [Chunk(tables[1], 9, 3)], [0, 3])

    as_rows = mixed_step_with_bound(reads + 1)
    assert not chunk_calls
    by_chunk_kernel = mixed_step_with_bound(reads)
    assert len(chunk_calls) == len(runner.layers)
    torch.testing.assert_close(as_rows, by_chunk_kernel, atol=1e-5, rtol=1e-5)
    assert torch.equal(as_rows.argmax(-1), by_chunk_kernel.argmax(-1))
    assert torch.equal(as_rows[0], by_chunk_kernel[0])  # the decode row is the decode kernel's either way


# The float32 projection kernels (runner.Projection), each a parameter; ours skipped (with why) where it cannot run.
FLOAT32_KERNELS = [pytest.param("float32-gemm", id="float32-gemm", marks=pytest.mark.skipif(
    float32_gemm.gemm() is None, reason="our float32 GEMM needs AVX-512 and a C compiler")), "onednn", "mkl"]


def use_float32_kernel(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Projections made from now on run on `kernel` (the runner picks the first that runs: ours, oneDNN, MKL)."""
    if kernel != "float32-gemm":
        monkeypatch.setattr(float32_gemm, "gemm", lambda: None)
    if kernel == "mkl":
        monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)


@pytest.mark.parametrize("kernel", FLOAT32_KERNELS)
def test_projection_matches_f_linear_at_every_batch_size(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    use_float32_kernel(kernel, monkeypatch)
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=generator), torch.randn(96, generator=generator)
    projection = Projection(weight, bias)
    assert projection.kernel == kernel and projection.description  # the server log names it
    for rows in (1, 3, 16, 200):  # 200: past the MKL fallback's small-batch kernel
        x = torch.randn(rows, 64, generator=generator)
        torch.testing.assert_close(projection(x), torch.nn.functional.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kernel", FLOAT32_KERNELS[:2])
@pytest.mark.parametrize("shape", [(1280, 768), (512, 1536)])
def test_a_projection_gives_a_row_the_same_bits_in_any_batch(shape: tuple[int, int], kernel: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Why greedy decoding is the same alone and batched. Our kernel sums every output in input order whatever
    the tile; with 1,536 inputs (a `small` model's down projection) oneDNN's own 1-row kernel sums in another
    order than its kernels for more rows: the runner pads a float32 row to ONEDNN_FLOAT32_MIN_ROWS there
    (bfloat16 needs no padding)."""
    use_float32_kernel(kernel, monkeypatch)
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(*shape, generator=generator)
    projection = Projection(weight)
    assert projection.kernel == kernel  # the pinned torch CPU wheel has oneDNN; without it the engine is slower
    assert projection.min_rows == (runner_module.ONEDNN_FLOAT32_MIN_ROWS if kernel == "onednn" else 0)
    x = torch.randn(300, shape[1], generator=generator)
    alone = projection(x[:1])
    assert alone.shape == (1, shape[0]) and alone.is_contiguous()
    for rows in (2, 3, 4, 5, 7, 16, 32, 129, 300):
        assert torch.equal(projection(x[:rows])[:1], alone), rows
        assert torch.equal(projection(x[rows - 1:rows]), projection(x[:rows])[-1:]), rows  # the last row too
    bfloat16 = Projection(weight.bfloat16())
    assert bfloat16.kernel != "float32-gemm" and (bfloat16.min_rows == 0 or not bfloat16.uses_onednn)


@pytest.mark.parametrize("chunks_as_rows, wide, kv_cache", [(True, False, "auto"), (False, False, "auto"),
                                                          (True, True, "auto"), (False, False, "bfloat16")],
                         ids=["chunks-as-decode-rows", "chunk-kernel", "wide-attention", "bfloat16-kv-cache"])
def test_an_engine_on_our_kernels_steps_the_same_bits_fused_and_unfused(checkpoint: Path, weights: Path | None,
                                                                        chunks_as_rows: bool, wide: bool, kv_cache: str,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        request: pytest.FixtureRequest) -> None:
    """The runner's decode-only steps in one numba call (fused_step, on our float32 or VNNI kernel), its fused
    layers one by one (FusedLayer.fused), and every layer unfused: the same logits, bit for bit, through prompts,
    batched decode steps and a mixed step, so a sequence decodes the same in a decode-only step and beside
    another's prompt; with the prompt chunks read as decode rows (then the mixed step runs in one call too) and
    by the chunk attention kernel (the bound at 0: the mixed step runs the layer loop); and with every step's
    decode attention on a wider team than the rest of the step (runner.wide_attention_threads, as the engine
    sets it on 2 cores: the one call switches numba's team around attention itself)."""
    import numba

    if not chunks_as_rows:
        monkeypatch.setattr(runner_module, "ROWS_AS_DECODE_MAX_KV_BYTES", 0)
    if wide and numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba's team has one thread here: there is no wider team to run attention on")
    if kv_cache == "bfloat16" and paged_attention.bfloat16_kernel() is None:
        pytest.skip("a bfloat16 KV cache needs AVX-512 (F, BW, DQ) and a C compiler; the engine keeps float32")
    config = EngineConfig(checkpoint_dir=checkpoint, max_batch_size=2, max_seq_len=64, kv_block_size=4,
                          int8_weights=weights, kv_cache_dtype=kv_cache)
    runner = LlamaRunner(config)
    narrow = numba.get_num_threads()
    request.addfinalizer(lambda: numba.set_num_threads(narrow))
    if wide:
        monkeypatch.setattr(runner_module, "WIDE_ATTENTION_MIN_KV_BYTES", 0)
        runner.wide_attention_threads = 2
        numba.set_num_threads(1)
    ours = float32_gemm.gemm() if weights is None else vnni_gemm.gemm()
    assert (runner.one_call_decode is not None) == (ours is not None)
    assert all(layer.fused for layer in runner.layers) == (ours is not None or (
        weights is not None and default_kernel() != "weight-only"))

    def steps() -> list[torch.Tensor]:
        tables, prompt = [list(range(0, 8)), list(range(8, 16))], list(range(3, 20))
        logits = [runner.forward(prompt, [], [], [Chunk(tables[0], 0, len(prompt))], [len(prompt) - 1]),
                  runner.forward(prompt[:9], [], [], [Chunk(tables[1], 0, 9)], [8])]
        for step in range(4):
            logits.append(runner.forward([5, 7], tables, [len(prompt) + step, 9 + step], [], [0, 1]))
        # a decode row beside another sequence's chunk (a mixed step), then alone
        logits.append(runner.forward([6, 8, 9, 10], tables[:1], [len(prompt) + 4], [Chunk(tables[1], 13, 3)],
                                     [0, 3]))
        logits.append(runner.forward([6], tables[:1], [len(prompt) + 4], [], [0]))
        return logits

    in_one_call = []
    real_step = fused_step.decode_step
    monkeypatch.setattr(fused_step, "decode_step", lambda *args: in_one_call.append(len(args[2])) or real_step(*args))
    one_call = steps()
    # every decode-only step ran in one call (4 of 2 rows, the last alone); with the chunks as rows the prompts
    # (17 and 9 rows) and the mixed step (4) too
    expected = [17, 9] + [2] * 4 + [4, 1] if chunks_as_rows else [2] * 4 + [1]
    assert in_one_call == (expected if ours is not None else [])
    assert torch.equal(one_call[-1][0], one_call[-2][0])  # the same row, beside a chunk and alone
    runner.one_call_decode = None
    layer_by_layer = steps()
    for layer in runner.layers:
        layer.fused = False
    unfused = steps()
    assert numba.get_num_threads() == (1 if wide else narrow)  # the wide team never leaks past a step
    for a, b, c in zip(one_call, layer_by_layer, unfused, strict=True):
        assert torch.equal(a, b) and torch.equal(b, c)


def test_greedy_alone_equals_greedy_in_a_full_batch(checkpoint: Path, weights: Path | None,
                                                    kv_cache_dtype: str) -> None:
    alone = make_scheduler(checkpoint, int8_weights=weights, kv_cache_dtype=kv_cache_dtype)
    target = request("target", prompt_of(11), 24)
    alone.add(target)
    run_until_done(alone)

    batched = make_scheduler(checkpoint, max_num_tokens=16, int8_weights=weights,
                             kv_cache_dtype=kv_cache_dtype)  # forces chunked prefill too
    others = [request(f"o{i}", prompt_of(5 + 9 * i, offset=i), 10 + 7 * i) for i in range(3)]
    again = request("target", prompt_of(11), 24)
    batched.add(others[0])
    batched.step()
    batched.step()  # the target joins a batch that is already decoding
    batched.add(again)
    for other in others[1:]:
        batched.add(other)
    run_until_done(batched)
    assert len(target.sink.tokens) == 24 and target.sink.finish is FinishReason.LENGTH
    assert again.sink.tokens == target.sink.tokens
    assert all(o.sink.finish is FinishReason.LENGTH and len(o.sink.tokens) == o.max_new_tokens for o in others)


def test_request_that_does_not_fit_waits_then_completes(checkpoint: Path) -> None:
    scheduler = make_scheduler(checkpoint, slots=1)
    first, second = request("a", prompt_of(5), 6), request("b", prompt_of(6), 4)
    scheduler.add(first)
    scheduler.add(second)
    scheduler.step()
    assert len(scheduler.running) == 1 and list(scheduler.waiting) == [second]
    run_until_done(scheduler)
    assert len(first.sink.tokens) == 6 and len(second.sink.tokens) == 4
    assert scheduler.free_slots == [0]


def test_cancelled_request_frees_its_slot_for_the_next(checkpoint: Path) -> None:
    scheduler = make_scheduler(checkpoint, slots=1)
    long_one, waiting = request("long", prompt_of(5), 200), request("next", prompt_of(5), 3)
    scheduler.add(long_one)
    scheduler.add(waiting)
    for _ in range(3):
        scheduler.step()
    assert scheduler.running[0].request is long_one and list(scheduler.waiting) == [waiting]
    scheduler.cancel(long_one)
    scheduler.step()
    assert long_one.sink.finish is FinishReason.CANCELLED and len(long_one.sink.tokens) < 200
    assert scheduler.running[0].request is waiting
    run_until_done(scheduler)
    assert waiting.sink.finish is FinishReason.LENGTH and len(waiting.sink.tokens) == 3


def test_seeded_sampling_is_reproducible(checkpoint: Path, weights: Path | None) -> None:
    def sample_with(seed: int) -> list[int]:
        scheduler = make_scheduler(checkpoint, int8_weights=weights)
        params = SamplingParams(temperature=1.5, top_k=50, top_p=0.95, seed=seed)
        req = request("s", prompt_of(4), 20, sampling=params)
        scheduler.add(req)
        scheduler.add(request("noise", prompt_of(9), 20, sampling=SamplingParams(temperature=1.0, top_p=0.9)))
        run_until_done(scheduler)
        return req.sink.tokens

    assert sample_with(1234) == sample_with(1234)
    assert sample_with(1234) != sample_with(4321)


def test_end_id_stops_generation_without_emitting_it(checkpoint: Path) -> None:
    scheduler = make_scheduler(checkpoint)
    probe = request("p", prompt_of(8), 12)
    scheduler.add(probe)
    run_until_done(scheduler)
    end_id = probe.sink.tokens[3]
    expected = probe.sink.tokens[: probe.sink.tokens.index(end_id)]
    stopped = request("e", prompt_of(8), 12, end_id=end_id)
    scheduler.add(stopped)
    run_until_done(scheduler)
    assert stopped.sink.finish is FinishReason.END_ID
    assert stopped.sink.tokens == expected


def test_stop_words_end_generation(checkpoint: Path) -> None:
    scheduler = make_scheduler(checkpoint)
    probe = request("p", prompt_of(8), 12)
    scheduler.add(probe)
    run_until_done(scheduler)
    word = probe.sink.tokens[4:6]
    stopped = request("w", prompt_of(8), 12, stop_words=[word])
    scheduler.add(stopped)
    run_until_done(scheduler)
    assert stopped.sink.finish is FinishReason.STOP_WORDS
    assert stopped.sink.tokens[-2:] == word and len(stopped.sink.tokens) <= 6


@pytest.mark.parametrize("prompt,max_new,message", [
    ([], 4, "empty"),
    ([1, 2, 3], 0, "at least 1"),
    (list(range(1, 200)), 100, "max_seq_len"),
    ([1, VOCAB + 5], 4, "outside the vocabulary"),
])
def test_requests_that_can_never_run_are_refused_before_taking_a_slot(
        checkpoint: Path, prompt: list[int], max_new: int, message: str) -> None:
    scheduler = make_scheduler(checkpoint)
    with pytest.raises(RequestError, match=message):
        scheduler.add(request("bad", prompt, max_new))
    assert not scheduler.has_work and len(scheduler.free_slots) == 4


def test_logprobs_are_the_models_own_and_top_alternatives_are_sorted(checkpoint: Path) -> None:
    scheduler = make_scheduler(checkpoint)
    req = request("lp", prompt_of(6), 5, sampling=SamplingParams(top_k=1, top_logprobs=3))
    scheduler.add(req)
    run_until_done(scheduler)
    model = LlamaForCausalLM.from_pretrained(checkpoint)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_of(6) + req.sink.tokens])).logits[0, 5:-1]
    expected = torch.log_softmax(logits, dim=-1)
    for step, (token, logprob, top) in enumerate(zip(req.sink.tokens, req.sink.logprobs, req.sink.top)):
        assert abs(logprob - expected[step, token].item()) < 1e-4
        assert [t for t, _ in top] == torch.topk(expected[step], 3).indices.tolist()
        assert top[0][0] == token  # greedy picks the most likely token


def _step_s(decoding: int, prompt_tokens: int, per_prompt_token: float = 0.002) -> float:
    """A synthetic machine: 20 ms per step, 4 ms per decoding sequence, 2 ms per prompt token."""
    return 0.020 + 0.004 * decoding + per_prompt_token * prompt_tokens


def test_step_costs_interpolate_between_batch_sizes_seen() -> None:
    costs = StepCosts()
    assert costs.decode(8) is None
    for n in (4, 16):
        costs.observe(_step_s(n, 0), decode_tokens=n, prompt_tokens=0)
    assert costs.decode(8) == pytest.approx(_step_s(8, 0))
    assert costs.decode(24) == pytest.approx(_step_s(24, 0))  # extrapolated along the same line
    costs.observe(_step_s(8, 50), decode_tokens=8, prompt_tokens=50)
    assert costs.prompt_token_s == pytest.approx(0.002)


def test_prefill_budget_keeps_decode_steps_within_the_ratio() -> None:
    with pytest.raises(ValueError, match="cpu_prefill_step_ratio"):
        PrefillBudget(ratio=1.0)
    budget = PrefillBudget(ratio=2.0)
    assert budget.tokens(15, 1) == PrefillBudget.INITIAL_TOKENS  # nothing learned yet
    for n in (1, 8, 15, 16):
        budget.observe(_step_s(n, 0), decode_tokens=n, prefill_tokens=0)
    for _ in range(5):
        n = budget.tokens(15, 1)
        budget.observe(_step_s(15, n), decode_tokens=15, prefill_tokens=n)
    # One long prompt among 15 streams: steps take at most 2x a plain 16-sequence step.
    assert _step_s(15, budget.tokens(15, 1)) <= 2.0 * _step_s(16, 0) + 1e-9
    assert budget.tokens(15, 1) >= 0.9 * (2 * _step_s(16, 0) - _step_s(15, 0)) / 0.002
    # A burst of prompts behind one stream: read in chunks as big as the full batch's ratio allows,
    # not in slivers sized by the lone stream's own fast steps.
    assert budget.tokens(1, 15) > 3 * (2 * _step_s(1, 0) - _step_s(1, 0)) / 0.002
    assert _step_s(1, budget.tokens(1, 15)) <= 2.0 * _step_s(16, 0) + 1e-9
    budget.observe(_step_s(15, 10, per_prompt_token=0.2), decode_tokens=15, prefill_tokens=10)  # one outlier
    assert budget.tokens(15, 1) >= PrefillBudget.MIN_TOKENS
    for _ in range(20):
        n = budget.tokens(15, 1)
        budget.observe(_step_s(15, n), decode_tokens=15, prefill_tokens=n)
    assert _step_s(15, budget.tokens(15, 1)) / _step_s(16, 0) == pytest.approx(2.0, rel=0.1)  # recovered


def test_long_prompt_is_read_in_chunks_while_others_decode(checkpoint: Path) -> None:
    scheduler = make_scheduler(checkpoint, max_num_tokens=200)
    streaming = request("s", prompt_of(4), 60)
    scheduler.add(streaming)
    for _ in range(5):
        scheduler.step()
    long_one = request("long", prompt_of(180), 2)
    scheduler.add(long_one)
    chunk_steps = 0
    while long_one.sink.finish is None:
        before = len(streaming.sink.tokens)
        scheduler.step()
        assert len(streaming.sink.tokens) == before + 1  # the stream never stalls
        chunk_steps += 1
    assert chunk_steps >= 3  # 180 prompt tokens did not go in one step although max_num_tokens allowed it


def _draws(logits: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    rows = [SamplingRow(params, generator, [], [], []) for _ in range(n)]
    return torch.tensor([t.token for t in sample(logits.expand(n, -1).clone(), rows)])


def test_batched_sampler_draws_from_the_filtered_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    free = _draws(logits, SamplingParams(temperature=1.0, top_p=1.0, seed=0), 4000)
    freq = torch.bincount(free, minlength=4).float() / 4000
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03, rtol=0)
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_k=2), 500).tolist()) == {0, 1}
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_p=0.7), 500).tolist()) == {0, 1}
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_p=0.5), 500).tolist()) == {0}
    hot = torch.bincount(_draws(logits, SamplingParams(temperature=5.0, top_p=1.0), 4000), minlength=4)
    assert hot[3] > 600  # a high temperature flattens the distribution


def test_calibration_teaches_the_budget_step_costs_before_the_first_request(checkpoint: Path) -> None:
    scheduler = make_scheduler(checkpoint)
    costs = scheduler.prefill_budget.costs
    assert costs.decode(1) is None and costs.prompt_token_s is None
    scheduler.calibrate(context=16)
    assert set(costs.decode_step_s) == {1, 2, 4} and costs.prompt_token_s is not None
    greedy = request("g", prompt_of(10), 6)  # calibration's scratch K/V must not leak into requests
    scheduler.add(greedy)
    run_until_done(scheduler)
    fresh = make_scheduler(checkpoint)
    again = request("g", prompt_of(10), 6)
    fresh.add(again)
    run_until_done(fresh)
    assert greedy.sink.tokens == again.sink.tokens
    scheduler.add(request("busy", prompt_of(4), 2))
    with pytest.raises(RuntimeError, match="idle"):
        scheduler.calibrate()


def test_calibration_does_not_time_the_first_step_of_each_shape(checkpoint: Path) -> None:
    """A kernel's first call loads or compiles it: that is no step's cost, and calibration must not teach it
    to the budget. Here each shape's first forward takes 10 s of a fake clock, every later one 1 ms."""
    now = [0.0]
    runner = LlamaRunner(EngineConfig(checkpoint_dir=checkpoint, max_batch_size=4, max_seq_len=256,
                                      max_num_tokens=64))
    real_forward, seen = runner.forward, set()

    def forward(token_ids, decode_blocks, decode_positions, chunks, logits_rows):  # noqa: ANN001, ANN202
        shape = (len(decode_blocks), tuple(chunk.length for chunk in chunks))
        now[0] += 0.001 if shape in seen else 10.0
        seen.add(shape)
        return real_forward(token_ids, decode_blocks, decode_positions, chunks, logits_rows)

    runner.forward = forward
    scheduler = Scheduler(runner, 64, clock=lambda: now[0])
    scheduler.calibrate(context=16)
    costs = scheduler.prefill_budget.costs
    assert set(costs.decode_step_s) == {1, 2, 4} and max(costs.decode_step_s.values()) < 0.01
    assert costs.prompt_token_s is not None and costs.prompt_token_s < 0.01


def test_engine_loop_calls_after_step_between_steps(checkpoint: Path) -> None:
    """The Triton glue delivers a step's responses in `after_step`; each step's tokens must be out
    before the next step runs."""
    sent_at_flush: list[int] = []
    done = threading.Event()
    target = request("t", prompt_of(6), 5)

    def after_step() -> None:
        sent_at_flush.append(len(target.sink.tokens))
        if target.sink.finish is not None:
            done.set()

    engine = Engine(make_scheduler(checkpoint), after_step=after_step)
    engine.start()
    try:
        engine.submit(target)
        assert done.wait(60)
    finally:
        engine.stop()
    assert target.sink.finish is FinishReason.LENGTH
    assert sent_at_flush[:5] == [1, 2, 3, 4, 5]  # one flush after every step, none skipped


def test_engine_polls_cancellation_for_all_requests_at_once_and_cancels_by_identity(checkpoint: Path) -> None:
    """Two clients chose the same request id; the one that went away must not take the other with it."""
    polls: list[list[GenerationRequest]] = []
    victim, bystander = request("shared", prompt_of(5), 200), request("shared", prompt_of(7), 6)

    def cancelled(requests: list[GenerationRequest]) -> list[bool]:
        polls.append(list(requests))
        return [r is victim and len(victim.sink.tokens) >= 3 for r in requests]

    engine = Engine(make_scheduler(checkpoint), cancelled=cancelled, cancel_poll_s=0.0)
    engine.start()
    try:
        engine.submit(victim)
        engine.submit(bystander)
        assert victim.sink.done.wait(60) and bystander.sink.done.wait(60)
    finally:
        engine.stop()
    assert victim.sink.finish is FinishReason.CANCELLED and victim.sink.error is None
    assert 3 <= len(victim.sink.tokens) < 200
    assert bystander.sink.finish is FinishReason.LENGTH and len(bystander.sink.tokens) == 6
    assert any(len(poll) == 2 and poll[0] is victim and poll[1] is bystander for poll in polls)  # one call, both
    assert engine.scheduler.stats().cancelled_requests_total == 1


def test_cancel_by_identity_leaves_a_request_with_the_same_id_running(checkpoint: Path) -> None:
    scheduler = make_scheduler(checkpoint, slots=2)
    first, second = request("same", prompt_of(5), 50), request("same", prompt_of(6), 8)
    scheduler.add(first)
    scheduler.add(second)
    scheduler.step()
    scheduler.cancel(first)
    run_until_done(scheduler)
    assert first.sink.finish is FinishReason.CANCELLED and first.sink.error is None
    assert second.sink.finish is FinishReason.LENGTH and len(second.sink.tokens) == 8
    assert scheduler.free_slots == [0, 1]


def test_cancel_by_id_ends_every_request_with_that_id_with_an_error(checkpoint: Path) -> None:
    """The `stop` input comes from someone else: its targets must not end as if they had finished."""
    scheduler = make_scheduler(checkpoint, slots=2)
    running, waiting, other = (request("x", prompt_of(5), 50), request("x", prompt_of(6), 50),
                               request("y", prompt_of(7), 5))
    for r in (running, other, waiting):  # two slots: `waiting` waits behind the other two
        scheduler.add(r)
    scheduler.step()
    assert list(scheduler.waiting) == [waiting]
    assert scheduler.cancel_by_id("x") == 2
    later = request("x", prompt_of(4), 3)  # arrives after the stop: not its target
    scheduler.add(later)
    run_until_done(scheduler)
    for target in (running, waiting):
        assert target.sink.error == STOPPED_BY_ID and target.sink.finish is None
    assert other.sink.finish is FinishReason.LENGTH and len(other.sink.tokens) == 5
    assert later.sink.finish is FinishReason.LENGTH and later.sink.error is None
    assert scheduler.cancel_by_id("nobody") == 0


def test_cancelled_counter_counts_waiting_and_running_whatever_the_cause(checkpoint: Path) -> None:
    scheduler = make_scheduler(checkpoint, slots=1)
    running, waiting, stopped = (request("a", prompt_of(5), 50), request("b", prompt_of(5), 50),
                                 request("c", prompt_of(5), 50))
    for r in (running, waiting, stopped):
        scheduler.add(r)
    scheduler.step()
    assert scheduler.stats().cancelled_requests_total == 0
    scheduler.cancel(running)
    scheduler.cancel(waiting)
    scheduler.cancel_by_id("c")
    scheduler.step()
    assert scheduler.stats().cancelled_requests_total == 3
    assert not scheduler.has_work
    finished = request("d", prompt_of(5), 2)
    scheduler.add(finished)
    run_until_done(scheduler)
    scheduler.cancel(finished)  # too late: it already ended, nothing is counted
    scheduler.step()
    assert scheduler.stats().cancelled_requests_total == 3
    assert finished.sink.finish is FinishReason.LENGTH


def test_engine_cancel_by_id_goes_through_the_loop(checkpoint: Path) -> None:
    first_token, stop_sent = threading.Event(), threading.Event()
    target = request("stop-me", prompt_of(5), 200)

    def after_step() -> None:
        if target.sink.tokens and not first_token.is_set():
            first_token.set()
            stop_sent.wait(60)  # hold the loop so that the stop is in before the target can finish

    engine = Engine(make_scheduler(checkpoint), after_step=after_step)
    engine.start()
    try:
        engine.submit(target)
        assert first_token.wait(60)
        engine.cancel_by_id("stop-me")
        stop_sent.set()
        assert target.sink.done.wait(60)
    finally:
        engine.stop()
    assert target.sink.error == STOPPED_BY_ID and len(target.sink.tokens) == 1


class InjectedCrash(RuntimeError):
    pass


def test_engine_thread_failure_fails_every_open_request_and_refuses_new_ones(checkpoint: Path) -> None:
    """An exception outside scheduler.step() (here: in after_step) must not leave anything hanging: the
    running request, the waiting one and the one still in the inbox all get an error."""
    in_after_step, crash_now, failed = threading.Event(), threading.Event(), threading.Event()
    reasons: list[str] = []
    running, waiting, in_inbox = (request("r", prompt_of(5), 200), request("w", prompt_of(5), 200),
                                  request("i", prompt_of(5), 200))

    def after_step() -> None:
        if running.sink.tokens and not crash_now.is_set():
            in_after_step.set()
            crash_now.wait(60)  # the test fills the inbox meanwhile
            raise InjectedCrash("injected")

    def on_failure(reason: str) -> None:
        reasons.append(reason)
        failed.set()

    engine = Engine(make_scheduler(checkpoint, slots=1), after_step=after_step, on_failure=on_failure)
    engine.start()
    try:
        engine.submit(running)
        engine.submit(waiting)
        assert in_after_step.wait(60)
        engine.submit(in_inbox)  # the loop is held in after_step: this stays in the inbox
        crash_now.set()
        assert failed.wait(60)
        assert engine.join(60)  # the thread ended
        assert not engine.alive and "InjectedCrash: injected" in (engine.failure or "")
        assert reasons == [engine.failure]
        for r in (running, waiting, in_inbox):
            assert r.sink.done.is_set() and r.sink.finish is None
            assert r.sink.error is not None and "InjectedCrash: injected" in r.sink.error
        with pytest.raises(EngineFailedError, match="the engine has failed.*InjectedCrash"):
            engine.submit(request("late", prompt_of(5), 4))
        engine.cancel_by_id("r")  # nothing left to stop: no error either
    finally:
        engine.stop()


def test_engine_thread_failure_in_the_cancellation_poll_is_caught_too(checkpoint: Path) -> None:
    def cancelled(requests: list[GenerationRequest]) -> list[bool]:
        raise InjectedCrash("poll broke")

    failed = threading.Event()
    engine = Engine(make_scheduler(checkpoint), cancelled=cancelled, on_failure=lambda _: failed.set())
    assert not engine.alive  # not started yet
    engine.start()
    victim = request("v", prompt_of(5), 10)
    try:
        engine.submit(victim)
        assert failed.wait(60) and victim.sink.done.wait(60)
    finally:
        engine.stop()
    assert "poll broke" in (victim.sink.error or "") and not engine.alive
    with pytest.raises(RequestError):  # what model.py's execute() turns into an error response
        engine.submit(request("late", prompt_of(5), 4))


def test_scheduler_abort_ends_one_request_with_an_error(checkpoint: Path) -> None:
    scheduler = make_scheduler(checkpoint, slots=1)
    running, waiting = request("a", prompt_of(5), 50), request("b", prompt_of(5), 3)
    scheduler.add(running)
    scheduler.add(waiting)
    scheduler.step()
    assert scheduler.abort(running, "injected failure")
    assert running.sink.error == "injected failure" and scheduler.free_slots == [0]
    assert not scheduler.abort(running, "again")  # already gone
    run_until_done(scheduler)
    assert waiting.sink.finish is FinishReason.LENGTH


def test_engine_bench_measures_plain_steps_through_the_runner(checkpoint: Path) -> None:
    """benchmarks/engine_bench.py runs only by hand; this keeps its engine-side measurement in step with
    the runner's interface, and checks that it fills the cache it decodes against."""
    from benchmarks.engine_bench import runner_tokens_per_s

    runner = LlamaRunner(EngineConfig(checkpoint_dir=checkpoint, max_batch_size=4, max_seq_len=64))
    assert runner_tokens_per_s(runner, batch=3, steps=2) > 0
    # Sequence s holds blocks 3s..3s+2 (48 places); 32 prompt + 5 decode positions written in each.
    written = runner.k_cache.abs().sum(dim=(0, 2, 3)).gt(0)  # [places in the pool]
    per_sequence = written[:3 * 48].view(3, 48)
    assert bool(per_sequence[:, :37].all()) and not per_sequence[:, 37:].any()
    assert not written[3 * 48:].any()  # no other block was touched


def test_a_full_engine_queue_refuses_at_once(checkpoint: Path) -> None:
    from cpu_engine.engine import QueueFullError
    engine = Engine(make_scheduler(checkpoint, slots=4), max_queued=2)  # not started: nothing is taken in
    for name in "abcdef":  # 4 will take the free slots, 2 may wait
        engine.submit(request(name, prompt_of(3), 2))
    with pytest.raises(QueueFullError, match="queue is full"):
        engine.submit(request("g", prompt_of(3), 2))


def test_from_config_loads_and_calibrates_on_the_engine_thread(checkpoint: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    """Only the loop thread runs PyTorch's parallel ops (one OpenMP team: see Engine.start)."""
    import cpu_engine.engine as engine_module

    threads = []

    class RecordingRunner(LlamaRunner):
        def forward(self, *args, **kwargs):
            threads.append(threading.current_thread().name)
            return super().forward(*args, **kwargs)

        def __init__(self, config: EngineConfig) -> None:
            threads.append(threading.current_thread().name)
            super().__init__(config)

    monkeypatch.setattr(engine_module, "LlamaRunner", RecordingRunner)
    engine = Engine.from_config(EngineConfig(checkpoint_dir=checkpoint, max_batch_size=2, max_seq_len=64))
    assert engine.scheduler is None and not threads  # nothing loaded before start()
    engine.start()
    try:
        assert engine.scheduler.prefill_budget.costs.decode_step_s  # calibrated by the time start() returns
        assert set(threads) == {"cpu-engine"}
    finally:
        engine.stop()

    broken = Engine.from_config(EngineConfig(checkpoint_dir=tmp_path, max_batch_size=2, max_seq_len=64))
    with pytest.raises(RuntimeError, match="the CPU engine failed to start"):
        broken.start()  # no checkpoint there: the model fails to load, with the reason
    assert not broken.alive


@contextlib.contextmanager
def engine_on_cores(checkpoint: Path, monkeypatch: pytest.MonkeyPatch, cores: int,
                    runner_class: type[LlamaRunner], max_new_tokens: int):
    """An engine left to choose its threads (cpu_num_threads 0) on a machine of `cores` cores (what
    sched_getaffinity says), running `runner_class`, after it served one request to the end; stopped after."""
    import cpu_engine.engine as engine_module

    monkeypatch.setattr(engine_module, "LlamaRunner", runner_class)
    monkeypatch.setattr(engine_module.os, "sched_getaffinity", lambda pid: set(range(cores)))
    engine = Engine.from_config(EngineConfig(checkpoint_dir=checkpoint, max_batch_size=2, max_seq_len=64),
                                cancelled=lambda requests: [False] * len(requests))
    engine.start()
    try:
        sink = request("a", prompt_of(3), max_new_tokens)
        engine.submit(sink)
        assert sink.sink.done.wait(60) and sink.sink.error is None
        yield engine
    finally:
        engine.stop()


@pytest.mark.parametrize("cores, min_step_s, expected, why", [
    (2, 0.0, 1, "1 left to the frontend"),  # two cores: the team would be one thread anyway, no timing
    (4, 1e9, 1, "too small"),  # cores to spare, but the model's step is too small for a team
    (4, 0.0, 3, "1 of 4 cores left"),  # a team of all cores but the one left to the rest of the stack
])
def test_auto_threads_leave_a_core_to_the_stack_and_keep_small_models_on_one(
        checkpoint: Path, monkeypatch: pytest.MonkeyPatch, cores: int, min_step_s: float, expected: int,
        why: str) -> None:
    """cpu_num_threads 0: all cores but SERVING_CORES, and one thread for a model whose full-batch step is
    shorter than PARALLEL_MIN_STEP_S on one thread; every step then runs on that many threads, PyTorch and
    numba (the attention kernel's own OpenMP team) alike. The cores are what sched_getaffinity says."""
    import numba

    import cpu_engine.engine as engine_module

    seen = []

    class RecordingRunner(LlamaRunner):
        def forward(self, *args, **kwargs):
            seen.append((torch.get_num_threads(), numba.get_num_threads()))
            return super().forward(*args, **kwargs)

    monkeypatch.setattr(engine_module, "PARALLEL_MIN_STEP_S", min_step_s)
    with engine_on_cores(checkpoint, monkeypatch, cores, RecordingRunner, 2) as engine:
        # numba's team cannot grow past the threads it was started with (NUMBA_NUM_THREADS, this machine's cores)
        want = (expected, min(expected, numba.config.NUMBA_NUM_THREADS))
        assert seen[0] == (1, 1)  # the step that decides (when there is a choice) runs on one thread
        assert set(seen[4:]) == {want}  # calibration and the request's steps
        assert why in engine.thread_choice
        assert f"{expected} threads" in engine.describe()


@pytest.mark.parametrize("cores, min_step_s, expected", [
    (2, 0.0, 2),  # a long batch-1 step: our kernels on both cores, the rest of the step on one thread
    (2, 1e9, 1),  # a short one: everything on one thread
    (1, 0.0, 1),  # one core: nothing to split over
])
def test_auto_threads_put_our_kernels_on_every_core_where_a_batch_1_step_is_long(
        checkpoint: Path, monkeypatch: pytest.MonkeyPatch, restore_threads: None, cores: int, min_step_s: float,
        expected: int) -> None:
    """cpu_num_threads 0: our C kernels split each product over every core where a plain batch-1 decode step
    takes PARALLEL_MIN_STEP_S or more; the server log says so where one of our kernels runs."""
    import cpu_engine.engine as engine_module
    from cpu_engine import native

    monkeypatch.setattr(engine_module, "PARALLEL_MIN_STEP_S", min_step_s)
    with engine_on_cores(checkpoint, monkeypatch, cores, LlamaRunner, 2) as engine:
        assert engine.threads == 1 and engine.kernel_threads == expected and native._threads == expected
        ours = engine.scheduler.runner.lm_head.gemm is not None
        assert ("), on 2 threads; 1 threads" in engine.describe()) == (ours and expected == 2)


def test_a_kv_cache_dtype_the_engine_does_not_know_is_refused(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="cpu_kv_cache_dtype must be one of"):
        EngineConfig(checkpoint_dir=checkpoint, kv_cache_dtype="fp8")


def test_a_bfloat16_kv_cache_falls_back_to_float32_where_its_kernel_cannot_run(
        checkpoint: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """No C compiler or no AVX-512 (bfloat16_kernel None): the engine serves with a float32 cache and says why."""
    monkeypatch.setattr(paged_attention, "bfloat16_kernel", lambda: None)
    with caplog.at_level("WARNING", logger="cpu_engine.runner"):
        runner = LlamaRunner(EngineConfig(checkpoint_dir=checkpoint, max_batch_size=2, max_seq_len=64,
                                          kv_cache_dtype="bfloat16"))
    assert runner.k_cache.dtype == torch.float32 and runner.kv_dtype == torch.float32
    assert "the KV cache stays float32" in caplog.text


def test_the_decode_step_sets_and_restores_numbas_team_itself(request: pytest.FixtureRequest) -> None:
    """fused_step._team_size, what the one-call decode step switches attention's team with: it sets the calling
    thread's numba team as numba.set_num_threads does (numba's own setting reads it back) and returns the size
    before, so the step can put it back."""
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba's team has one thread here: there is no other size to switch to")

    @numba.njit
    def switch_and_back(threads):
        before = fused_step._team_size(threads)
        inside = numba.get_num_threads()
        fused_step._team_size(before)
        return before, inside, numba.get_num_threads()

    narrow = numba.get_num_threads()
    request.addfinalizer(lambda: numba.set_num_threads(narrow))
    numba.set_num_threads(1)
    assert switch_and_back(2) == (1, 2, 1)
    assert numba.get_num_threads() == 1


@pytest.mark.parametrize("min_kv_bytes, wide", [(0, True), (1 << 40, False)])
def test_long_context_decode_attention_uses_the_core_left_to_the_stack(
        checkpoint: Path, monkeypatch: pytest.MonkeyPatch, min_kv_bytes: int, wide: bool) -> None:
    """cpu_num_threads 0 on 2 cores: the step runs on one thread, but decode attention that reads at least
    WIDE_ATTENTION_MIN_KV_BYTES of K/V a layer runs on both cores (as many as numba's team has), and the
    thread's setting is back to one for everything after it. Attention runs in the layer loop (recorded: the
    thread's numba setting) or inside the decode step's one numba call (fused_step; recorded: the threads it is
    told to run attention on, where it sets numba's team itself)."""
    import numba

    import cpu_engine.runner as runner_module

    in_attention, at_forward = [], []

    def recording(real, threads_argument=None):
        def call(*args, **kwargs):
            in_attention.append(numba.get_num_threads() if threads_argument is None else args[threads_argument])
            return real(*args, **kwargs)
        return call

    class RecordingRunner(LlamaRunner):
        def forward(self, *args, **kwargs):
            at_forward.append(numba.get_num_threads())
            return super().forward(*args, **kwargs)

    monkeypatch.setattr(runner_module, "paged_decode_attention", recording(runner_module.paged_decode_attention))
    monkeypatch.setattr(fused_step, "decode_step", recording(fused_step.decode_step, threads_argument=12))
    monkeypatch.setattr(runner_module, "WIDE_ATTENTION_MIN_KV_BYTES", min_kv_bytes)
    with engine_on_cores(checkpoint, monkeypatch, 2, RecordingRunner, 4) as engine:
        both = min(2, numba.config.NUMBA_NUM_THREADS)  # numba's team cannot grow past NUMBA_NUM_THREADS
        assert engine.scheduler.runner.wide_attention_threads == (both if both > 1 else 0)
        assert ("long contexts on" in engine.describe()) == (both > 1)
        assert in_attention and set(in_attention) == {both if wide else 1}
        assert set(at_forward) == {1}  # every step starts on one thread: the wide setting does not leak


def test_channel_polls_in_parts_and_answers_in_request_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """TritonChannel (model_repository/tensorrt_llm/1/model.py) makes a poll's round trips in a few parts of
    POLL_CHUNK requests or more, each on one thread, and answers in the order of the requests."""
    pb_utils = types.ModuleType("triton_python_backend_utils")
    pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb_utils)
    path = Path(__file__).resolve().parents[2] / "model_repository" / "tensorrt_llm" / "1" / "model.py"
    spec = importlib.util.spec_from_file_location("cpu_engine_glue_poll_under_test", path)
    glue = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(glue)

    threads: dict[int, str] = {}

    class Sender:
        def __init__(self, index: int) -> None:
            self.index = index

        def is_cancelled(self) -> bool:
            threads[self.index] = threading.current_thread().name
            return self.index % 3 == 0

    channel = glue.TritonChannel()
    try:
        for count in (1, 2 * channel.POLL_CHUNK - 1, 5 * channel.POLL_CHUNK + 7):
            threads.clear()
            polled = [types.SimpleNamespace(sink=types.SimpleNamespace(sender=Sender(i))) for i in range(count)]
            assert channel.cancelled(polled) == [i % 3 == 0 for i in range(count)]
            names = set(threads.values())
            if count < 2 * channel.POLL_CHUNK:  # one part: on the calling thread (the engine's poll helper)
                assert names == {threading.current_thread().name}
            else:
                assert threading.current_thread().name not in names
                assert len(names) <= count // channel.POLL_CHUNK
    finally:
        channel.close()


def test_the_rotary_tables_hold_the_bits_the_checkpoints_module_computes(checkpoint: Path) -> None:
    """LlamaRunner keeps cos and sin' of every position, computed once: each position's row must be what the
    module computes for it among any other positions (a step looks rows up instead of calling the module)."""
    runner = LlamaRunner(EngineConfig(checkpoint_dir=checkpoint, max_batch_size=2, max_seq_len=256))
    assert runner._rotary_tables is not None
    for positions in ([0], [5, 3], list(range(100, 140)), [255, 1, 77]):
        pos = torch.tensor(positions)
        for table, computed in zip(runner._rotary_tables, runner.rotary_of(pos), strict=True):
            assert torch.equal(table.index_select(0, pos), computed)
