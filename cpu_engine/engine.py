"""The engine loop: a background thread that steps the scheduler while there is work.

Triton's `execute()` must return at once for a decoupled model, so requests are handed over through a
thread-safe inbox and the loop thread alone touches the scheduler. Cancellation by the client (Triton's
`is_cancelled()`) is polled at most every `cancel_poll_s`, since each poll crosses a process boundary;
`cancelled` gets all requests of a poll at once so that the glue can make those round trips together.
A request the poll finds cancelled is cancelled by identity: request ids are client labels and two
clients may share one, and one client leaving must not end the other's request.

Round trips to Triton stay off the loop's critical path: a poll runs on a helper thread while the step
computes (it is waited for before `after_step`, so a poll never overlaps the sending of the step's final
responses, and what it finds cancelled leaves at the next step), and the metrics go out from a thread of
their own (`on_stats` gets the latest snapshot; the engine never waits for it).

The loop thread must never end silently: every open request would wait forever while the server still
looks healthy. Any exception that escapes the loop (anything outside `scheduler.step()`, which contains
its own failures) kills the engine on purpose: every open request (running, waiting, still in the
inbox) gets an error response, `alive` turns false, `failure` says why, `submit()` refuses new requests
at once with EngineFailedError, and `on_failure` tells the glue (which takes the model out of service).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numba
import torch

from cpu_engine import native
from cpu_engine.config import EngineConfig
from cpu_engine.runner import LlamaRunner
from cpu_engine.scheduler import EngineStats, GenerationRequest, RequestError, Scheduler, send_error_safely

log = logging.getLogger(__name__)

MIN_STATS_SPACING_S = 0.02
# cpu_num_threads 0: a model whose full-batch decode step takes less than this on one thread runs on one
# (choose_threads): `tiny` ~2.2 ms, `small` ~45 ms on this 2-core machine.
PARALLEL_MIN_STEP_S = 0.010
# cpu_num_threads 0: cores left to the rest of the stack (the frontend, tritonserver, this stub's response and
# poll threads), which work on every token beside the forward pass (choose_threads).
SERVING_CORES = 1


class EngineFailedError(RequestError):
    """The engine thread died; no request can be served until the model is loaded again."""


class QueueFullError(RequestError):
    """As many requests wait as the engine may queue: this one is refused at once (retry later)."""


def configure_threads(num_threads: int) -> int:
    """The calling thread's PyTorch ops and numba kernels (paged decode attention) run on `num_threads` threads
    (0: every core this process may run on). numba keeps an OpenMP team of its own (a second libgomp): left at
    its default it used every core whatever `num_threads` said."""
    threads = num_threads if num_threads > 0 else len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    return threads


def choose_threads(scheduler: Scheduler, cores: int) -> tuple[int, str]:
    """With cpu_num_threads 0: `cores` less SERVING_CORES, and one thread for a model whose plain full-batch
    decode step takes less than PARALLEL_MIN_STEP_S on one thread (configure_threads, on the calling thread).
    Returns the threads and why.

    The forward pass shares the machine with the rest of the stack, which spends CPU on every token while
    the step computes. A team as wide as the machine meets it on every core: each of a step's parallel
    regions (oneDNN's and FBGEMM's projections, the numba attention kernel, which keeps a second OpenMP
    team) ends at a barrier, and a team thread that the frontend or Triton pushed off its core holds the
    whole team there; its partners spin meanwhile (GOMP_SPINCOUNT, set by the launcher), taking CPU from
    the very processes they wait for. Measured on 2 cores through the whole stack (`small`, 2 threads
    against 1, 3 interleaved rounds, `benchmarks.overhead_bench`): int8 weights 395 against 746 tok/s at 16
    streams and 125 against 142 at one; float32 361 against 539 and 81 against 82, at half the engine's CPU
    per token; plain decode steps without the stack are 1.1-1.6x faster on two threads. A model whose ops
    take microseconds gains nothing from a team even with cores to spare: `tiny` (~2.2 ms a full-batch step
    on one thread) served 1,485 tok/s on one thread against 462 on two (benchmarks/README.md, "Overhead-bound
    stack").
    """
    configure_threads(1)
    team = max(1, cores - SERVING_CORES)
    if team == 1:
        return 1, f"{cores} cores: {SERVING_CORES} left to the frontend, Triton and the stub's response threads"
    step_s = scheduler.plain_step_s()
    if step_s < PARALLEL_MIN_STEP_S:
        return 1, (f"a full-batch decode step takes {step_s * 1000:.1f} ms on one thread, under "
                   f"{PARALLEL_MIN_STEP_S * 1000:.0f} ms: too small for a parallel team to pay")
    return configure_threads(team), (f"a full-batch decode step takes {step_s * 1000:.0f} ms on one thread; "
                                     f"{SERVING_CORES} of {cores} cores left to the rest of the stack")


def choose_kernel_threads(scheduler: Scheduler, cores: int, threads: int) -> int:
    """With cpu_num_threads 0: the threads our C kernels split a product over (native.set_threads): every core
    where a plain batch-1 decode step takes at least PARALLEL_MIN_STEP_S on `threads`, else `threads`.

    The kernels' second thread meets the rest of the stack on its core, which the step then waits for (a block
    at most: the blocks are handed out one at a time). Where a step is long that pays: float32 `small` (13 ms a
    batch-1 step on one thread, 10.2 on two; batch 16 31.6 against 21.5; 15 sequences and a 10-token prompt chunk
    50.5 against 37.6) served 73 against 68 tok/s at one stream and 337 against 325 at 16 streams, 4 of 4 rounds
    ahead (`benchmarks.overhead_bench`, 4 interleaved rounds each, 2-core AMD EPYC). Where it is short it does not:
    int8 `small` (~4 ms a step, 3.3 on two threads) served 186 against 206 at one stream."""
    if cores <= threads or scheduler.plain_step_s(batch=1) < PARALLEL_MIN_STEP_S:
        return threads
    return cores


class Engine:
    def __init__(self, scheduler: Scheduler | Callable[[], Scheduler],
                 cancelled: Callable[[list[GenerationRequest]], list[bool]] | None = None,
                 cancel_poll_s: float = 0.02, on_stats: Callable[[EngineStats], None] | None = None,
                 stats_period_s: float = 0.1, after_step: Callable[[], None] | None = None,
                 on_failure: Callable[[str], None] | None = None, max_queued: int = 0):
        """`scheduler` is the scheduler, or a function that makes it: start() then runs it on the loop thread
        (see start()). `after_step` runs on the engine thread after every step, before the next: the Triton glue
        hands the step's responses over for delivery there (and the failure guard calls it once more to
        deliver the error responses); no cancellation poll is in flight while it runs. `on_failure` runs
        once on the engine thread, with the reason, after the engine died and every open request got its
        error. `on_stats` runs on a thread of its own. `max_queued` bounds the requests waiting
        for a slot (0: no bound), so that a flood is refused at once instead of queued without end."""
        self._build = None if isinstance(scheduler, Scheduler) else scheduler
        self.scheduler: Scheduler = scheduler if self._build is None else None  # set by start() otherwise
        self._after_step = after_step
        self._cancelled = cancelled
        self.cancel_poll_s = cancel_poll_s  # how often Triton's cancellations are polled
        self._on_stats = on_stats
        self._on_failure = on_failure
        self._max_queued = max_queued
        self._stats_period_s = stats_period_s
        self._published_occupancy: tuple[int, int] | None = None
        self._published_at = 0.0
        self._stats_publisher = _LatestOnly(on_stats, MIN_STATS_SPACING_S) if on_stats is not None else None
        # The poll in flight (its requests and their answers), run by the helper while the step computes.
        self._poll: tuple[list[GenerationRequest], Future[list[bool]]] | None = None
        self._poller: ThreadPoolExecutor | None = None
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        # Held while checking `_failure` and putting into the inbox, and while setting `_failure`: once
        # the engine is dead no request can slip into the inbox after the guard emptied it.
        self._admission = threading.Lock()
        self._failure: str | None = None
        self._wakeup = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-engine", daemon=True)
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self.threads = 0  # the threads the loop thread's parallel ops run on (from_config; 0: not set here)
        self.thread_choice = ""  # why, when the engine chose them (cpu_num_threads 0)
        self.kernel_threads = 0  # the threads our C kernels split a product over (from_config)

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: object) -> "Engine":
        """The engine for `config`. Its weights load, and it measures this machine (Scheduler.calibrate), on
        the loop thread when `start()` is called; start() returns when that is done."""

        def build() -> Scheduler:
            engine.threads = cores = configure_threads(config.num_threads)
            runner = LlamaRunner(config)
            scheduler = Scheduler(runner, config.max_num_tokens, config.prefill_step_ratio,
                                  enable_prefix_reuse=config.enable_prefix_reuse)
            if config.num_threads <= 0 and cores > 1:
                engine.threads, engine.thread_choice = choose_threads(scheduler, cores)
                wide = min(cores, numba.config.NUMBA_NUM_THREADS)  # long-context attention: every core
                if wide > engine.threads:
                    runner.wide_attention_threads = wide
            engine.kernel_threads = cores
            if config.num_threads <= 0:
                engine.kernel_threads = choose_kernel_threads(scheduler, cores, engine.threads)
            native.set_threads(engine.kernel_threads)
            scheduler.calibrate()
            return scheduler

        engine = cls(build, **kwargs)
        return engine

    def describe(self) -> str:
        """What calibration measured, for the server log."""
        steps = ", ".join(f"{n}: {s * 1000:.1f} ms"
                          for n, s in sorted(self.scheduler.prefill_budget.costs.decode_step_s.items()))
        choice = f" ({self.thread_choice})" if self.thread_choice else ""
        threads = self.threads or torch.get_num_threads()
        runner = self.scheduler.runner
        wide = (f"; decode attention over long contexts on {runner.wide_attention_threads} threads"
                if runner.wide_attention_threads else "")
        weights = f"{runner.weights} weights ({runner.lm_head.description})"  # which kernel (int8: and activations)
        if runner.lm_head.gemm is not None and self.kernel_threads > threads:
            weights += f", on {self.kernel_threads} threads"
        if runner.kv_dtype != runner.dtype:
            weights += ", bfloat16 KV cache (our C attention kernel)"
        return (f"CPU engine: {runner.dtype_name} compute, {weights}; {threads} threads{choice}{wide}; "
                f"plain decode step by batch size {{{steps}}}")

    @property
    def alive(self) -> bool:
        """The loop thread runs and has not failed."""
        return self._failure is None and self._thread.is_alive()

    @property
    def failure(self) -> str | None:
        """Why the engine died (the exception, as text), or None."""
        return self._failure

    def start(self) -> None:
        """Start the loop thread; when the engine was given a function that makes its scheduler, returns
        once that has run there. It runs there, not on the caller's thread, so that one thread only ever
        runs PyTorch's parallel ops: each such thread keeps a team of OpenMP threads of its own, and a
        second team, even idle, made batch-1 steps 25-30% slower on this 2-core machine (the model's
        main thread in Triton's stub loading the weights and calibrating, the loop thread decoding)."""
        self._thread.start()
        if self._build is not None:
            self._built.wait()
        if self._build_error is not None:
            raise RuntimeError(f"the CPU engine failed to start: {self._build_error!r}") from self._build_error

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopped.set()
        self._wakeup.set()
        self.join(timeout_s)
        if self._poller is not None:
            self._poller.shutdown(wait=False)
        if self._stats_publisher is not None:
            self._stats_publisher.close(timeout_s)

    def join(self, timeout_s: float) -> bool:
        """Wait up to timeout_s for the loop thread to end; True if it has ended (or never started)."""
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def submit(self, request: GenerationRequest) -> None:
        """Raises RequestError at once for a request that can never run, QueueFullError when `max_queued`
        requests already wait, EngineFailedError if the engine died."""
        self.scheduler.validate(request)
        # Requests that will have to wait for a slot: queued or just submitted, less the free slots they will
        # take (approximate: read off the engine thread, which may be asleep while a burst arrives).
        waiting = len(self.scheduler.waiting) + self._inbox.qsize() - len(self.scheduler.free_slots)
        if self._max_queued and waiting >= self._max_queued:
            raise QueueFullError(f"the engine's queue is full ({waiting} requests waiting for a slot); "
                                 "retry later")
        self._put("add", request)

    def cancel(self, request: GenerationRequest) -> None:
        """Cancel exactly this request (its client went away); it ends with a plain final response."""
        self._put_cancellation("cancel", request)

    def cancel_by_id(self, request_id: str) -> None:
        """TensorRT-LLM's `stop` input: cancel every request now in the engine with this id; they end with
        an error response (see Scheduler.cancel_by_id)."""
        self._put_cancellation("cancel_by_id", request_id)

    def _put_cancellation(self, kind: str, item: object) -> None:
        """A dead engine already ended every request with an error: nothing is left to cancel."""
        try:
            self._put(kind, item)
        except EngineFailedError:
            pass

    def _put(self, kind: str, item: object) -> None:
        with self._admission:
            if self._failure is not None:
                raise EngineFailedError(f"the engine has failed and accepts no requests ({self._failure})")
            self._inbox.put((kind, item))
        self._wakeup.set()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self.scheduler.waiting.append(item)  # already validated in submit()
            elif kind == "cancel":
                self.scheduler.cancel(item)
            else:
                self.scheduler.cancel_by_id(item)

    def _start_poll(self) -> None:
        """Ask Triton, from the helper thread, which of the live requests were cancelled; the answers are
        taken by `_finish_poll` after the step."""
        requests = self.scheduler.live_requests()
        if self._cancelled is None or not requests:
            return
        if self._poller is None:
            self._poller = ThreadPoolExecutor(1, thread_name_prefix="cpu-engine-cancel-poll")
        self._poll = (requests, self._poller.submit(self._cancelled, requests))

    def _finish_poll(self) -> None:
        """Wait for the poll in flight (if any) and mark what it found cancelled: those requests leave at the
        next step. Re-raises the poll's exception (the engine dies: see the module docstring)."""
        if self._poll is None:
            return
        (requests, answers), self._poll = self._poll, None
        for request, cancelled in zip(requests, answers.result()):
            if cancelled:
                self.scheduler.cancel(request)

    def _publish_stats(self, now: float, force: bool = False) -> None:
        """Report every stats_period_s, busy or idle, and sooner when requests join or leave. Triton may
        apply two metric updates sent within a millisecond out of order, so updates are spaced out and
        repeated: a gauge is never wrong for longer than one period."""
        occupancy = (len(self.scheduler.running), len(self.scheduler.waiting))
        since = now - self._published_at
        if self._on_stats is None or (not force and (since < MIN_STATS_SPACING_S or (
                occupancy == self._published_occupancy and since < self._stats_period_s))):
            return
        self._published_occupancy, self._published_at = occupancy, now
        try:
            self._stats_publisher.offer(self.scheduler.stats())
        except Exception:  # metrics must never stop the engine
            log.exception("publishing engine stats failed")

    def _run(self) -> None:
        """The thread's body: the loop under the guard that makes a crash loud instead of a hang."""
        try:
            with torch.inference_mode():
                if self._build is not None:
                    try:
                        self.scheduler = self._build()
                    except BaseException as exc:  # no request yet: start() raises it, the model fails to load
                        self._build_error = exc
                        return
                    finally:
                        self._built.set()
                self._loop()
        except BaseException as exc:  # whatever ends the thread, no request may hang
            self._die(exc)

    def _loop(self) -> None:
        last_poll = 0.0
        while not self._stopped.is_set():
            self._drain_inbox()
            if not self.scheduler.has_work:
                self._publish_stats(time.monotonic())
                self._wakeup.wait(timeout=self._stats_period_s)
                self._wakeup.clear()
                continue
            now = time.monotonic()
            if now - last_poll >= self.cancel_poll_s:
                self._start_poll()  # its round trips overlap the step
                last_poll = now
            try:
                self.scheduler.step()
            except Exception:  # keep serving; the scheduler already failed the step's requests
                log.exception("engine step failed")
            finally:
                try:
                    self._finish_poll()  # before after_step: never while the step's final responses go out
                finally:
                    if self._after_step is not None:
                        self._after_step()
            self._publish_stats(now)

    def _die(self, exc: BaseException) -> None:
        """Fail every open request, refuse new ones, tell the glue. Each part is guarded on its own so
        that one failing cannot keep the later ones from running."""
        log.critical("the engine thread failed; failing every open request and refusing new ones",
                     exc_info=(type(exc), exc, exc.__traceback__))
        with self._admission:
            self._failure = f"{type(exc).__name__}: {exc}"
        message = f"the engine failed and cannot serve requests ({self._failure})"
        if self._poll is not None:  # no poll may overlap the error responses
            self._guarded(lambda: self._poll[1].exception(), "waiting for the cancellation poll")
            self._poll = None
        self._guarded(lambda: self.scheduler.fail_all(message), "failing the open requests")
        for request in self._drain_requests():
            send_error_safely(request, message)
        self._guarded(self._after_step, "delivering the error responses")
        self._publish_stats(time.monotonic(), force=True)
        if self._on_failure is not None:
            self._guarded(lambda: self._on_failure(self._failure), "reporting the engine failure")

    def _drain_requests(self) -> list[GenerationRequest]:
        """Empty the inbox (nothing more can enter it): the requests submitted but not yet taken."""
        requests = []
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return requests
            if kind == "add":
                requests.append(item)

    @staticmethod
    def _guarded(action: Callable[[], object] | None, what: str) -> None:
        if action is None:
            return
        try:
            action()
        except Exception:  # the engine is already dead; the next steps must still run
            log.exception("%s after the engine failed raised", what)


class _LatestOnly:
    """Hands values to `consumer` on a thread of its own, newest first: a value offered while the consumer
    is busy replaces the one still waiting, so the offering thread never waits and the consumer never falls
    behind. Calls are at least `spacing_s` apart and in the order the values were offered."""

    def __init__(self, consumer: Callable[[object], None], spacing_s: float):
        self._consumer = consumer
        self._spacing_s = spacing_s
        self._latest: object | None = None
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def offer(self, value: object) -> None:
        with self._lock:
            self._latest = value
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="cpu-engine-stats", daemon=True)
                self._thread.start()
        self._ready.set()

    def close(self, timeout_s: float) -> None:
        """The value still waiting goes out, then the thread ends."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._ready.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _run(self) -> None:
        last = float("-inf")
        while True:
            self._ready.wait()
            time.sleep(max(0.0, last + self._spacing_s - time.monotonic()))
            with self._lock:
                value, self._latest = self._latest, None
                self._ready.clear()
                closed = self._closed
            if value is None:
                if closed:
                    return
                continue
            last = time.monotonic()
            try:
                self._consumer(value)
            except Exception:  # metrics must never stop anything
                log.exception("publishing engine stats failed")
            if closed:
                return
