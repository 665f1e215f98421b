"""The coordinator's wire format: one JSON object per line over a Unix socket (frontend/workers/coordinator.py).

Messages are small (a key id, a slot count, a model name), a few per request and none per token, so plain
JSON lines are fast enough and readable in a debugger.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

Message = dict[str, Any]
LINE_LIMIT = 1 << 20  # no message comes near it: only a corrupt peer would


def send(writer: asyncio.StreamWriter, message: Message) -> None:
    """Queue `message` on the connection (the transport writes it; order is kept per connection)."""
    if not writer.is_closing():
        writer.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")


async def receive(reader: asyncio.StreamReader) -> Message | None:
    """The next message, or None when the peer has gone."""
    try:
        line = await reader.readline()
    except (ConnectionError, asyncio.LimitOverrunError, ValueError):
        return None
    if not line:
        return None
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError("a coordinator message is a JSON object")
    return message
