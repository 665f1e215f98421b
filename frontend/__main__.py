"""`python -m frontend [--flags]`: run the OpenAI frontend with uvicorn (HTTPS with --ssl-certfile/keyfile).

SIGTERM (or a first Ctrl+C) drains: new requests get 503 and /health/ready turns 503 while the listener
stays open, requests in flight get `shutdown_grace_s` to finish, the rest are cancelled (streams end with
an error event and [DONE]), then uvicorn stops. A second signal stops at once. SIGHUP reloads API_KEYS_FILE.
"""

from __future__ import annotations

import asyncio
import logging
from types import FrameType

import uvicorn

from frontend import access_log
from frontend.app import create_app
from frontend.middleware import Edge
from frontend.settings import Settings

log = logging.getLogger("frontend")


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


def main() -> None:
    settings = Settings(_cli_parse_args=True)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    access_log.configure(settings.access_log)
    app = create_app(settings)
    config = uvicorn.Config(app, host=settings.frontend_host, port=settings.frontend_port,
                            log_level=settings.log_level, timeout_graceful_shutdown=10,
                            access_log=not settings.access_log,  # ours is one JSON line per request
                            ssl_certfile=str(settings.ssl_certfile) if settings.ssl_certfile else None,
                            ssl_keyfile=str(settings.ssl_keyfile) if settings.ssl_keyfile else None)
    DrainingServer(config, app.state.edge, settings.shutdown_grace_s).run()


if __name__ == "__main__":
    main()
