"""One frontend process serving HTTP(S) with uvicorn: its configuration (TLS floor included) and the draining
server that SIGTERM drains instead of stopping (frontend/__main__.py for the whole story)."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from frontend.http.app import create_app
from frontend.http.middleware import Edge
from frontend.settings import Settings

MINIMUM_TLS = ssl.TLSVersion.TLSv1_2


def tls_context(config: uvicorn.Config, default_factory: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
    """uvicorn's own context (certificate, key, `ssl_ciphers`, ALPN) with TLS 1.2 as the floor.

    uvicorn has no minimum-version setting. PROTOCOL_TLS_SERVER already starts at TLS 1.2 on Python 3.10+,
    but only by default: OpenSSL's system configuration (MinProtocol) or another Python build can lower it,
    so the floor is set here explicitly, and only ever raised.
    """
    context = default_factory()
    if context.minimum_version < MINIMUM_TLS:  # also TLSVersion.MINIMUM_SUPPORTED (-2)
        context.minimum_version = MINIMUM_TLS
    return context


def build_config(app: Callable[..., Any], settings: Settings) -> uvicorn.Config:
    """The uvicorn configuration from the settings (separate from main() so that tests can serve with it)."""
    tls = settings.ssl_certfile is not None
    return uvicorn.Config(
        app, host=settings.frontend_host, port=settings.frontend_port,
        # libuv's event loop and the C HTTP parser (the frontend extra pins both): every streamed token
        # is a gRPC read, an SSE write and a few event-loop turns, and on a small CPU box they compete with
        # the engine's forward pass for the cores.
        loop="uvloop", http="httptools",
        log_level=settings.log_level, timeout_graceful_shutdown=10,
        access_log=not settings.access_log,  # ours is one JSON line per request
        limit_concurrency=settings.limit_concurrency,  # past it uvicorn answers 503 before the app sees it
        # uvicorn's annotation says int, but the value only goes to loop.call_later: fractions work.
        timeout_keep_alive=settings.timeout_keep_alive_s,  # type: ignore[arg-type]
        ssl_certfile=str(settings.ssl_certfile) if tls else None,
        ssl_keyfile=str(settings.ssl_keyfile) if settings.ssl_keyfile else None,
        ssl_version=ssl.PROTOCOL_TLS_SERVER,  # negotiates the highest version both sides have
        ssl_ciphers=settings.ssl_ciphers,
        ssl_context_factory=tls_context if tls else None)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, edge: Edge, grace_s: float):
        super().__init__(config)
        self._edge = edge
        self._grace_s = grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: object | None = None

    async def serve(self, sockets=None) -> None:  # type: ignore[no-untyped-def]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or self._loop is None or not self.started:
            super().handle_exit(sig, frame)  # second signal (or not serving yet): uvicorn's own handling
            return
        self._captured_signals.append(sig)  # uvicorn re-raises it after shutdown, as it would have
        self._drain_task = asyncio.run_coroutine_threadsafe(self._drain(), self._loop)  # type: ignore[assignment]

    async def _drain(self) -> None:
        try:
            await self._edge.drain(self._grace_s)
        finally:
            self.should_exit = True


def run(settings: Settings, coordinator: str | None = None, sockets: list[socket.socket] | None = None) -> None:
    """Serve until SIGTERM (drained) or a second signal: alone, or as one of several workers on `sockets`."""
    app = create_app(settings, coordinator)
    DrainingServer(build_config(app, settings), app.state.edge, settings.shutdown_grace_s).run(sockets=sockets)
