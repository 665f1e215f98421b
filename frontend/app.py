"""The FastAPI application: wiring only (settings, Triton client, routes, error handlers)."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI

from frontend.errors import OpenAIError, install_error_handlers
from frontend.model_context import ModelContextLoader
from frontend.routes import router
from frontend.settings import Settings
from frontend.triton_engine import TritonEngine

log = logging.getLogger("frontend")


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = TritonEngine(settings.triton_grpc_url, settings.engine_model, settings.triton_timeout_s)
        app.state.settings = settings
        app.state.engine = engine
        app.state.contexts = ModelContextLoader(settings, engine)
        try:
            await app.state.contexts.get()
        except OpenAIError as exc:  # Triton not up yet: serve 503s and retry on each request
            log.warning("model not loaded yet (%s); will retry on the next request", exc.message)
        yield
        await engine.close()

    app = FastAPI(title="tritonllm OpenAI frontend", lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(router)
    return app
