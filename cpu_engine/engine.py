"""The engine loop: a background thread that steps the scheduler while there is work.

Triton's `execute()` must return at once for a decoupled model, so requests are handed over through a
thread-safe inbox and the loop thread alone touches the scheduler. Cancellation by the client (Triton's
`is_cancelled()`) is polled at most every `cancel_poll_s`, since each poll crosses a process boundary;
`cancelled` gets all requests of a poll at once so that the glue can make those round trips together.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Callable

import torch

from cpu_engine.config import EngineConfig
from cpu_engine.runner import LlamaRunner
from cpu_engine.scheduler import EngineStats, GenerationRequest, Scheduler

log = logging.getLogger(__name__)

MIN_STATS_SPACING_S = 0.02


def configure_threads(num_threads: int) -> int:
    threads = num_threads if num_threads > 0 else len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    return threads


class Engine:
    def __init__(self, scheduler: Scheduler,
                 cancelled: Callable[[list[GenerationRequest]], list[bool]] | None = None,
                 cancel_poll_s: float = 0.02, on_stats: Callable[[EngineStats], None] | None = None,
                 stats_period_s: float = 0.1, after_step: Callable[[], None] | None = None):
        """`after_step` runs on the engine thread after every step, before the next: the Triton glue
        waits there for the step's responses to be delivered."""
        self.scheduler = scheduler
        self._after_step = after_step
        self._cancelled = cancelled
        self._cancel_poll_s = cancel_poll_s
        self._on_stats = on_stats
        self._stats_period_s = stats_period_s
        self._published_occupancy: tuple[int, int] | None = None
        self._published_at = 0.0
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-engine", daemon=True)

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: object) -> "Engine":
        configure_threads(config.num_threads)
        runner = LlamaRunner(config)
        scheduler = Scheduler(runner, config.max_num_tokens, config.prefill_step_ratio)
        with torch.inference_mode():  # measure this machine before the first request
            scheduler.calibrate()
        return cls(scheduler, **kwargs)

    def describe(self) -> str:
        """What calibration measured, for the server log."""
        steps = ", ".join(f"{n}: {s * 1000:.0f} ms"
                          for n, s in sorted(self.scheduler.prefill_budget.costs.decode_step_s.items()))
        return f"CPU engine: {torch.get_num_threads()} threads; plain decode step by batch size {{{steps}}}"

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopped.set()
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def submit(self, request: GenerationRequest) -> None:
        """Raises RequestError at once for a request that can never run."""
        self.scheduler.validate(request)
        self._inbox.put(("add", request))
        self._wakeup.set()

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))
        self._wakeup.set()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self.scheduler.waiting.append(item)  # already validated in submit()
            else:
                self.scheduler.cancel(item)

    def _poll_cancellations(self) -> None:
        requests = [s.request for s in self.scheduler.running] + list(self.scheduler.waiting)
        if self._cancelled is None or not requests:
            return
        for request, cancelled in zip(requests, self._cancelled(requests)):
            if cancelled:
                self.scheduler.cancel(request.request_id)

    def _publish_stats(self, now: float) -> None:
        """Report every stats_period_s, busy or idle, and sooner when requests join or leave. Triton may
        apply two metric updates sent within a millisecond out of order, so updates are spaced out and
        repeated: a gauge is never wrong for longer than one period."""
        occupancy = (len(self.scheduler.running), len(self.scheduler.waiting))
        since = now - self._published_at
        if self._on_stats is None or since < MIN_STATS_SPACING_S or (
                occupancy == self._published_occupancy and since < self._stats_period_s):
            return
        self._published_occupancy, self._published_at = occupancy, now
        try:
            self._on_stats(self.scheduler.stats())
        except Exception:  # metrics must never stop the engine
            log.exception("publishing engine stats failed")

    def _loop(self) -> None:
        last_poll = 0.0
        with torch.inference_mode():
            while not self._stopped.is_set():
                self._drain_inbox()
                if not self.scheduler.has_work:
                    self._publish_stats(time.monotonic())
                    self._wakeup.wait(timeout=self._stats_period_s)
                    self._wakeup.clear()
                    continue
                now = time.monotonic()
                if now - last_poll >= self._cancel_poll_s:
                    self._poll_cancellations()
                    last_poll = now
                try:
                    self.scheduler.step()
                except Exception:  # keep serving; the scheduler already failed the step's requests
                    log.exception("engine step failed")
                finally:
                    if self._after_step is not None:
                        self._after_step()
                self._publish_stats(now)
