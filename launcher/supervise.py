"""Keep tritonserver and the frontend running: restart whichever dies, with back-off, within a budget.

Why restart at all: the frontend already survives Triton dying (requests get 503, readiness is 503, and it
reconnects by itself once Triton is back), so one tritonserver crash (an OOM kill, a rare bug, an
operator's `kill -9`) should cost seconds of 503s, not the whole service. The same holds the other way:
Triton keeps its loaded engine while a crashed frontend comes back.

Why a back-off and a budget: a process that dies on every start (a broken engine, a full disk, a port
someone else took) would otherwise be restarted in a tight loop forever, hiding the cause. Restarts of a
process wait `base * 2**k` seconds (k = its restarts within the last minute, capped), and a death that
would make more than `max_per_minute` restarts of that process within any 60 s ends supervision with the
reason (RestartBudgetExceeded), so `make serve` exits non-zero with something to read.

Why more than process exit: a process can be alive and still not serve. tritonserver outlives its engine
(an engine-thread crash unloads the model; a killed Python-backend stub leaves a model that answers
nothing: launcher/engine_health.py). A child may therefore report a `health()` problem. One that loading
the model again can fix is given `unhealthy_grace_s` to clear by itself (a rollout's reload, say), then a
reload (`repair()`, off the poll loop) and `ready_timeout_s` to take effect. One that only a restart fixes is a
death like any other (restart, back-off, budget, log): at once when it is definitive (a dead stub), after the
same grace when it may pass (Triton not answering: busy, or still starting), and when a reload did not help.

Everything here is driven by `Supervisor.step()`, called from the launcher's poll loop, and a clock that
tests replace; nothing sleeps, so a Ctrl+C is never held up by a back-off.
"""

from __future__ import annotations

import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from launcher.engine_health import Problem

Clock = Callable[[], float]

WINDOW_S = 60.0  # "a minute" of MAX_RESTARTS_PER_MINUTE
BACKOFF_BASE_S = 1.0  # the first restart after a quiet minute waits this long
BACKOFF_MAX_S = 30.0


class RestartBudgetExceeded(RuntimeError):
    """A supervised process died more often than the budget allows; the message says which and why."""


class Child(Protocol):
    """A supervised process as the Supervisor sees it (launcher/processes.py has the two real ones).

    start() launches a fresh instance (the previous one was stopped); stop() ends the current instance and
    anything it spawned and is safe to call repeatedly; ready() is a quick non-blocking probe; failure_detail()
    is what to show when giving up (the Triton log tail; the frontend's output is already on the console).
    health() says why a running child does not serve (None: it does); repair() starts fixing a reloadable
    problem in the background and returns at once.
    """

    name: str
    ready_timeout_s: float
    unhealthy_grace_s: float

    @property
    def pid(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def start(self) -> None: ...

    def stop(self, *, failed: bool = False) -> None:
        """failed: it died or does not serve, and a restart follows. There is nothing clean to wait for then
        (a server whose backend stub is dead waits its whole exit timeout for an unload that never ends, and
        the restart with it), so what is left of it gets a few seconds before SIGKILL."""

    def ready(self) -> bool: ...

    def failure_detail(self) -> str: ...

    def health(self) -> Problem | None: ...

    def repair(self, problem: Problem) -> None: ...


class RestartBudget:
    """At most `max_per_minute` restarts within any sliding `window_s`, and the back-off before each.

    Sliding rather than per calendar minute so that a burst straddling a minute boundary cannot get twice
    the budget. The back-off grows with the restarts still inside the window, so it resets by itself once
    the process has stayed up for a minute.
    """

    def __init__(self, max_per_minute: int, clock: Clock = time.monotonic, window_s: float = WINDOW_S,
                 backoff_base_s: float = BACKOFF_BASE_S, backoff_max_s: float = BACKOFF_MAX_S) -> None:
        if max_per_minute < 0:
            raise ValueError(f"max_per_minute must be >= 0, not {max_per_minute}")
        self.max_per_minute = max_per_minute
        self._clock = clock
        self._window_s = window_s
        self._base_s = backoff_base_s
        self._max_s = backoff_max_s
        self._times: deque[float] = deque()

    def recent(self) -> int:
        """Restarts within the last window."""
        cutoff = self._clock() - self._window_s
        while self._times and self._times[0] <= cutoff:
            self._times.popleft()
        return len(self._times)

    def take(self) -> float | None:
        """Spend one restart now and return how long to wait before it; None (nothing spent) when the
        budget for this window is used up."""
        recent = self.recent()
        if recent >= self.max_per_minute:
            return None
        self._times.append(self._clock())
        return min(self._max_s, self._base_s * 2.0 ** recent)


def describe_exit(code: int) -> str:
    """`exited with code 1` or `was killed by SIGKILL (code -9)`: Popen reports signals as negative codes."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (code {code})"
    return f"exited with code {code}"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class _Track:
    """Where one child is: running normally, waiting out its back-off, or restarted and not ready yet."""

    child: Child
    budget: RestartBudget
    phase: Literal["running", "waiting", "starting", "repairing"] = "running"
    restart_at: float = 0.0
    started_at: float = 0.0  # of the restart or the repair under way
    unhealthy_since: float | None = None
    restarts: int = 0  # since the launcher started, for the log lines


class Supervisor:
    """Restart dead children (each with its own budget, so a flapping frontend cannot use up Triton's).

    The children must be running when the Supervisor is made: the launcher's first start stays fail-fast
    (a model repository that cannot load once will not load on a fifth try, and waiting for that would only
    delay the error).
    """

    def __init__(self, children: Sequence[Child], max_restarts_per_minute: int, clock: Clock = time.monotonic,
                 log: Callable[[str], None] = _stderr, window_s: float = WINDOW_S,
                 backoff_base_s: float = BACKOFF_BASE_S, backoff_max_s: float = BACKOFF_MAX_S) -> None:
        self._clock = clock
        self._log = log
        self.max_restarts_per_minute = max_restarts_per_minute
        self._tracks = [
            _Track(child, RestartBudget(max_restarts_per_minute, clock, window_s, backoff_base_s, backoff_max_s))
            for child in children
        ]

    def phase(self, name: str) -> str:
        """'running', 'waiting' (back-off), 'starting' (restarted, not ready yet) or 'repairing' (reloading
        what it no longer serves); for tests and logs."""
        return self._track(name).phase

    def restarts(self, name: str) -> int:
        return self._track(name).restarts

    def step(self) -> None:
        """Look at every child once; restart what is due. Raises RestartBudgetExceeded when giving up."""
        for track in self._tracks:
            self._step_one(track)

    # ----- internals ------------------------------------------------------------------------------------
    def _track(self, name: str) -> _Track:
        for track in self._tracks:
            if track.child.name == name:
                return track
        raise KeyError(name)

    def _step_one(self, track: _Track) -> None:
        child = track.child
        now = self._clock()
        if track.phase == "waiting":
            if now >= track.restart_at:
                child.start()
                track.phase, track.started_at = "starting", now
                self._log(f"launcher: {child.name} restarted (pid {child.pid}, restart {track.restarts}); "
                          "waiting until it is ready")
            return
        code = child.poll()
        if code is not None:
            self._died(track, describe_exit(code), now)
            return
        if track.phase == "starting":
            if child.ready():
                track.phase, track.unhealthy_since = "running", None
                self._log(f"launcher: {child.name} ready again, {self._clock() - track.started_at:.1f} s after "
                          f"restart {track.restarts}")
                return
            if now - track.started_at > child.ready_timeout_s:
                # Hung in its start (e.g. a model load that never finishes): as good as dead.
                self._died(track, f"was not ready {child.ready_timeout_s:.0f} s after restart {track.restarts}", now)
                return
            problem = child.health()
            if problem is None or not problem.reloadable:
                return  # still loading
            track.phase = "running"  # it loaded and lost a model before a readiness poll saw it: as below
        else:
            problem = child.health()
        if track.phase == "repairing":
            if problem is None:
                track.phase, track.unhealthy_since = "running", None
                self._log(f"launcher: {child.name} serves again, {now - track.started_at:.1f} s after the reload")
            elif now - track.started_at > child.ready_timeout_s:
                self._died(track, f"still does not serve {child.ready_timeout_s:.0f} s after a reload ({problem.reason})",
                           now)
            return
        if problem is None:
            if track.unhealthy_since is not None:
                self._log(f"launcher: {child.name} serves again by itself")
            track.unhealthy_since = None
            return
        if problem.definitive:
            self._died(track, f"does not serve: {problem.reason}", now)
            return
        if track.unhealthy_since is None:
            track.unhealthy_since = now
            then = "reloading" if problem.reloadable else "restarting"
            self._log(f"launcher: {child.name}: {problem.reason}; {then} in {child.unhealthy_grace_s:.0f} s "
                      "unless that clears")
        elif now - track.unhealthy_since < child.unhealthy_grace_s:
            return
        elif problem.reloadable:
            track.phase, track.started_at = "repairing", now
            self._log(f"launcher: {child.name}: reloading {', '.join(problem.missing)} ({problem.reason})")
            child.repair(problem)
        else:
            self._died(track, f"does not serve for {now - track.unhealthy_since:.0f} s: {problem.reason}", now)

    def _died(self, track: _Track, how: str, now: float) -> None:
        child = track.child
        pid = child.pid
        delay = track.budget.take()
        if delay is None:
            limit = self.max_restarts_per_minute
            why = ("restarts are off (MAX_RESTARTS_PER_MINUTE=0)" if limit == 0 else
                   f"it was already restarted {track.budget.recent()} times in the last minute "
                   f"(MAX_RESTARTS_PER_MINUTE={limit})")
            child.stop(failed=True)  # leftovers (e.g. backend stubs) go now; the launcher stops the rest
            raise RestartBudgetExceeded(f"{child.name} (pid {pid}) {how}; {why}; giving up\n{child.failure_detail()}")
        track.restarts += 1
        track.phase, track.restart_at, track.unhealthy_since = "waiting", now + delay, None
        self._log(f"launcher: {child.name} (pid {pid}) {how}; restart {track.restarts} in {delay:.1f} s "
                  f"({track.budget.recent()} of at most {self.max_restarts_per_minute} in the last minute)")
        child.stop(failed=True)
