"""`python -m frontend [--flags]`: run the OpenAI frontend with uvicorn."""

from __future__ import annotations

import logging

import uvicorn

from frontend.app import create_app
from frontend.settings import Settings


def main() -> None:
    settings = Settings(_cli_parse_args=True)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(settings), host=settings.frontend_host, port=settings.frontend_port,
                log_level=settings.log_level, timeout_graceful_shutdown=10)


if __name__ == "__main__":
    main()
