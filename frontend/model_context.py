"""What the frontend must know about the served model, learned from Triton once it is reachable.

Loaded lazily and retried on every request until it succeeds, so the frontend can start before Triton
and recover if Triton was down at start; settings given explicitly always win over Triton's configs.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from frontend.engine import EngineMetadata, LLMEngine
from frontend.errors import service_unavailable
from frontend.settings import Settings
from frontend.tokenizer import Tokenizer

log = logging.getLogger("frontend")


@dataclass(frozen=True)
class ModelContext:
    served_model_name: str
    context_length: int
    tokenizer: Tokenizer


class ModelContextLoader:
    def __init__(self, settings: Settings, engine: LLMEngine):
        self._settings = settings
        self._engine = engine
        self._context: ModelContext | None = None
        self._lock = asyncio.Lock()

    @property
    def loaded(self) -> ModelContext | None:
        return self._context

    async def get(self) -> ModelContext:
        if self._context is not None:
            return self._context
        async with self._lock:
            if self._context is None:
                self._context = await self._load()
                log.info("serving %s (context length %d)", self._context.served_model_name,
                         self._context.context_length)
        return self._context

    async def _load(self) -> ModelContext:
        s = self._settings
        known = EngineMetadata(s.served_model_name, s.tokenizer_dir, s.context_length)
        if None in (known.served_model_name, known.tokenizer_dir, known.context_length):
            asked = await self._engine.metadata()
        else:
            asked = known
        tokenizer_dir = known.tokenizer_dir or asked.tokenizer_dir
        if tokenizer_dir is None:
            raise service_unavailable(
                f"Triton's {s.preprocessing_model!r} model does not name a tokenizer_dir; "
                "start the frontend with --tokenizer-dir")
        context_length = known.context_length or asked.context_length or 0
        if context_length <= 0:
            raise service_unavailable(
                f"Triton's {s.engine_model!r} model does not give max_seq_len; start the frontend with "
                "--context-length")
        name = known.served_model_name or asked.served_model_name or tokenizer_dir.name
        tokenizer = await asyncio.to_thread(Tokenizer, tokenizer_dir, s.chat_template)
        return ModelContext(name, context_length, tokenizer)
