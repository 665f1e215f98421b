"""What one request holds while it runs, and the one owner that gives it all back: its admission slots (one
per engine request), its tokens-per-minute reservation and the leases on the model versions it picked.

A `RequestBudget` is an async context manager entered once per request by the edge middleware, around the
whole of the app's handling of it: it exits when the response has been sent in full (a stream after its
last byte, `GenerationResponse` holding the request until then) or when the handling ended any other way
(an error, the client gone, the deadline, shutdown). The route takes the resources once it knows what it
needs (`lease` when it picks the model, `reserve_tokens` and `admit` once it knows the prompt, max_tokens
and how many engine requests it starts); each is registered with its release as it is taken, and
`__aexit__` runs every release exactly once, on every path:

- leases: released after the last byte, so that a rollout waits for the requests on the version it retires;
- slots: released after the last byte (a stream holds its slots until it ends, however it ends);
- tokens: settled with what the request is charged (`admission.tokens_to_charge`): nothing for a request
  that was refused (never admitted, or the engine said no).

It is also the serving layer's `RequestHooks` (deadline, token timing, finish reasons): what they learn
goes into the request's record, `middleware.RequestContext`, which the access log and metrics read.
"""

from __future__ import annotations

import contextlib
import time
from types import TracebackType
from typing import TYPE_CHECKING, Awaitable, Protocol

from frontend.policy.admission import NeverFits, Rejected, TokenDemand, TokenReservation, slots_for, tokens_to_charge
from frontend.api_types.errors import OpenAIError, invalid_request, too_many_requests
from frontend.observability.metrics import TokenTiming
from frontend.generation.serving import TextDelta

if TYPE_CHECKING:
    from frontend.http.middleware import Edge, RequestContext


class Leasable(Protocol):
    """A model version's engine: leased while a request that picked it runs (frontend/models/rollout.py)."""

    def lease(self) -> None: ...

    def release(self) -> None: ...


class RequestBudget:
    """The resources of one request (see the module): taken by the route, given back in `__aexit__`."""

    def __init__(self, edge: "Edge | None", record: "RequestContext"):
        self.edge = edge
        self.record = record
        self.admitted_slots = 0  # admission slots held (one per engine request)
        self.admitted = False  # it got its slots: only a request that ran is charged tokens
        self.reservation: TokenReservation | None = None
        self._releases = contextlib.ExitStack()  # each taken resource's release, run once in __aexit__
        self._closed = False

    async def __aenter__(self) -> "RequestBudget":
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Give back everything taken, newest first, each exactly once (also if one release fails)."""
        self._closed = True
        self._releases.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this request's budget is already given back")

    # ----- the resources -----
    async def check_request_rate(self) -> None:
        """Requests per minute of this key (429 if over). Holds nothing."""
        edge = self.edge
        if edge is None:
            return
        try:
            await edge.limits.check_request(self.record.key_id)
        except Rejected as exc:
            edge.metrics.rejected.labels(exc.reason).inc()
            raise too_many_requests(exc.message, exc.retry_after_s, "requests", "rate_limit_exceeded") from None

    def lease(self, engine: Leasable) -> None:
        """Lease the model version's engine until the request's last byte."""
        self._check_open()
        engine.lease()
        self._releases.callback(engine.release)

    async def reserve_tokens(self, demand: TokenDemand, prompt_param: str) -> None:
        """Tokens per minute: reserve what the request may use now (429 while the key's bucket does not hold
        it yet, 400 if it never can), settled at the end with what it was charged (`tokens_to_charge`)."""
        edge = self.edge
        if edge is None:
            return
        self._check_open()
        try:
            reservation = await edge.limits.reserve(self.record.key_id, demand)
        except NeverFits as exc:
            edge.metrics.rejected.labels("tokens_per_minute").inc()
            raise invalid_request(exc.message, prompt_param if exc.param == "prompt" else exc.param,
                                  "tokens_per_minute_exceeded") from None
        except Rejected as exc:
            edge.metrics.rejected.labels(exc.reason).inc()
            raise too_many_requests(exc.message, exc.retry_after_s, "tokens", "rate_limit_exceeded") from None
        self.reservation = reservation
        self._releases.callback(self._settle, edge, reservation)

    def _settle(self, edge: "Edge", reservation: TokenReservation) -> None:
        record = self.record
        edge.limits.settle(reservation, tokens_to_charge(self.admitted, record.status or 500, record.prompt_tokens,
                                                          record.completion_tokens))

    async def admit(self, engine_requests: int) -> None:
        """Wait for admission: one slot per engine request (bounded queue, bounded wait: 429 past them),
        under the request's deadline. Released when the response has been sent."""
        edge = self.edge
        if edge is None:
            return
        self._check_open()
        record = self.record
        acquiring = edge.limits.admit(edge.settings.max_queue_wait_s, slots_for(engine_requests, edge.limits.max_in_flight))
        try:
            admitted = await (record.deadline.run(acquiring) if record.deadline is not None else acquiring)
        except Rejected as exc:
            edge.metrics.rejected.labels(exc.reason).inc()
            raise too_many_requests(exc.message, exc.retry_after_s) from None
        record.queue_s = admitted.waited_s
        admitted_at = time.monotonic()
        self.admitted_slots, self.admitted = admitted.slots, True
        self._releases.callback(lambda: edge.limits.release(admitted, time.monotonic() - admitted_at))
        edge.metrics.queue_time.labels(record.route).observe(record.queue_s)

    # ----- RequestHooks of the serving layer: what they learn goes into the record -----
    async def bounded(self, awaitable: Awaitable[None]) -> None:
        deadline = self.record.deadline
        if deadline is None:
            await awaitable
        else:
            await deadline.run(awaitable)

    def timer(self) -> TokenTiming | None:
        if self.edge is None:
            return None
        record = self.record

        def first(ttft: float) -> None:
            record.ttft_s = ttft if record.ttft_s is None else min(record.ttft_s, ttft)

        # The route has picked the model (routes.model_context) before it starts any generation.
        return TokenTiming(record.started, self.edge.metrics, record.route, record.model, first)

    def record_delta(self, delta: TextDelta) -> None:
        record = self.record
        reason = delta.finish_reason
        if reason is not None:
            record.finish_reason = reason if record.finish_reason in (None, "stop") else record.finish_reason
        if record.completion_text is not None:
            record.completion_text.append(delta.text)

    def record_failure(self, error: OpenAIError) -> None:
        record = self.record
        deadline = record.deadline
        record.finish_reason = (deadline.reason if deadline is not None and deadline.reason
                                else "timeout" if error.code == "timeout" else "error")
