"""Server-sent events framing, exactly as OpenAI streams it: `data: <json>` + blank line, no `event:`."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"


def sse_data(payload: str) -> bytes:
    """Frame one JSON document. JSON never holds a raw newline, so one `data:` line is enough."""
    if "\n" in payload or "\r" in payload:
        raise ValueError("an SSE data line must not contain a newline")
    return f"data: {payload}\n\n".encode("utf-8")


def sse_json(obj: dict[str, Any]) -> bytes:
    return sse_data(json.dumps(obj, ensure_ascii=False, separators=(",", ":")))
