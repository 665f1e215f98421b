"""Admission control: how many requests run and wait at once, and per-key request and token rates.

- `AdmissionGate`: at most `max_in_flight` generation requests run; up to `max_queued` more wait, first
  come first served, for at most a bounded time; anything past that is refused at once (429 +
  Retry-After) instead of hanging. A stream holds its slot until it ends, however it ends.
- `RateLimiter`: per key, a token bucket of requests per minute and one of tokens per minute. A request
  reserves prompt + max_tokens up front (`tokens_to_reserve`: at most the bucket's capacity when max_tokens
  was left to default; a 400 when the client's own max_tokens can never fit) and, when it ends, is charged
  what it used if it ran and nothing if it was refused (`tokens_to_charge`).

Pure asyncio and arithmetic, with the clock injected, so they are unit-tested without servers.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol

Clock = Callable[[], float]


class Rejected(Exception):
    """Refused admission: `reason` for metrics and logs, `retry_after_s` for the Retry-After header."""

    def __init__(self, reason: str, message: str, retry_after_s: float):
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after_s = retry_after_s


class NeverFits(Exception):
    """A request that needs more tokens than its key's tokens-per-minute bucket can ever hold: waiting never
    helps, so it is the client's mistake (a 400 naming `param`, "max_tokens" or "prompt"), not a 429 that an
    SDK would retry until it gives up."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message = message
        self.param = param


# ----- rate limits ------------------------------------------------------------------------------------
class TokenBucket:
    """`capacity` tokens, refilled continuously at `per_second`."""

    def __init__(self, capacity: float, per_second: float, clock: Clock):
        self.capacity = float(capacity)
        self.per_second = float(per_second)
        self._clock = clock
        self._tokens = float(capacity)
        self._updated = clock()

    @property
    def tokens(self) -> float:
        self._refill()
        return self._tokens

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._updated) * self.per_second)
        self._updated = now

    def take(self, n: float) -> float:
        """Take `n` tokens and return 0, or take nothing and return the seconds until `n` are there
        (infinite if `n` is more than the bucket holds)."""
        self._refill()
        if n <= self._tokens:
            self._tokens -= n
            return 0.0
        if n > self.capacity:
            return math.inf
        return (n - self._tokens) / self.per_second

    def give_back(self, n: float) -> None:
        self._refill()
        self._tokens = min(self.capacity, self._tokens + max(0.0, n))

    def charge(self, n: float) -> None:
        """Take `n` tokens even past empty: tokens used beyond a reservation are a debt that the key's next
        requests wait out, so that the rate holds over time."""
        self._refill()
        self._tokens -= max(0.0, n)


@dataclass
class TokenReservation:
    key: str
    reserved: int
    settled: bool = False


@dataclass(frozen=True)
class TokenDemand:
    """What a generation request may use: its prompt tokens (counted once, as usage counts them) and the
    most it may generate (its engine requests' max_tokens together)."""

    prompt: int
    completion: int
    engine_requests: int = 1
    max_tokens_given: bool = True  # False: max_tokens defaulted to the rest of the context


def tokens_to_reserve(demand: TokenDemand, capacity: int) -> int:
    """The tokens to reserve up front from a bucket of `capacity` tokens per minute.

    prompt + max_tokens when that fits the bucket. When the client left max_tokens to default (the rest of
    the context, as the openai SDKs do by default), the reservation is capped at the capacity: such a
    request must be able to run under a limit below the context length, and whatever it then uses beyond
    its reservation is charged as a debt when it ends (`RateLimiter.settle`). A client that set max_tokens
    itself asked for more than the limit can ever allow: NeverFits (400, naming max_tokens and the largest
    that fits). So is a prompt that leaves no room for one generated token per engine request."""
    whole = demand.prompt + demand.completion
    if whole <= capacity:
        return whole
    requests = max(1, demand.engine_requests)
    if demand.prompt + requests > capacity:
        raise NeverFits(f"Request too large: its prompt has {demand.prompt} tokens, which with at least one "
                        f"generated token per generation ({requests}) is more than this API key's limit of "
                        f"{capacity} tokens per minute, so it could never run. Shorten the prompt.", "prompt")
    if not demand.max_tokens_given:
        return capacity
    per_request = f"max_tokens {demand.completion // requests}" + (f" x {requests} generations" if requests > 1 else "")
    raise NeverFits(f"Request too large: it may use {whole} tokens ({demand.prompt} in the prompt + {per_request}), "
                    f"more than this API key's limit of {capacity} tokens per minute, so it could never run. "
                    f"Lower max_tokens to at most {(capacity - demand.prompt) // requests}.", "max_tokens")


def tokens_to_charge(admitted: bool, status: int, prompt_tokens: int, completion_tokens: int) -> int:
    """What a request that has ended costs its key: prompt + generated tokens if it ran, else nothing.

    It ran if it was admitted and the engine worked on it: it generated tokens, or the response succeeded.
    A request refused anywhere on the way (a 400, admission's queue_full or queue_timeout, the engine's 429
    queue full or 503 unavailable, before any token) never ran: a client retrying refusals must not burn
    its budget on work that was never done."""
    if not admitted or not (completion_tokens > 0 or 200 <= status < 300):
        return 0
    return prompt_tokens + completion_tokens


class RateLimiter:
    """Per-key requests-per-minute and tokens-per-minute limits; 0 means no limit."""

    RETRY_AFTER_MAX_S = 60.0

    def __init__(self, requests_per_minute: int = 0, tokens_per_minute: int = 0, clock: Clock = time.monotonic):
        self.rpm = requests_per_minute
        self.tpm = tokens_per_minute
        self._clock = clock
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}

    def _bucket(self, buckets: dict[str, TokenBucket], key: str, per_minute: int) -> TokenBucket:
        bucket = buckets.get(key)
        if bucket is None:
            bucket = buckets[key] = TokenBucket(per_minute, per_minute / 60.0, self._clock)
        return bucket

    def check_request(self, key: str) -> None:
        if self.rpm <= 0:
            return
        wait = self._bucket(self._requests, key, self.rpm).take(1)
        if wait > 0:
            raise Rejected("requests_per_minute", f"Rate limit reached: {self.rpm} requests per minute for "
                                                  "this API key. Please retry later.", wait)

    def reserve(self, key: str, demand: TokenDemand) -> TokenReservation:
        """Reserve what `demand` may use (`tokens_to_reserve`): NeverFits, or Rejected (429) while the
        bucket does not hold it yet."""
        if self.tpm <= 0:
            return TokenReservation(key, 0)
        return self.reserve_tokens(key, tokens_to_reserve(demand, self.tpm))

    def reserve_tokens(self, key: str, tokens: int) -> TokenReservation:
        if self.tpm <= 0:
            return TokenReservation(key, 0)
        wait = self._bucket(self._tokens, key, self.tpm).take(tokens)
        if math.isinf(wait):
            raise NeverFits(f"Request too large: it may use {tokens} tokens (prompt + max_tokens), more than "
                            f"this API key's limit of {self.tpm} tokens per minute, so it could never run. "
                            "Lower max_tokens or shorten the prompt.", "max_tokens")
        if wait > 0:
            raise Rejected("tokens_per_minute", f"Rate limit reached: {self.tpm} tokens per minute for this "
                                                f"API key; this request needs {tokens} (prompt + max_tokens). "
                                                "Please retry later.", min(wait, self.RETRY_AFTER_MAX_S))
        return TokenReservation(key, tokens)

    def settle(self, reservation: TokenReservation, used: int) -> None:
        """Once, when the request has ended: give back what it reserved but did not use (all of it when it
        never ran, `tokens_to_charge`), or take what it used beyond its reservation (max_tokens defaulted,
        the reservation capped at the capacity) as a debt."""
        if reservation.settled or reservation.reserved <= 0:
            return
        reservation.settled = True
        unused = reservation.reserved - max(0, used)
        bucket = self._bucket(self._tokens, reservation.key, self.tpm)
        if unused > 0:
            bucket.give_back(unused)
        elif unused < 0:
            bucket.charge(-unused)


# ----- concurrency ------------------------------------------------------------------------------------
class AdmissionGate:
    """`max_in_flight` slots, one per engine request (a request with n choices over k prompts takes n x k),
    and a FIFO queue of at most `max_queued` waiting requests. First come, first served: a large request at
    the head of the queue is not overtaken by smaller ones behind it, so it cannot starve."""

    def __init__(self, max_in_flight: int, max_queued: int, clock: Clock = time.monotonic):
        if max_in_flight < 1 or max_queued < 0:
            raise ValueError("max_in_flight must be >= 1 and max_queued >= 0")
        self.max_in_flight = max_in_flight
        self.max_queued = max_queued
        self._clock = clock
        self.in_flight = 0
        self._waiters: deque[tuple[asyncio.Future[None], int]] = deque()
        self._service_s = 1.0  # moving average of how long a slot is held, for Retry-After

    @property
    def queued(self) -> int:
        return sum(1 for waiter, _ in self._waiters if not waiter.done())

    def retry_after_s(self) -> float:
        """A guess at when a slot frees up: the queue ahead drained at the average service time."""
        return min(60.0, max(1.0, self._service_s * (self.queued + 1) / self.max_in_flight))

    async def acquire(self, timeout_s: float | None, slots: int = 1) -> float:
        """Take `slots` slots (see slots_for), waiting in the queue at most `timeout_s`; returns the seconds
        waited. Raises `Rejected` if the queue is full or the wait timed out."""
        if not self._waiters and self.in_flight + slots <= self.max_in_flight:
            self.in_flight += slots
            return 0.0
        if self.queued >= self.max_queued:
            raise Rejected("queue_full", f"The server is at capacity ({self.in_flight} of {self.max_in_flight} "
                                         f"engine requests running, {self.queued} requests waiting). Please "
                                         "retry later.", self.retry_after_s())
        start = self._clock()
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (waiter, slots)
        self._waiters.append(entry)
        try:
            await asyncio.wait({waiter}, timeout=timeout_s)
        except BaseException:  # cancelled (client gone, deadline): give back slots we were just given
            if waiter.done() and not waiter.cancelled():
                self.release(slots=slots)
            waiter.cancel()
            self._forget(entry)
            raise
        if not waiter.done():
            waiter.cancel()
            self._forget(entry)
            raise Rejected("queue_timeout", f"Waited {timeout_s:g} s in the queue without getting a slot. "
                                            "Please retry later.", self.retry_after_s())
        return self._clock() - start

    def _forget(self, entry: tuple[asyncio.Future[None], int]) -> None:
        try:
            self._waiters.remove(entry)
        except ValueError:
            pass
        self._grant()  # a large waiter that left may have blocked smaller ones behind it

    def release(self, held_s: float | None = None, slots: int = 1) -> None:
        """Free `slots` slots, handed on to the waiters at the head of the queue that now fit."""
        if held_s is not None:
            self._service_s = 0.9 * self._service_s + 0.1 * held_s
        self.in_flight = max(0, self.in_flight - slots)
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            waiter, slots = self._waiters[0]
            if waiter.done():
                self._waiters.popleft()
                continue
            if self.in_flight + slots > self.max_in_flight:
                return
            self._waiters.popleft()
            self.in_flight += slots
            waiter.set_result(None)


# ----- one interface, one process or several ------------------------------------------------------------
@dataclass(frozen=True)
class Admitted:
    """Slots granted to one request: given back with `Limits.release`."""

    slots: int
    waited_s: float
    ticket: int = 0  # which grant, where the slots are held in another process (frontend/workers/shared.py)


class Limits(Protocol):
    """The server's admission and rate limits as a request sees them: held in this process (`LocalLimits`),
    or in the supervisor's coordinator for all the workers (frontend/workers/shared.py `SharedLimits`)."""

    max_in_flight: int

    async def check_request(self, key: str) -> None: ...  # Rejected

    async def reserve(self, key: str, demand: TokenDemand) -> TokenReservation: ...  # Rejected, NeverFits

    def settle(self, reservation: TokenReservation, used: int) -> None: ...

    async def admit(self, timeout_s: float | None, slots: int) -> Admitted: ...  # Rejected

    def release(self, admitted: Admitted, held_s: float) -> None: ...

    async def occupancy(self) -> tuple[int, int]: ...  # (engine requests in flight, requests queued)


def slots_for(engine_requests: int, max_in_flight: int) -> int:
    """The slots a request takes: one per engine request, and never more than the gate has (a request
    larger than the whole gate runs alone rather than never)."""
    return max(1, min(engine_requests, max_in_flight))


class LocalLimits:
    """`Limits` of one process: its own gate and rate limiter."""

    def __init__(self, gate: AdmissionGate, limiter: RateLimiter):
        self.gate = gate
        self.limiter = limiter
        self.max_in_flight = gate.max_in_flight

    async def check_request(self, key: str) -> None:
        self.limiter.check_request(key)

    async def reserve(self, key: str, demand: TokenDemand) -> TokenReservation:
        return self.limiter.reserve(key, demand)

    def settle(self, reservation: TokenReservation, used: int) -> None:
        self.limiter.settle(reservation, used)

    async def admit(self, timeout_s: float | None, slots: int) -> Admitted:
        return Admitted(slots, await self.gate.acquire(timeout_s, slots))

    def release(self, admitted: Admitted, held_s: float) -> None:
        self.gate.release(held_s, admitted.slots)

    async def occupancy(self) -> tuple[int, int]:
        return self.gate.in_flight, self.gate.queued
