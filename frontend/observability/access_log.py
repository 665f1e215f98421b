"""One JSON line per request on the `frontend.access` logger (stderr): who, what, how long, how much.

Prompt and completion text are included only when the `log_prompts` setting is on; API keys never are
(only `key_id`, a salted HMAC of the key: see frontend/policy/auth.py).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

access_log = logging.getLogger("frontend.access")


def configure(enabled: bool) -> None:
    """Raw JSON lines on stderr, whatever format the rest of the logging uses."""
    access_log.handlers.clear()
    access_log.propagate = False
    if not enabled:
        access_log.disabled = True
        return
    access_log.disabled = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access_log.addHandler(handler)
    access_log.setLevel(logging.INFO)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def log_request(fields: dict[str, Any]) -> None:
    if access_log.disabled or not access_log.isEnabledFor(logging.INFO):
        return
    record = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() * 1000) % 1000:03d}Z",
              "event": "request"}
    for key, value in fields.items():
        record[key] = _round(value) if isinstance(value, float) else value
    access_log.info(json.dumps(record, ensure_ascii=False, separators=(",", ":")))
