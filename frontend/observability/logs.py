"""How every frontend process logs: one format, with the process id (with several workers, which one said it)."""

from __future__ import annotations

import logging

from frontend.observability import access_log


def configure_logging(level: str, access_log_on: bool) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    access_log.configure(access_log_on)
