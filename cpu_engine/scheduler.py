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


class PrefillBudget:
    """How many prompt tokens a step may read while other sequences are decoding.

    A feedback controller on what matters, the decoding streams' inter-token latency: after each step
    that read prompt tokens while others decoded, compare its time with a plain decode step of about as
    many sequences (moving averages per batch size). Over `ratio`, shrink the budget in proportion; with
    room to spare, or with no comparable plain step seen yet (busy servers rarely run one), grow by a
    quarter. It learns whatever machine and model it runs on, and one noisy step moves it one step's worth.
    """

    INITIAL_TOKENS = 32
    MIN_TOKENS = 8
    GROWTH = 1.25
    SMOOTHING = 0.2

    def __init__(self, ratio: float):
        self.ratio = ratio
        self.decode_step_s: dict[int, float] = {}  # decoding sequences -> plain step time
        self.budget = self.INITIAL_TOKENS

    def baseline(self, decode_tokens: int) -> float | None:
        """A plain step's time for about this many sequences; a much smaller batch would understate it."""
        known = [n for n in self.decode_step_s if n >= 0.75 * decode_tokens]
        if not known:
            return None
        return self.decode_step_s[min(known, key=lambda n: abs(n - decode_tokens))]

    def observe(self, seconds: float, decode_tokens: int, prefill_tokens: int) -> None:
        if not decode_tokens:
            return
        if prefill_tokens == 0:
            old = self.decode_step_s.get(decode_tokens)
            self.decode_step_s[decode_tokens] = seconds if old is None else old + self.SMOOTHING * (seconds - old)
            return
        baseline = self.baseline(decode_tokens)
        slowdown = seconds / baseline if baseline else 0.0
        if slowdown > self.ratio:
            self.budget = max(self.MIN_TOKENS, int(prefill_tokens * self.ratio / slowdown))
        elif prefill_tokens >= self.budget and slowdown * self.GROWTH <= self.ratio:  # room to grow
            self.budget = int(self.budget * self.GROWTH) + 1

    def tokens(self) -> int:
        return self.budget


class Scheduler:
    def __init__(self, runner: Forward, max_num_tokens: int, prefill_step_ratio: float = 2.0,
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
            budget = min(budget, self.prefill_budget.tokens())
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
            started = self._clock()
            logits = self.runner.forward(token_ids, decode_slots, decode_positions, chunks, logits_rows)
            self.prefill_budget.observe(self._clock() - started, len(decode),
                                        sum(chunk.length for chunk in chunks))
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
