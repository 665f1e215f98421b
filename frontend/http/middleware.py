"""The edge of every HTTP request, as one ASGI middleware: request id, shutdown, auth, body size and read
timeout, deadline, metrics and the access log. Each request gets its record, `RequestContext`
(`request.state.ctx`: what the access log and metrics read), and its `RequestBudget`
(`request.state.budget`, frontend/http/request_budget.py), which the middleware holds open around the app until
the response has been sent in full. Routes stay thin: they take from the budget what applies to them
(requests per minute as a route dependency; the model version's lease; tokens per minute and admission
once the route knows the prompt, max_tokens and how many engine requests it starts), and the budget gives
all of it back, once, however the request ended.

Order for a generation request (POST /v1/chat/completions, /v1/completions):
  draining? 503 -> API key? 401 -> body over the limit? 413, not arrived in time? 408 -> requests/min? 429
  -> the route: tokens/min reserved (429; 400 if it never fits), then one admission slot per engine
  request (bounded queue, bounded wait: 429)
and the slots are held until the response has been sent in full, a stream until its last byte (or until
the client went away). The deadline counts from arrival. Health endpoints are always open; /metrics is
open unless `metrics_require_key`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from frontend.observability import access_log
from frontend.http.admin import ADMIN_PREFIX, LORA_ADMIN_PATHS
from frontend.policy.admission import AdmissionGate, Limits, LocalLimits, RateLimiter, TokenDemand
from frontend.policy.auth import ANONYMOUS, KeyStore, bearer_token
from frontend.policy.deadlines import Deadline, Deadlines
from frontend.api_types.errors import OpenAIError, invalid_api_key, invalid_request, payload_too_large, service_unavailable
from frontend.observability.metrics import CONTENT_TYPE_LATEST, Metrics, TritonMetrics, exposition
from frontend.http.request_budget import RequestBudget
from frontend.generation.serving import UsageCounter
from frontend.settings import Settings

log = logging.getLogger("frontend")

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
HEALTH_PATHS = ("/health/live", "/health/ready")
CONSOLE_PAGE, CONSOLE_STATIC, CONSOLE_SUMMARY = "/", "/console/static/", "/console/summary.json"  # http/console.py
KNOWN_ROUTES = GENERATION_PATHS + HEALTH_PATHS + ("/v1/models", "/tokenize", "/detokenize", "/metrics", CONSOLE_PAGE,
                                                  CONSOLE_SUMMARY)
TIMEOUT_HEADER = "x-request-timeout"


_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")


def client_request_id(value: str | None) -> str | None:
    """The client's X-Request-Id, kept for the access log and echoed back, if it is a plausible id
    (printable ASCII, at most 128 characters). It only labels the request: engine requests get ids
    this server makes, so a reused or forged id cannot touch anyone else's generation."""
    return value if value is not None and _REQUEST_ID.fullmatch(value) else None


def route_label(path: str) -> str:
    """A bounded set of label values (clients choose paths; metrics must not grow with them)."""
    if path in KNOWN_ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model_id}"
    if path.startswith("/v1/responses/"):  # a stored response, its input items, its cancel
        tail = path.rsplit("/", 1)[-1]
        return "/v1/responses/{response_id}" + (f"/{tail}" if tail in ("input_items", "cancel") else "")
    if path.startswith(ADMIN_PREFIX + "/"):
        return ADMIN_PREFIX
    if path.startswith(CONSOLE_STATIC):
        return CONSOLE_STATIC + "{file}"
    return "unmatched"


@dataclass
class RequestContext:
    """The record of one request, `request.state.ctx` in routes: what the access log and the metrics read.
    What the request holds (slots, tokens, leases) is its `RequestBudget` (frontend/http/request_budget.py,
    `request.state.budget`), which also fills in the generation's part of this record."""

    request_id: str
    route: str
    method: str
    started: float  # time.monotonic() at arrival
    key_id: str = ANONYMOUS
    owner: str = ""  # the key's stable owner id (policy/auth.py owner_of) for what it stores; "" without keys
    deadline: Deadline | None = None
    queue_s: float | None = None
    status: int | None = None
    finish_reason: str | None = None  # for generation: stop/length (the last choice's), or how it ended
    prompt_tokens: int = 0
    usage: UsageCounter | None = None  # the generation's, read at the end (completion tokens so far)
    ttft_s: float | None = None
    prompt_text: list[str] | None = None  # only with log_prompts
    completion_text: list[str] | None = None
    model: str = ""  # the served model and engine version the request picked (labels for metrics and the log)
    model_version: str = ""
    budget: RequestBudget | None = field(default=None, repr=False)

    @property
    def completion_tokens(self) -> int:
        return self.usage.completion_tokens if self.usage is not None else 0

    # Shorthands for the request's budget, which owns what these take and gives it back after the last byte.
    async def reserve_tokens(self, demand: TokenDemand, prompt_param: str) -> None:
        if self.budget is not None:
            await self.budget.reserve_tokens(demand, prompt_param)

    async def admit(self, engine_requests: int) -> None:
        if self.budget is not None:
            await self.budget.admit(engine_requests)


class Edge:
    """The shared state behind the middleware: keys, limits, gate, metrics, deadlines, draining."""

    def __init__(self, settings: Settings, limits: Limits | None = None):
        self.settings = settings
        self.keys = KeyStore(settings.api_keys, settings.api_keys_file)
        self.admin_keys = KeyStore(settings.admin_api_keys, settings.admin_api_keys_file)
        # The server's admission and rate limits: this process's own, or the supervisor's for all workers.
        self.limits: Limits = limits or LocalLimits(AdmissionGate(settings.max_in_flight, settings.max_queued),
                                                    RateLimiter(settings.rate_limit_rpm, settings.rate_limit_tpm))
        self.metrics = Metrics()
        # Triton's metrics, relayed on GET /metrics (cached; frontend/observability/metrics.py).
        self.triton_metrics = TritonMetrics(settings.triton_metrics_url, settings.triton_timeout_s,
                                            settings.triton_metrics_cache_s)
        self.deadlines = Deadlines()  # one per generation request of this process, from arrival to its end
        self.draining = False

    async def drain(self, grace_s: float) -> None:
        """SIGTERM: refuse new work (503), let what runs here finish for `grace_s`, then cancel the rest."""
        self.draining = True
        loop = asyncio.get_running_loop()
        log.warning("shutting down: refusing new requests; %d generation request(s) in progress; grace period %g s",
                    len(self.deadlines), grace_s)
        until = loop.time() + grace_s
        while self.deadlines and loop.time() < until:
            await asyncio.sleep(0.05)
        cancelled = self.deadlines.abort_all("shutdown")
        if cancelled:
            log.warning("grace period over: cancelling %d request(s)", cancelled)
        until = loop.time() + 5.0  # the cancelled ones send their error event and [DONE]
        while self.deadlines and loop.time() < until:
            await asyncio.sleep(0.05)

    def timeout_for(self, headers: dict[str, str]) -> float:
        """The setting, lowered (never raised) by a valid X-Request-Timeout header in seconds."""
        timeout = self.settings.request_timeout_s
        raw = headers.get(TIMEOUT_HEADER)
        if raw is not None:
            try:
                asked = float(raw)
            except ValueError:
                raise invalid_request(f"X-Request-Timeout must be a number of seconds, not {raw[:40]!r}",
                                      "X-Request-Timeout") from None
            if not asked > 0 or asked != asked or asked == float("inf"):
                raise invalid_request("X-Request-Timeout must be a positive number of seconds", "X-Request-Timeout")
            timeout = min(timeout, asked)
        return timeout


class _BodyTooLarge(Exception):
    pass


async def _read_body(receive: Receive, limit: int) -> tuple[bytes, bool]:
    """The whole request body (at most `limit` bytes, else _BodyTooLarge), and whether the client left."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(parts), True
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _BodyTooLarge()
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts), False


def _replay(body: bytes, disconnected: bool, receive: Receive) -> Receive:
    """A receive that hands the app the body read already, then passes on to the real one."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        if disconnected:
            return {"type": "http.disconnect"}
        return await receive()

    return replayed


class EdgeMiddleware:
    def __init__(self, app: ASGIApp, edge: Edge):
        self.app = app
        self.edge = edge

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        request_id = client_request_id(headers.get("x-request-id")) or uuid.uuid4().hex
        path = scope.get("path", "")
        ctx = RequestContext(request_id, route_label(path), scope.get("method", ""), time.monotonic())
        # What the request takes (slots, tokens, leases) is given back when the budget exits: after the
        # response's last byte, or however else the handling ended.
        budget = ctx.budget = RequestBudget(self.edge, ctx)
        state = scope.setdefault("state", {})
        state["ctx"], state["budget"] = ctx, budget

        async def send_tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                ctx.status = message["status"]
            await send(message)

        try:
            async with budget:
                try:
                    await self._handle(ctx, path, headers, scope, receive, send_tracked)
                except OpenAIError as exc:
                    await exc.response()(scope, receive, send_tracked)
                except BaseException:
                    if ctx.status is None:
                        ctx.status = 500
                    raise
        finally:
            self._finish(ctx)

    def _reject(self, ctx: RequestContext, reason: str, error: OpenAIError) -> OpenAIError:
        self.edge.metrics.rejected.labels(reason).inc()
        return error

    async def _handle(self, ctx: RequestContext, path: str, headers: dict[str, str], scope: Scope,
                      receive: Receive, send: Send) -> None:
        edge, settings = self.edge, self.edge.settings
        if path in HEALTH_PATHS:
            if edge.draining and path == "/health/ready":
                raise service_unavailable("the server is shutting down")
            await self.app(scope, receive, send)
            return
        # The console's summary is the metrics' (open unless metrics_require_key); its page and files hold no
        # secret and ask for a key themselves, so they are served without one (GET only).
        is_metrics = path in ("/metrics", CONSOLE_SUMMARY)
        is_page = (path == CONSOLE_PAGE or path.startswith(CONSOLE_STATIC)) and scope.get("method") in ("GET", "HEAD")
        if edge.draining and not is_metrics:
            raise self._reject(ctx, "shutting_down", service_unavailable(
                "the server is shutting down; not accepting new requests"))
        # /admin checks admin keys itself (frontend/http/admin.py): an API key must not open it, nor an admin
        # key the API.
        is_admin = path.startswith(ADMIN_PREFIX + "/") or path in LORA_ADMIN_PATHS
        if edge.keys.enabled and not is_admin and not is_page and (not is_metrics or settings.metrics_require_key):
            identity = edge.keys.identify(bearer_token(headers.get("authorization")))
            if identity is None:
                missing = bearer_token(headers.get("authorization")) is None
                raise self._reject(ctx, "unauthorized", invalid_api_key(
                    "You didn't provide an API key. Provide it as 'Authorization: Bearer <key>'." if missing
                    else "Incorrect API key provided."))
            ctx.key_id, ctx.owner = identity
        if path == "/metrics" and scope.get("method") in ("GET", "HEAD"):
            body = await exposition(edge.metrics, edge.triton_metrics, await edge.limits.occupancy())
            await Response(body, media_type=CONTENT_TYPE_LATEST)(scope, receive, send)
            return
        generation = path in GENERATION_PATHS and scope.get("method") == "POST"
        if generation:  # counted from arrival: reading the body, waiting for a slot and generating all count
            ctx.deadline = Deadline(edge.timeout_for(headers))
            edge.deadlines.add(ctx.deadline)
        try:
            if scope.get("method") in ("POST", "PUT", "PATCH"):
                receive = await self._read_body(ctx, headers, receive)
            await self.app(scope, receive, send)
        finally:
            if ctx.deadline is not None:
                edge.deadlines.discard(ctx.deadline)

    async def _read_body(self, ctx: RequestContext, headers: dict[str, str], receive: Receive) -> Receive:
        """The whole body, within the size limit and the body-read timeout (a client that sends half a body
        and then nothing must not hold its connection: 408, and the connection is closed)."""
        settings = self.edge.settings
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > settings.max_body_bytes:
            raise self._reject(ctx, "body_too_large", payload_too_large(settings.max_body_bytes))
        timeout_s = settings.body_read_timeout_s
        remaining = ctx.deadline.remaining() if ctx.deadline is not None else None
        if remaining is not None:
            timeout_s = min(timeout_s, remaining)
        try:
            body, disconnected = await asyncio.wait_for(_read_body(receive, settings.max_body_bytes), timeout_s)
        except _BodyTooLarge:
            raise self._reject(ctx, "body_too_large", payload_too_large(settings.max_body_bytes)) from None
        except asyncio.TimeoutError:
            raise self._reject(ctx, "body_timeout", OpenAIError(
                408, f"the request body did not arrive within {timeout_s:g} s", "invalid_request_error", None,
                "body_timeout", {"Connection": "close"})) from None
        return _replay(body, disconnected, receive)

    def _finish(self, ctx: RequestContext) -> None:
        """Metrics and the access log; what the request held is given back already (its budget)."""
        edge = self.edge
        duration = time.monotonic() - ctx.started
        status = ctx.status or 500
        finish = ctx.finish_reason
        if finish is None and ctx.route in GENERATION_PATHS:
            if status == 200:
                finish = "cancelled"  # a stream whose client went away before the end
            elif status == 504:
                finish = "timeout"
            elif status == 499:
                finish = "cancelled"
            elif ctx.deadline is not None and ctx.deadline.reason == "shutdown":
                finish = "shutdown"
            elif status >= 500:
                finish = "error"
        finish = finish or "none"
        m = edge.metrics
        m.requests.labels(ctx.route, str(status), finish, ctx.model, ctx.model_version).inc()
        m.duration.labels(ctx.route).observe(duration)
        if ctx.route in GENERATION_PATHS:
            if ctx.prompt_tokens:
                m.prompt_tokens.labels(ctx.route, ctx.model, ctx.model_version).inc(ctx.prompt_tokens)
            if ctx.completion_tokens:
                m.completion_tokens.labels(ctx.route, ctx.model, ctx.model_version).inc(ctx.completion_tokens)
        if ctx.route in HEALTH_PATHS or ctx.route in ("/metrics", CONSOLE_SUMMARY):
            return  # probes and scrapes: metrics only, no log line each
        fields: dict[str, Any] = {
            "request_id": ctx.request_id, "method": ctx.method, "route": ctx.route, "status": status,
            "model": ctx.model or None, "model_version": ctx.model_version or None,
            "key_id": ctx.key_id, "duration_s": duration, "queue_s": ctx.queue_s, "ttft_s": ctx.ttft_s,
            "prompt_tokens": ctx.prompt_tokens, "completion_tokens": ctx.completion_tokens,
            "finish_reason": finish if ctx.route in GENERATION_PATHS else None,
        }
        if edge.settings.log_prompts and ctx.prompt_text is not None:
            fields["prompt"] = ctx.prompt_text
            fields["completion"] = "".join(ctx.completion_text or [])
        access_log.log_request(fields)
