"""In-flight batching: which sequences run in the next step, and what happens to them after it.

Pure engine logic with no Triton in it, so tests drive it step by step. Requests wait in a FIFO queue
and join the batch when a batch row (`slot`, up to max_batch_size) is free and the KV-cache pool has the
blocks for their prompt; a request that could never fit (prompt + output over max_seq_len, or over the
whole pool) is refused before it takes anything. Each step decodes one token for every sequence past its
prompt and spends the rest of the `max_num_tokens` budget on prompt chunks (less while others decode:
see PrefillBudget), so a long prompt is read a chunk at a time while the other streams keep producing
tokens. Finished and cancelled sequences leave at the end of the step and their row and blocks are free
for the next one.

KV memory (cpu_engine.kv_blocks): a sequence holds the blocks its tokens fill, one more each time its
decoding crosses a block boundary. A new prompt first looks up its full blocks by content in the prefix
cache (blocks that earlier or running requests filled with the same tokens) and reads only what it does
not find. When decoding needs a block and none is free, the most recently admitted sequence is preempted
(vLLM's recompute preemption): it gives its blocks back and waits at the head of the queue with what it
has generated, and when it returns it reads its prompt and output again (mostly from the prefix cache,
where its own blocks stay until evicted) and goes on where it was, with the same sampler state. Its
client sees only a pause.

Cancellation comes in two kinds, because request ids are labels chosen by clients and need not be unique:
`cancel(request)` ends exactly that request (its client went away: it ends like any other request, with a
final response nobody reads), while `cancel_by_id(request_id)` is TensorRT-LLM's `stop` input, sent by
someone else, and ends every request with that id with an error, so that its client never mistakes the
early end for a normal one.

Guided decoding (a request with a `guide`, see cpu_engine.guided): the sequence's grammar matcher writes the
tokens it may take next into its slot's bitmask row when it joins and after every token it accepts; a step
hands the rows of its guided sequences to the sampler, which masks their logits before sampling. A
sequence whose grammar can only end there ends at once (END_ID, without another step). Steps without a
guided sequence do none of this.
"""

from __future__ import annotations

import enum
import itertools
import logging
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from cpu_engine.kv_blocks import BlockKey, BlockPool, block_key, block_keys
from cpu_engine.lora import LoraAdapter, LoraBatch
from cpu_engine.runner import Chunk
from cpu_engine.sampling import SampledToken, SamplingParams, SamplingRow, sample
from cpu_engine.types import GuideStatus, RequestError

if TYPE_CHECKING:  # cpu_engine.guided imports xgrammar: only loaded once a guided request arrives
    from cpu_engine.guided import CompiledGuide, GuideMasks, GuideState

log = logging.getLogger(__name__)


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
    dtype_name: str  # compute dtype, and weight format (cpu_engine.config): for the server log
    weights: str
    vocab_size: int
    max_seq_len: int
    max_batch_size: int
    num_blocks: int
    block_size: int

    def forward(self, token_ids: list[int], decode_blocks: list[list[int]], decode_positions: list[int],
                chunks: list[Chunk], logits_rows: list[int]) -> torch.Tensor: ...


STOPPED_BY_ID = "the request was cancelled by a stop request"
NO_ALLOWED_TOKEN = "guided decoding: the grammar allows no token of the vocabulary here and cannot end"


@dataclass
class GenerationRequest:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    sink: ResponseSink
    sampling: SamplingParams = field(default_factory=SamplingParams)
    end_id: int | None = None
    stop_words: list[list[int]] = field(default_factory=list)
    guide: CompiledGuide | None = None  # guided decoding (cpu_engine.guided), compiled before submission
    lora: LoraAdapter | None = None  # its LoRA adapter (cpu_engine.lora); None: the base model


@dataclass(eq=False)  # compared by identity: the batch's lists find and remove exactly this one
class Sequence:
    request: GenerationRequest
    generator: torch.Generator | None
    slot: int = -1  # its batch row while running (its guided-decoding mask row)
    output: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in its blocks
    prefill_target: int = 0  # tokens to read before the next sample: the prompt, or prompt + output on resuming
    blocks: list[int] = field(default_factory=list)  # its block table
    keys: list[BlockKey] = field(default_factory=list)  # the content keys of its first full blocks
    guide: GuideState | None = None  # the grammar matcher of a guided request; its mask row is the slot's

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt + self.output

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < self.prefill_target


@dataclass(frozen=True)
class EngineStats:
    """What a user watching the engine wants to know (exported as Triton custom metrics)."""

    active_slots: int
    max_slots: int
    queued_requests: int
    kv_cache_used_tokens: int
    kv_cache_capacity_tokens: int
    kv_cache_blocks_used: int  # held by running sequences (shared blocks count once)
    kv_cache_blocks_total: int
    prefix_cache_queries_tokens_total: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits_tokens_total: int  # of those, found (their prefill skipped)
    preemptions_total: int
    last_step_tokens: int
    steps_total: int
    prompt_tokens_total: int
    generated_tokens_total: int
    cancelled_requests_total: int  # ended cancelled, waiting or running, whatever the cause
    running_lora_adapters: tuple[int, ...] = ()  # LoRA task ids of running requests (vllm:lora_requests_info)
    waiting_lora_adapters: tuple[int, ...] = ()

    @property
    def requests_running(self) -> int:
        return self.active_slots

    @property
    def requests_waiting(self) -> int:
        return self.queued_requests

    @property
    def kv_cache_usage_ratio(self) -> float:
        return self.kv_cache_blocks_used / self.kv_cache_blocks_total if self.kv_cache_blocks_total else 0.0


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
                 clock: Callable[[], float] = time.perf_counter, enable_prefix_reuse: bool = True):
        self.runner = runner
        self.max_num_tokens = max(max_num_tokens, 1)
        self.prefill_budget = PrefillBudget(prefill_step_ratio)
        self._clock = clock
        self.waiting: deque[GenerationRequest] = deque()
        self.preempted: deque[Sequence] = deque()  # resume before anything in `waiting`, oldest first
        self.running: list[Sequence] = []  # in the order they were admitted
        self.free_slots: list[int] = list(range(runner.max_batch_size))
        self.blocks = BlockPool(runner.num_blocks, runner.block_size, enable_prefix_reuse)
        # id(request) -> (request, error message or None for a plain cancelled end); holding the request
        # keeps its id from being reused before the mark is consumed at the next step boundary.
        self._cancel_marks: dict[int, tuple[GenerationRequest, str | None]] = {}
        self._seed_source = random.Random()
        self._guide_masks: GuideMasks | None = None  # one bitmask row per slot, made for the first guided request
        self._guided = 0  # running guided sequences: steps without any skip the guided path entirely
        self.steps = 0
        self.last_step_tokens = 0
        self.prompt_tokens_total = 0
        self.generated_tokens_total = 0
        self.cancelled_requests_total = 0
        self.prefix_cache_queries_tokens_total = 0
        self.prefix_cache_hits_tokens_total = 0
        self.preemptions_total = 0

    def calibrate(self, context: int = 64, repeats: int = 2) -> None:
        """Time plain decode steps at a few batch sizes and one mixed step, so the prefill budget is right
        from the first busy step (a burst onto an idle engine never runs a plain step to learn from).

        Runs before any request, on blocks no sequence holds: what it writes there is never read (a
        sequence reads only positions it wrote or blocks the prefix cache registered).
        """
        context, tables = self._calibration_tables(context)
        max_batch = self.runner.max_batch_size
        sizes = sorted({min(n, max_batch) for n in (1, 2, 4, 8, 16, 32, max_batch)})
        mixed = sizes[-1] // 2  # a half-full batch decoding while the last row reads a chunk
        chunk = Chunk(tables[sizes[-1] - 1], start=0, length=min(context, self.max_num_tokens))
        # Round 0 is not learned: a kernel's first call in a process loads it from numba's cache or compiles
        # it, which was learned as the step's cost (seen: 0.27-7.6 s for a batch-1 step of ~4 ms).
        for round_ in range(1 + repeats):
            for n in sizes:
                self._timed_forward([1] * n, tables[:n], [context] * n, [], learn=round_ > 0)
            if mixed:
                self._timed_forward([1] * (mixed + chunk.length), tables[:mixed], [context] * mixed, [chunk],
                                    learn=round_ > 0)

    def _calibration_tables(self, context: int) -> tuple[int, list[list[int]]]:
        """The context and one block table per batch row that calibration steps decode at (blocks no sequence
        holds: calibration runs on an idle engine only)."""
        if self.running or self.waiting:
            raise RuntimeError("calibrate() runs on an idle engine only")
        context = min(context, self.runner.max_seq_len - 1)
        per_row = -(-(context + 1) // self.runner.block_size)
        return context, [[(row * per_row + i) % self.runner.num_blocks for i in range(per_row)]
                         for row in range(self.runner.max_batch_size)]

    def plain_step_s(self, context: int = 64, repeats: int = 3, batch: int = 0) -> float:
        """The median time of a plain decode step of `batch` sequences (0: a full batch; after one step not
        timed), not learned by the prefill budget: how the engine tells a model too small for more than one
        thread (Engine)."""
        context, tables = self._calibration_tables(context)
        tables = tables[:batch] if batch else tables
        batch = len(tables)
        times = []
        for _ in range(repeats + 1):
            started = self._clock()
            self.runner.forward([1] * batch, tables, [context] * batch, [], list(range(batch)))
            times.append(self._clock() - started)
        return statistics.median(times[1:])

    def _timed_forward(self, token_ids: list[int], decode_blocks: list[list[int]], decode_positions: list[int],
                       chunks: list[Chunk], logits_rows: list[int] | None = None, learn: bool = True,
                       lora: LoraBatch | None = None) -> torch.Tensor:
        """One forward pass; its time teaches the prefill budget what steps cost (unless not `learn`)."""
        rows = list(range(len(decode_blocks))) if logits_rows is None else logits_rows
        started = self._clock()
        extra = {"lora": lora} if lora is not None else {}  # runners without adapters (test doubles) take none
        logits = self.runner.forward(token_ids, decode_blocks, decode_positions, chunks, rows, **extra)
        if learn:
            self.prefill_budget.observe(self._clock() - started, len(decode_blocks),
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
        block_size = self.runner.block_size
        # Its last token is sampled, never read back: it needs no place in the cache.
        needed = -(-(prompt_len + request.max_new_tokens - 1) // block_size)
        if needed > self.blocks.num_blocks:
            raise RequestError(
                f"prompt length ({prompt_len}) + request_output_len ({request.max_new_tokens}) exceeds "
                f"the engine's KV cache: it needs {needed} blocks of {block_size} tokens and the cache has "
                f"{self.blocks.num_blocks} (cpu_kv_cache_tokens)")
        vocab = self.runner.vocab_size
        bad = next((t for t in request.prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"input_ids holds token id {bad}, outside the vocabulary [0, {vocab})")
        if request.end_id is not None and not 0 <= request.end_id < vocab:
            request.end_id = None  # an out-of-vocabulary end_id can never be produced
        if request.guide is not None and request.guide.vocab_size != vocab:
            raise RequestError(f"the guide was compiled for a vocabulary of {request.guide.vocab_size} tokens, "
                               f"the model has {vocab}")

    def add(self, request: GenerationRequest) -> None:
        """Queue a request; raises RequestError (before it takes anything) if it can never run."""
        self.validate(request)
        self.waiting.append(request)

    def cancel(self, request: GenerationRequest) -> None:
        """Mark exactly this request (by identity, never by id: ids are client labels and may repeat) to
        leave at the next step boundary, whether waiting or running; it ends with a plain CANCELLED final
        response. For a request whose own client went away."""
        self._cancel_marks.setdefault(id(request), (request, None))

    def cancel_by_id(self, request_id: str, message: str = STOPPED_BY_ID) -> int:
        """TensorRT-LLM's `stop` input: every request now waiting or running with this id leaves at the
        next step boundary with an error response carrying `message` (its client is still there and must
        not read the early end as a normal one). Requests that arrive later are not affected. Returns how
        many requests were marked."""
        matching = [r for r in self.live_requests() if r.request_id == request_id]
        for request in matching:
            self._cancel_marks[id(request)] = (request, message)
        return len(matching)

    def abort(self, request: GenerationRequest, message: str) -> bool:
        """End one request now with an error, wherever it is; its slot is free at once. False if the
        request is not in the engine (already finished)."""
        seq = next((s for s in self.running if s.request is request), None)
        if seq is not None:
            self._release(seq)
        elif any(s.request is request for s in self.preempted):
            self.preempted = deque(s for s in self.preempted if s.request is not request)
        elif any(r is request for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if r is not request)
        else:
            return False
        request.sink.send_error(message)
        return True

    def fail_all(self, message: str) -> list[GenerationRequest]:
        """End every request in the engine with an error (the engine cannot go on); returns them. A sink
        that raises does not keep the others from being told."""
        failed = self.live_requests()
        for seq in list(self.running):
            self._release(seq)
        self.waiting, self.preempted = deque(), deque()
        self._cancel_marks = {}
        for request in failed:
            send_error_safely(request, message)
        return failed

    def live_requests(self) -> list[GenerationRequest]:
        """Every request in the engine: running first, then preempted and waiting in order."""
        return [s.request for s in self.running] + [s.request for s in self.preempted] + list(self.waiting)

    def stats(self) -> EngineStats:
        return EngineStats(
            active_slots=len(self.running),
            max_slots=self.runner.max_batch_size,
            queued_requests=len(self.waiting) + len(self.preempted),
            kv_cache_used_tokens=sum(s.num_cached for s in self.running),
            kv_cache_capacity_tokens=self.blocks.num_blocks * self.blocks.block_size,
            kv_cache_blocks_used=self.blocks.num_used,
            kv_cache_blocks_total=self.blocks.num_blocks,
            prefix_cache_queries_tokens_total=self.prefix_cache_queries_tokens_total,
            prefix_cache_hits_tokens_total=self.prefix_cache_hits_tokens_total,
            preemptions_total=self.preemptions_total,
            last_step_tokens=self.last_step_tokens,
            steps_total=self.steps,
            prompt_tokens_total=self.prompt_tokens_total,
            generated_tokens_total=self.generated_tokens_total,
            cancelled_requests_total=self.cancelled_requests_total,
            running_lora_adapters=_task_ids(s.request for s in self.running),
            waiting_lora_adapters=_task_ids([s.request for s in self.preempted] + list(self.waiting)),
        )

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.preempted or self.running)

    def _admit(self) -> None:
        """Preempted sequences first, then waiting requests in order, while a row is free and the pool has
        the blocks of the next one's prompt; the queue's head waits rather than being overtaken."""
        while self.free_slots and (self.preempted or self.waiting):
            seq = self.preempted[0] if self.preempted else self._new_sequence(self.waiting[0])
            if not self._take_blocks(seq, count_query=not self.preempted):
                return
            (self.preempted if self.preempted else self.waiting).popleft()
            seq.slot = self.free_slots.pop(0)
            self.running.append(seq)
            if seq.request.guide is not None:
                self._start_guide(seq)

    def _new_sequence(self, request: GenerationRequest) -> Sequence:
        generator = None
        if not request.sampling.greedy:
            seed = request.sampling.seed
            generator = torch.Generator().manual_seed(seed if seed is not None else self._seed_source.getrandbits(63))
        return Sequence(request, generator)

    def _take_blocks(self, seq: Sequence, count_query: bool) -> bool:
        """Give `seq` the blocks of everything it must read before its next sample: the full blocks the
        prefix cache has (at most up to its last token, which must be computed for its logits), fresh
        blocks for the rest. False (nothing taken) if the pool cannot spare them while keeping one block
        per running sequence for its next decode step."""
        tokens = seq.tokens
        block_size = self.blocks.block_size
        root = seq.request.lora.key if seq.request.lora is not None else None  # K/V through an adapter differ
        keys = block_keys(tokens[:len(tokens) - 1], block_size, root) if self.blocks.enable_reuse else []
        cached = self.blocks.match_prefix(keys)
        needed = -(-len(tokens) // block_size) - len(cached)
        if needed + len(self.running) > self.blocks.num_free:
            self.blocks.release(cached)
            return False
        seq.blocks = cached + self.blocks.allocate(needed)
        seq.keys = keys[:len(cached)]
        seq.num_cached = len(cached) * block_size
        seq.prefill_target = len(tokens)
        if count_query:
            self.prefix_cache_queries_tokens_total += len(tokens)
            self.prefix_cache_hits_tokens_total += seq.num_cached
        return True

    def _grow(self, decode: list[Sequence]) -> list[Sequence]:
        """Give every decoding sequence whose next token starts a block that block, oldest first; when the
        pool is empty, preempt the newest running sequence (which may be the one asking). Returns the
        sequences still decoding."""
        for seq in decode:
            while seq in self.running and seq.num_cached // self.blocks.block_size >= len(seq.blocks):
                if self.blocks.num_free:
                    seq.blocks.extend(self.blocks.allocate(1))
                else:
                    self._preempt(self.running[-1])
        return [seq for seq in decode if seq in self.running]

    def _preempt(self, seq: Sequence) -> None:
        """Take a sequence out to free its blocks; it keeps its output, sampler and grammar state and goes
        back to the head of the queue (before the ones preempted earlier in this step, which are newer)."""
        self._release(seq)
        seq.blocks, seq.keys, seq.num_cached = [], [], 0
        self.preempted.appendleft(seq)
        self.preemptions_total += 1

    def _register_full_blocks(self, seq: Sequence) -> None:
        """Offer the blocks its tokens have filled to the prefix cache, so later prompts can share them."""
        block_size = self.blocks.block_size
        full = seq.num_cached // block_size
        if not self.blocks.enable_reuse or len(seq.keys) >= full:
            return
        tokens = seq.tokens
        for index in range(len(seq.keys), full):
            parent = seq.keys[-1] if seq.keys else (seq.request.lora.key if seq.request.lora is not None else None)
            seq.keys.append(block_key(parent, tokens[index * block_size:(index + 1) * block_size]))
            self.blocks.register(seq.blocks[index], seq.keys[-1])

    def _start_guide(self, seq: Sequence) -> None:
        """Give a guided sequence its matcher (kept when it is preempted) and its mask row; one whose grammar
        allows nothing but the end ends at once, without a token."""
        from cpu_engine.guided import GuideMasks

        if self._guide_masks is None:
            self._guide_masks = GuideMasks(self.runner.max_batch_size, self.runner.vocab_size)
        try:
            if seq.guide is None:
                seq.guide = seq.request.guide.start(seq.request.end_id)
            self._guided += 1
            status = self._guide_masks.start(seq.guide, seq.slot)
        except Exception as exc:  # xgrammar failing on one request must not stop the others
            self._fail(seq, f"guided decoding failed: {type(exc).__name__}: {exc}")
            return
        if status is GuideStatus.COMPLETE:
            self._finish([seq], FinishReason.END_ID)
        elif status is GuideStatus.DEAD:
            self._fail(seq, NO_ALLOWED_TOKEN)

    def _fail(self, seq: Sequence, message: str) -> None:
        self._release(seq)
        seq.request.sink.send_error(message)

    def _drop_cancelled(self) -> None:
        """Retire the requests marked by cancel()/cancel_by_id(); marks for requests that finished
        meanwhile are dropped with the rest."""
        if not self._cancel_marks:
            return
        marks, self._cancel_marks = self._cancel_marks, {}
        ended = [s.request for s in self.preempted if id(s.request) in marks]
        if ended:
            self.preempted = deque(s for s in self.preempted if id(s.request) not in marks)
        waiting_ended = [r for r in self.waiting if id(r) in marks]
        if waiting_ended:
            self.waiting = deque(r for r in self.waiting if id(r) not in marks)
            ended += waiting_ended
        for seq in [s for s in self.running if id(s.request) in marks]:
            self._release(seq)
            ended.append(seq.request)
        for request in ended:
            self.cancelled_requests_total += 1
            message = marks[id(request)][1]
            if message is None:
                request.sink.send([], FinishReason.CANCELLED)
            else:
                request.sink.send_error(message)

    def _release(self, seq: Sequence) -> None:
        """Take a sequence out of the batch; its row goes back (lowest first) and its blocks to the pool,
        where the full ones stay in the prefix cache until evicted."""
        self.running.remove(seq)
        if seq.guide is not None:
            self._guided -= 1
        self.free_slots.append(seq.slot)
        self.free_slots.sort()
        self.blocks.release(seq.blocks)
        seq.blocks = []

    def _finish(self, sequences: list[Sequence], reason: FinishReason) -> None:
        for seq in sequences:
            self._release(seq)
            seq.request.sink.send([], reason)

    # ----- one step --------------------------------------------------------------------------------
    def step(self) -> None:
        """Admit, run one forward pass for every active sequence, sample, emit, retire."""
        self._drop_cancelled()
        self._admit()
        decode = self._grow([s for s in self.running if not s.in_prefill])
        if not self.running:
            return
        decode.sort(key=lambda s: s.slot)
        budget = self.max_num_tokens - len(decode)
        if decode:  # others are streaming: read prompts only as fast as keeps their latency steady
            budget = min(budget, self.prefill_budget.tokens(len(decode), len(self.running) - len(decode)))
        token_ids = [s.output[-1] for s in decode]
        decode_blocks = [s.blocks for s in decode]
        decode_positions = [s.num_cached for s in decode]
        chunks: list[Chunk] = []
        chunk_seqs: list[Sequence] = []
        for seq in self.running:
            if not seq.in_prefill or budget <= 0:
                continue
            tokens = seq.tokens if seq.output else seq.request.prompt
            length = min(budget, seq.prefill_target - seq.num_cached)
            chunks.append(Chunk(seq.blocks, seq.num_cached, length))
            chunk_seqs.append(seq)
            token_ids.extend(tokens[seq.num_cached:seq.num_cached + length])
            budget -= length

        # Rows whose last logit picks a token: every decode token, and each chunk that ends its prompt.
        sampled: list[Sequence] = list(decode)
        logits_rows = list(range(len(decode)))
        row = len(decode)
        for seq, chunk in zip(chunk_seqs, chunks):
            row += chunk.length
            if chunk.start + chunk.length == seq.prefill_target:
                sampled.append(seq)
                logits_rows.append(row - 1)

        lora = None
        if any(seq.request.lora is not None for seq in self.running):
            lora = LoraBatch.of([s.request.lora for s in decode]
                                + [s.request.lora for s, c in zip(chunk_seqs, chunks) for _ in range(c.length)])
        try:
            logits = self._timed_forward(token_ids, decode_blocks, decode_positions, chunks, logits_rows, lora=lora)
            for seq in decode:
                seq.num_cached += 1
            for seq, chunk in zip(chunk_seqs, chunks):
                seq.num_cached += chunk.length
            for seq in decode + chunk_seqs:
                self._register_full_blocks(seq)
            if sampled:
                guided = None
                if self._guided:
                    rows = [i for i, s in enumerate(sampled) if s.guide is not None]
                    if rows:
                        guided = self._guide_masks.for_batch(rows, [sampled[i].slot for i in rows])
                results = sample(logits, [self._sampling_row(s) for s in sampled], guided)
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
        guides = self._advance_guides(sampled, results) if self._guided else None
        for i, (seq, result) in enumerate(zip(sampled, results)):
            request = seq.request
            if result.token == request.end_id:
                self._finish([seq], FinishReason.END_ID)
                continue
            guide = guides.get(i) if guides else None
            if isinstance(guide, str):  # the grammar refused the token, or xgrammar failed
                self._fail(seq, guide)
                continue
            seq.output.append(result.token)
            reason = None
            if any(seq.output[-len(w):] == w for w in request.stop_words if w):
                reason = FinishReason.STOP_WORDS
            elif len(seq.output) >= request.max_new_tokens:
                reason = FinishReason.LENGTH
            elif guide is GuideStatus.COMPLETE:  # the document is complete: it ends here, whatever min_tokens say
                reason = FinishReason.END_ID
            elif guide is GuideStatus.DEAD:
                self._fail(seq, NO_ALLOWED_TOKEN)
                continue
            if reason is not None:
                self._release(seq)
            request.sink.send([result], reason)

    def _advance_guides(self, sampled: list[Sequence], results: list[SampledToken]) -> dict[int, GuideStatus | str]:
        """The matchers of the step's guided sequences take their tokens and fill their masks for the next
        step, all at once. By position in `sampled`: the GuideStatus after the token, or the error message
        that ends the request (a token the grammar refuses, xgrammar failing). Sequences that sampled their
        end token are left out (they end)."""
        outcome: dict[int, GuideStatus | str] = {}
        states, slots, positions = [], [], []
        for i, (seq, result) in enumerate(zip(sampled, results)):
            if seq.guide is None or result.token == seq.request.end_id:
                continue
            try:
                if not seq.guide.accept(result.token):
                    outcome[i] = f"guided decoding: the grammar does not allow the sampled token {result.token}"
                    continue
            except Exception as exc:
                outcome[i] = f"guided decoding failed: {type(exc).__name__}: {exc}"
                continue
            states.append(seq.guide)
            slots.append(seq.slot)
            positions.append(i)
        if states:
            try:
                outcome.update(zip(positions, self._guide_masks.fill(states, slots)))
            except Exception as exc:
                outcome.update((i, f"guided decoding failed: {type(exc).__name__}: {exc}") for i in positions)
        return outcome


def _task_ids(requests) -> tuple[int, ...]:
    """The distinct LoRA task ids of `requests`, in order."""
    return tuple(dict.fromkeys(r.lora.task_id for r in requests if r.lora is not None))


def send_error_safely(request: GenerationRequest, message: str) -> None:
    """Send a request its error response; log instead of raising, for loops that must reach every request."""
    try:
        request.sink.send_error(message)
    except Exception:  # one broken sink must not keep the others from their error
        log.exception("sending the error response of request %r failed", request.request_id)


_ids = itertools.count()


def new_request_id() -> str:
    """An id for requests that arrive without one (raw Triton clients need not set it)."""
    return f"anon-{next(_ids)}"
