"""The FastAPI application: wiring only (settings, Triton client, edge middleware, routes, error handlers)."""

from __future__ import annotations

import asyncio
import logging
import signal
from contextlib import asynccontextmanager
from typing import AsyncIterator

import anyio
from fastapi import FastAPI

from frontend.http import admin, console, responses_routes
from frontend.observability.console import ConsoleSummary
from frontend.api_types.errors import OpenAIError, install_error_handlers
from frontend.http.middleware import Edge, EdgeMiddleware
from frontend.models.registry import ModelRegistry
from frontend.responses_api.service import ResponsesService
from frontend.models.rollout import SOLO, FleetMember, Rollouts
from frontend.http.routes import router
from frontend.settings import Settings
from frontend.generation.triton_engine import TritonEngine
from frontend.workers.shared import CoordinatorLink, SharedFleet, SharedLimits

log = logging.getLogger("frontend")

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def warn_if_open(settings: Settings, edge: Edge) -> None:
    if edge.keys.enabled:
        log.info("API keys required: %d key(s) loaded%s", len(edge.keys),
                 f" (file {settings.api_keys_file}, reloaded on SIGHUP)" if settings.api_keys_file else "")
        return
    exposure = ("only this machine can reach it" if settings.frontend_host in LOOPBACK_HOSTS or
                settings.frontend_host.startswith("127.") else
                f"ANYONE WHO CAN REACH {settings.frontend_host}:{settings.frontend_port} CAN USE IT")
    log.warning("!!! NO API KEYS CONFIGURED: the server is open, with no authentication (%s). "
                "Set API_KEYS or API_KEYS_FILE to require `Authorization: Bearer <key>`. !!!", exposure)


def create_app(settings: Settings, coordinator: str | None = None) -> FastAPI:
    """The app of one process; `coordinator`: the supervisor's socket when this process is one of several
    workers (frontend/workers/): the limits and rollouts are then the whole server's."""
    link = CoordinatorLink(coordinator) if coordinator else None
    edge = Edge(settings, SharedLimits(link, settings.max_in_flight, settings.rate_limit_tpm) if link else None)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = TritonEngine(settings.triton_grpc_url, settings.engine_model, settings.preprocessing_model,
                              settings.triton_timeout_s, control_key=settings.triton_control_key(),
                              stall_probe_s=settings.engine_stall_probe_s,
                              stream_queue=settings.engine_stream_queue)
        app.state.settings = settings
        app.state.models = ModelRegistry(settings, engine)
        if settings.lora_modules or settings.lora_runtime_updates:  # vllm:lora_requests_info on /metrics
            adapters = app.state.models.adapters
            edge.metrics.live.lora = lambda: (settings.max_loras, *adapters.requests_info())
        if link is not None:  # from here on, other workers' rollouts reach this registry
            await link.connect(FleetMember(app.state.models).run)
        app.state.rollouts = Rollouts(app.state.models, engine, settings.rollout_grace_s,
                                      SharedFleet(link) if link else SOLO)
        warn_if_open(settings, edge)
        loop = asyncio.get_running_loop()
        hup = False
        if settings.api_keys_file is not None or settings.admin_api_keys_file is not None:
            try:  # only possible in the main thread (not under a test client's thread)
                loop.add_signal_handler(signal.SIGHUP, lambda: (edge.keys.reload(), edge.admin_keys.reload()))
                hup = True
            except (RuntimeError, NotImplementedError, ValueError):
                log.warning("cannot listen for SIGHUP here; API_KEYS_FILE will not be reloaded")
        try:
            await app.state.models.all()
        except OpenAIError as exc:  # Triton not up yet: serve 503s and retry on each request
            log.warning("model not loaded yet (%s); will retry on the next request", exc.message)
        # Stored responses: expired ones purged, background responses run, until shutdown. The store opens
        # in the background and when a request needs it: a database that is down costs /v1/responses only.
        async with ResponsesService.running(settings) as app.state.responses:
            yield
        if hup:
            loop.remove_signal_handler(signal.SIGHUP)
        await engine.close()
        if link is not None:
            await link.close()

    app = FastAPI(title="tritonllm OpenAI frontend", lifespan=lifespan)
    app.state.settings = settings
    # Tokenizing and chat-template rendering run in these threads, so that a few megabyte-long prompts
    # cannot stall every open stream on the event loop.
    app.state.tokenizer_threads = anyio.CapacityLimiter(settings.tokenizer_threads)
    app.state.edge = edge
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(responses_routes.router)
    app.include_router(admin.router)
    app.include_router(admin.lora_router)
    if settings.console:  # the browser console (frontend/http/console.py): GET /, its files, its charts' data
        app.state.console = ConsoleSummary()
        app.include_router(console.router)
        app.mount(console.STATIC_PREFIX, console.static_files(), name="console")
    app.add_middleware(EdgeMiddleware, edge=edge)
    return app
