"""What the frontend must know about the served model, learned from Triton once it is reachable.

Loaded lazily and retried on every request until it succeeds, so the frontend can start before Triton
and recover if Triton was down at start; settings given explicitly always win over Triton's configs.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from frontend.engine import LLMEngine
from frontend.errors import service_unavailable
from frontend.settings import Settings
from frontend.tokenizer import Tokenizer
from frontend.tool_parsers import parser_for_template

log = logging.getLogger("frontend")


@dataclass(frozen=True)
class ModelContext:
    served_model_name: str
    context_length: int
    tokenizer: Tokenizer
    max_top_logprobs: int  # most alternatives per token the engine can return (0: none)
    tool_call_parser: str | None = None  # the family parser for tool_choice auto (frontend/tool_parsers.py)
    reasoning_parser: str | None = None


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
                log.info("serving %s (context length %d, tool-call parser %s)", self._context.served_model_name,
                         self._context.context_length, self._context.tool_call_parser or "none")
        return self._context

    async def _load(self) -> ModelContext:
        s = self._settings
        asked = await self._engine.metadata()  # always: what the engine can do is only known there
        tokenizer_dir = s.tokenizer_dir or asked.tokenizer_dir
        if tokenizer_dir is None:
            raise service_unavailable(
                f"Triton's {s.preprocessing_model!r} model does not name a tokenizer_dir; "
                "start the frontend with --tokenizer-dir")
        context_length = s.context_length or asked.context_length or 0
        if context_length <= 0:
            raise service_unavailable(
                f"Triton's {s.engine_model!r} model does not give max_seq_len; start the frontend with "
                "--context-length")
        name = s.served_model_name or asked.served_model_name or tokenizer_dir.name
        tokenizer = await asyncio.to_thread(Tokenizer, tokenizer_dir, s.chat_template)
        tool_call_parser = s.tool_call_parser or parser_for_template(tokenizer.chat_template)
        return ModelContext(name, context_length, tokenizer, asked.max_top_logprobs, tool_call_parser,
                            s.reasoning_parser)
