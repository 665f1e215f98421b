"""In-flight batching: which sequences run in the next step, and what happens to them after it.

Pure engine logic with no Triton in it, so tests drive it step by step. Requests wait in a FIFO queue
and take a KV-cache slot when one is free; a request that could never fit (prompt + output over
max_seq_len) is refused before it takes one. Each step decodes one token for every sequence past its
prompt and spends the rest of the `max_num_tokens` budget on prompt chunks (less while others decode:
see PrefillBudget), so a long prompt is read a chunk at a time while the other streams keep producing
tokens. Finished and cancelled sequences leave at the end of the step and their slot is free for the next
one.
"""

from __future__ import annotations

import enum
import itertools
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from cpu_engine.runner import Chunk
from cpu_engine.sampling import SampledToken, SamplingParams, SamplingRow, sample


class FinishReason(str, enum.Enum):
    END_ID = "end_id"
    STOP_WORDS = "stop_words"
    LENGTH = "length"
    CANCELLED = "cancelled"


class ResponseSink(Protocol):
    """Where a sequence's results go (a Triton response sender in production, a list in tests)."""

    def send(self, tokens: list[SampledToken], finish: FinishReason | None) -> None: ...

    def send_error(self, message: str) -> None: ...


class Forward(Protocol):
    vocab_size: int
    max_seq_len: int
    num_slots: int

    def forward(self, token_ids: list[int], decode_slots: list[int], decode_positions: list[int],
                chunks: list[Chunk], logits_rows: list[int]) -> torch.Tensor: ...


class RequestError(ValueError):
    """A request the engine refuses; the message goes back to the client as is."""


@dataclass
class GenerationRequest:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    sink: ResponseSink
    sampling: SamplingParams = field(default_factory=SamplingParams)
    end_id: int | None = None
    stop_words: list[list[int]] = field(default_factory=list)


@dataclass
class Sequence:
    request: GenerationRequest
    slot: int
    generator: torch.Generator | None
    output: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the slot
    cancelled: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt + self.output

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < len(self.request.prompt)


@dataclass(frozen=True)
class EngineStats:
    """What a user watching the engine wants to know (exported as Triton custom metrics)."""

    active_slots: int
    max_slots: int
    queued_requests: int
    kv_cache_used_tokens: int
    kv_cache_capacity_tokens: int
    last_step_tokens: int
    steps_total: int
    prompt_tokens_total: int
    generated_tokens_total: int


class StepCosts:
    """What a step costs on this machine, learned from the steps the engine runs (moving averages).

    A step's time is modelled as a plain decode step of its decoding sequences (measured per batch size,
    interpolated between sizes seen) plus a cost per prompt token read in the same step (learned from
    mixed steps as their time beyond that decode step, per prompt token).
    """

    SMOOTHING = 0.2

    def __init__(self) -> None:
        self.decode_step_s: dict[int, float] = {}  # decoding sequences -> plain step time
        self.prompt_token_s: float | None = None

    def decode(self, sequences: int) -> float | None:
        """A plain decode step of `sequences`: measured, else interpolated or extrapolated linearly."""
        if sequences in self.decode_step_s:
            return self.decode_step_s[sequences]
        sizes = sorted(self.decode_step_s)
        if not sizes:
            return None
        if len(sizes) == 1:
            return self.decode_step_s[sizes[0]]
        below = [n for n in sizes if n < sequences]
        above = [n for n in sizes if n > sequences]
        lo, hi = (below[-1], above[0]) if below and above else (sizes[-2], sizes[-1]) if below else sizes[:2]
        slope = (self.decode_step_s[hi] - self.decode_step_s[lo]) / (hi - lo)
        return max(self.decode_step_s[lo] + slope * (sequences - lo), min(self.decode_step_s.values()))

    def observe(self, seconds: float, decode_tokens: int, prompt_tokens: int) -> None:
        if not decode_tokens:  # prompt-only steps are not the regime the budget is for
            return
        if prompt_tokens == 0:
            old = self.decode_step_s.get(decode_tokens)
            self.decode_step_s[decode_tokens] = seconds if old is None else _smooth(old, seconds, self.SMOOTHING)
            return
        base = self.decode(decode_tokens)
        if base is None:
            return
        per_token = max(seconds - base, 0.0) / prompt_tokens
        old = self.prompt_token_s
        if not old:
            self.prompt_token_s = per_token
        else:  # symmetric: with few prompt tokens a step's excess is mostly noise, so the samples are
            # noisy both ways; one stalled step (a shared machine has them) raises it by a fifth at most
            self.prompt_token_s = _smooth(old, min(per_token, old * 2), self.SMOOTHING)


UNLIMITED = 1 << 30


def _smooth(old: float, new: float, weight: float) -> float:
    return old + weight * (new - old)


class PrefillBudget:
    """How many prompt tokens a step may read while other sequences are decoding.

    A step may take up to `ratio` times a plain decode step of the batch being filled (the decoding
    sequences plus those still reading their prompts), and the prompt tokens it reads are whatever fits
    in that time by the learned step costs. One long prompt arriving among 15 streams: their tokens come
    at most `ratio` times slower while it is read. Sixteen prompts arriving at once: the first streams out
    decode no slower than `ratio` times the full batch will, and the rest of the prompts are read in a few
    large chunks instead of trickling in behind them. A ratio r slows streams to 1/r of their speed at
    worst and reads a prompt at (r-1)/r of the machine's speed at worst: r = 2 would charge both sides the
    same; the default 1.75 (`cpu_prefill_step_ratio` in config.pbtxt) keeps room for what the estimate
    misses (a long prompt's later chunks attend to more keys than the earlier ones it learned from, and a
    shared machine stalls now and then).
    Until the costs are known it reads INITIAL_TOKENS per step.
    """

    INITIAL_TOKENS = 32
    MIN_TOKENS = 8

    def __init__(self, ratio: float):
        if not ratio > 1:
            raise ValueError(f"cpu_prefill_step_ratio must be above 1 (a step with prompt tokens takes longer "
                             f"than a plain one), got {ratio}")
        self.ratio = ratio
        self.costs = StepCosts()

    def observe(self, seconds: float, decode_tokens: int, prefill_tokens: int) -> None:
        self.costs.observe(seconds, decode_tokens, prefill_tokens)

    def tokens(self, decoding: int, prefilling: int) -> int:
        now = self.costs.decode(decoding)
        full = self.costs.decode(decoding + prefilling)
        per_token = self.costs.prompt_token_s
        if now is None or full is None or per_token is None:
            return self.INITIAL_TOKENS
        # A batch size last measured at shorter contexts can look cheaper than the current one.
        spare = self.ratio * max(full, now) - now
        if per_token == 0:  # prompt tokens too cheap to measure: max_num_tokens is the only limit
            return UNLIMITED
        return max(self.MIN_TOKENS, int(spare / per_token))


class Scheduler:
    def __init__(self, runner: Forward, max_num_tokens: int, prefill_step_ratio: float = 1.75,
                 clock: Callable[[], float] = time.perf_counter):
        self.runner = runner
        self.max_num_tokens = max(max_num_tokens, 1)
        self.prefill_budget = PrefillBudget(prefill_step_ratio)
        self._clock = clock
        self.waiting: deque[GenerationRequest] = deque()
        self.running: list[Sequence] = []
        self.free_slots: list[int] = list(range(runner.num_slots))
        self._cancel_ids: set[str] = set()
        self._seed_source = random.Random()
        self.steps = 0
        self.last_step_tokens = 0
        self.prompt_tokens_total = 0
        self.generated_tokens_total = 0

    def calibrate(self, context: int = 64, repeats: int = 2) -> None:
        """Time plain decode steps at a few batch sizes and one mixed step, so the prefill budget is right
        from the first busy step (a burst onto an idle engine never runs a plain step to learn from).

        Runs on the empty cache before any request: the slots hold zeros, which cost the same to attend
        to as real keys, and each request overwrites its slot from position 0.
        """
        if self.running or self.waiting:
            raise RuntimeError("calibrate() runs on an idle engine only")
        context = min(context, self.runner.max_seq_len - 1)
        sizes = sorted({min(n, self.runner.num_slots) for n in (1, 2, 4, 8, 16, 32, self.runner.num_slots)})
        mixed = sizes[-1] // 2  # a half-full batch decoding (slots from 0) while the last slot reads a chunk
        chunk = Chunk(slot=sizes[-1] - 1, start=0, length=min(context, self.max_num_tokens))
        for _ in range(repeats):
            for n in sizes:
                self._timed_forward([1] * n, list(range(n)), [context] * n, [])
            if mixed:
                self._timed_forward([1] * (mixed + chunk.length), list(range(mixed)), [context] * mixed, [chunk])

    def _timed_forward(self, token_ids: list[int], decode_slots: list[int], decode_positions: list[int],
                       chunks: list[Chunk], logits_rows: list[int] | None = None) -> torch.Tensor:
        """One forward pass; its time teaches the prefill budget what steps cost."""
        rows = list(range(len(decode_slots))) if logits_rows is None else logits_rows
        started = self._clock()
        logits = self.runner.forward(token_ids, decode_slots, decode_positions, chunks, rows)
        self.prefill_budget.observe(self._clock() - started, len(decode_slots),
                                    sum(chunk.length for chunk in chunks))
        return logits

    # ----- admission -----------------------------------------------------------------------------
    def validate(self, request: GenerationRequest) -> None:
        prompt_len = len(request.prompt)
        if prompt_len == 0:
            raise RequestError("input_ids is empty: the prompt needs at least one token")
        if request.max_new_tokens < 1:
            raise RequestError(f"request_output_len must be at least 1, got {request.max_new_tokens}")
        if prompt_len + request.max_new_tokens > self.runner.max_seq_len:
            raise RequestError(
                f"prompt length ({prompt_len}) + request_output_len ({request.max_new_tokens}) exceeds "
                f"the engine's max_seq_len ({self.runner.max_seq_len})")
        vocab = self.runner.vocab_size
        bad = next((t for t in request.prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"input_ids holds token id {bad}, outside the vocabulary [0, {vocab})")
        if request.end_id is not None and not 0 <= request.end_id < vocab:
            request.end_id = None  # an out-of-vocabulary end_id can never be produced

    def add(self, request: GenerationRequest) -> None:
        """Queue a request; raises RequestError (before it takes anything) if it can never run."""
        self.validate(request)
        self.waiting.append(request)

    def cancel(self, request_id: str) -> None:
        """Mark a request to leave at the next step boundary, whether waiting or running."""
        self._cancel_ids.add(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(
            active_slots=len(self.running),
            max_slots=self.runner.num_slots,
            queued_requests=len(self.waiting),
            kv_cache_used_tokens=sum(s.num_cached for s in self.running),
            kv_cache_capacity_tokens=self.runner.num_slots * self.runner.max_seq_len,
            last_step_tokens=self.last_step_tokens,
            steps_total=self.steps,
            prompt_tokens_total=self.prompt_tokens_total,
            generated_tokens_total=self.generated_tokens_total,
        )

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting and self.free_slots:
            request = self.waiting.popleft()
            seed = request.sampling.seed
            generator = None
            if not request.sampling.greedy:
                generator = torch.Generator().manual_seed(
                    seed if seed is not None else self._seed_source.getrandbits(63))
            self.running.append(Sequence(request, self.free_slots.pop(0), generator))

    def _drop_cancelled(self) -> None:
        if not self._cancel_ids:
            return
        ids = self._cancel_ids
        kept_waiting = deque()
        for request in self.waiting:
            if request.request_id in ids:
                request.sink.send([], FinishReason.CANCELLED)
            else:
                kept_waiting.append(request)
        self.waiting = kept_waiting
        for seq in self.running:
            if seq.request.request_id in ids:
                seq.cancelled = True
        self._finish([s for s in self.running if s.cancelled], FinishReason.CANCELLED)
        self._cancel_ids = set()

    def _release(self, seq: Sequence) -> None:
        """Take a sequence out of the batch; its slot goes back to the pool (lowest first)."""
        self.running.remove(seq)
        self.free_slots.append(seq.slot)
        self.free_slots.sort()

    def _finish(self, sequences: list[Sequence], reason: FinishReason) -> None:
        for seq in sequences:
            self._release(seq)
            seq.request.sink.send([], reason)

    # ----- one step --------------------------------------------------------------------------------
    def step(self) -> None:
        """Admit, run one forward pass for every active sequence, sample, emit, retire."""
        self._drop_cancelled()
        self._admit()
        if not self.running:
            return
        decode = sorted((s for s in self.running if not s.in_prefill), key=lambda s: s.slot)
        budget = self.max_num_tokens - len(decode)
        if decode:  # others are streaming: read prompts only as fast as keeps their latency steady
            budget = min(budget, self.prefill_budget.tokens(len(decode), len(self.running) - len(decode)))
        token_ids = [s.tokens[-1] for s in decode]
        decode_slots = [s.slot for s in decode]
        decode_positions = [s.num_cached for s in decode]
        chunks: list[Chunk] = []
        chunk_seqs: list[Sequence] = []
        for seq in self.running:
            if not seq.in_prefill or budget <= 0:
                continue
            prompt = seq.request.prompt
            length = min(budget, len(prompt) - seq.num_cached)
            chunks.append(Chunk(seq.slot, seq.num_cached, length))
            chunk_seqs.append(seq)
            token_ids.extend(prompt[seq.num_cached:seq.num_cached + length])
            budget -= length

        # Rows whose last logit picks a token: every decode token, and each chunk that ends its prompt.
        sampled: list[Sequence] = list(decode)
        logits_rows = list(range(len(decode)))
        row = len(decode)
        for seq, chunk in zip(chunk_seqs, chunks):
            row += chunk.length
            if chunk.start + chunk.length == len(seq.request.prompt):
                sampled.append(seq)
                logits_rows.append(row - 1)

        try:
            logits = self._timed_forward(token_ids, decode_slots, decode_positions, chunks, logits_rows)
            for seq in decode:
                seq.num_cached += 1
            for seq, chunk in zip(chunk_seqs, chunks):
                seq.num_cached += chunk.length
            if sampled:
                results = sample(logits, [self._sampling_row(s) for s in sampled])
        except Exception as exc:  # a failed step must not take the engine down with it
            for seq in list(self.running):
                self._release(seq)
                seq.request.sink.send_error(f"engine step failed: {type(exc).__name__}: {exc}")
            return
        self.steps += 1
        self.last_step_tokens = len(token_ids)
        self.prompt_tokens_total += sum(chunk.length for chunk in chunks)
        self.generated_tokens_total += len(sampled)
        if sampled:
            self._emit(sampled, results)

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        request = seq.request
        banned: list[int] = []
        if request.end_id is not None and len(seq.output) < request.sampling.min_tokens:
            banned.append(request.end_id)
        for word in request.sampling.bad_words:
            if len(word) == 1 or (len(word) > 1 and seq.tokens[-(len(word) - 1):] == word[:-1]):
                banned.append(word[-1])
        return SamplingRow(request.sampling, seq.generator, request.prompt, seq.output, banned)

    def _emit(self, sampled: list[Sequence], results: list[SampledToken]) -> None:
        for seq, result in zip(sampled, results):
            request = seq.request
            if result.token == request.end_id:
                self._finish([seq], FinishReason.END_ID)
                continue
            seq.output.append(result.token)
            reason = None
            if any(seq.output[-len(w):] == w for w in request.stop_words if w):
                reason = FinishReason.STOP_WORDS
            elif len(seq.output) >= request.max_new_tokens:
                reason = FinishReason.LENGTH
            if reason is not None:
                self._release(seq)
            request.sink.send([result], reason)


_ids = itertools.count()


def new_request_id() -> str:
    """An id for requests that arrive without one (raw Triton clients need not set it)."""
    return f"anon-{next(_ids)}"
