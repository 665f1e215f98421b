"""What the frontend must know about each served model, and which engine model version serves it.

Two ways to serve (frontend/settings.py):
- one engine model (ENGINE_MODEL), described by Triton's configs: the default `make serve`;
- every named model of a repository (MODEL_REPOSITORY, `make engine NAME=...`), each at its live version,
  described by that version's own files (build_engine/model_store.py). A rollout swaps a model's context
  for the new version's (frontend/rollout.py) while requests that picked the old one finish on it.

Contexts load lazily and are retried on every request until they load, so the frontend can start before
Triton and recover if Triton was down at start; settings given explicitly win over what Triton says.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

from build_engine import model_store
from frontend.engine import EngineMetadata, EngineRequest, TokenChunk
from frontend.errors import OpenAIError, service_unavailable
from frontend.schemas import ModelVersion
from frontend.settings import Settings
from frontend.tokenizer import Tokenizer
from frontend.tool_parsers import parser_for_template
from frontend.triton_engine import TritonEngine

log = logging.getLogger("frontend")


class VersionEngine:
    """One engine model version, as the serving layer sees it (an `LLMEngine`).

    It counts leases: a request takes one when it picks this version (before it tokenizes, waits for
    admission or generates) and returns it after its last byte, so a rollout knows when every request
    that chose the old version is done with it.
    """

    def __init__(self, triton: TritonEngine, model: str | None, version: str = ""):
        self.triton = triton
        self.model = model  # None: the settings' engine model
        self.version = version  # "": the version Triton picks
        self._leases = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def lease(self) -> None:
        self._leases += 1
        self._idle.clear()

    def release(self) -> None:
        self._leases -= 1
        if self._leases == 0:
            self._idle.set()

    @property
    def leases(self) -> int:
        return self._leases

    async def drained(self, timeout_s: float) -> bool:
        """Wait until no request holds this version (True), or `timeout_s` passes (False)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    def generate(self, request: EngineRequest) -> AsyncIterator[TokenChunk]:
        return self.triton.generate(request, self.model, self.version)

    async def is_ready(self) -> bool:
        return await self.triton.is_ready(self.model, self.version)

    async def metadata(self) -> EngineMetadata:
        return await self.triton.metadata(self.model)

    async def close(self) -> None:
        """The Triton client is shared; TritonEngine.close() closes it."""


@dataclass(frozen=True)
class ModelContext:
    served_model_name: str
    context_length: int
    tokenizer: Tokenizer
    max_top_logprobs: int  # most alternatives per token the engine can return (0: none)
    tool_call_parser: str | None = None  # the family parser for tool_choice auto (frontend/tool_parsers.py)
    reasoning_parser: str | None = None
    engine: VersionEngine | None = None  # where its requests go (None only in unit tests)
    version: str = ""  # the engine model version serving it ("": the single engine model's)


class ModelRegistry:
    """The served models by id: one context each, loaded on first use, replaced by rollouts."""

    def __init__(self, settings: Settings, triton: TritonEngine):
        self._settings = settings
        self._triton = triton
        self._repository = settings.model_repository
        self._contexts: dict[str | None, ModelContext] = {}
        self._served: list[str] | None = None  # named models served: those on disk at start, + rolled out
        self._lock = asyncio.Lock()

    @property
    def named(self) -> bool:
        """Whether the models are a repository's named models (else: the one engine model)."""
        return self._repository is not None

    def store(self) -> list[model_store.ManagedModel]:
        return model_store.managed_models(self._repository) if self._repository is not None else []

    def find(self, name: str) -> model_store.ManagedModel:
        """A named model's directory (served or only built); 404 if there is none."""
        for model in self.store():
            if model.name == name:
                return model
        raise self.not_found(name)

    def served_ids(self) -> list[str]:
        """A model built while serving joins when it is rolled out (Triton loads it then), not before."""
        if self.named:
            if self._served is None:
                self._served = [m.name for m in self.store()]
            return list(self._served)
        single = self._contexts.get(None)
        return [single.served_model_name] if single is not None else []

    async def get(self, model: str | None = None) -> ModelContext:
        """The context of `model` (None: the default one). 404 for a model this server does not serve."""
        key = model if self.named else None
        if self.named and key is None:
            ids = self.served_ids()
            if not ids:
                raise service_unavailable(f"no named model in {self._repository}; build one with "
                                          "`make engine NAME=...`")
            key = ids[0]
        context = self._contexts.get(key)
        if context is None:
            if self.named and key not in self.served_ids():
                raise self.not_found(key or "")
            async with self._lock:
                context = self._contexts.get(key)
                if context is None:
                    context = await self._load(key)
                    self._contexts[key] = context
                    log.info("serving %s%s (context length %d, tool-call parser %s)", context.served_model_name,
                             f" version {context.version}" if context.version else "", context.context_length,
                             context.tool_call_parser or "none")
        if model is not None and model != context.served_model_name:
            raise self.not_found(model)
        return context

    async def all(self) -> list[ModelContext]:
        return [await self.get(name) for name in self.served_ids()] if self.named else [await self.get()]

    def not_found(self, model: str) -> OpenAIError:
        ids = ", ".join(f"'{i}'" for i in self.served_ids()) or "none loaded yet"
        return OpenAIError(404, f"The model '{model}' does not exist; this server serves {ids}",
                           "invalid_request_error", "model", "model_not_found")

    def versions(self, context: ModelContext) -> dict[str, Any]:
        """A named model's card fields: the live version, the rollback target and every version on disk with
        its engine record (nothing for the single engine model)."""
        if not self.named:
            return {}
        model = self.find(context.served_model_name)
        versions = []
        for version in model.versions():
            record = model.record(version)
            versions.append(ModelVersion(version=version, status="live" if str(version) == context.version else "on_disk",
                                         source=record.get("source"), checkpoint_sha256=record.get("checkpoint_sha256"),
                                         built_at=record.get("built_at")))
        return {"live_version": int(context.version), "previous_version": model.previous_version,
                "versions": versions}

    def switch(self, context: ModelContext) -> ModelContext | None:
        """Route the model's new requests to `context`; returns the context they went to before."""
        previous = self._contexts.get(context.served_model_name)
        self._contexts[context.served_model_name] = context
        if context.served_model_name not in self.served_ids():
            self._served = [*self.served_ids(), context.served_model_name]
        return previous

    async def _load(self, key: str | None) -> ModelContext:
        if key is None:
            return await self._load_single()
        try:
            return await self.load_version(key, self.find(key).live_version)
        except (model_store.ModelStoreError, OSError, KeyError, ValueError) as exc:
            raise service_unavailable(f"the model {key!r} cannot be loaded: {exc}") from exc

    async def load_version(self, name: str, version: int) -> ModelContext:
        """A named model's context at `version`: that version's tokenizer, template and context length."""
        s = self._settings
        model = self.find(name)
        record = model.record(version)
        engine = VersionEngine(self._triton, name, str(version))
        asked = await engine.metadata()  # what the engine can do (top log-probs) is only known there
        tokenizer = await asyncio.to_thread(Tokenizer, model.checkpoint_dir(version), s.chat_template)
        return ModelContext(name, int(record["max_seq_len"]), tokenizer, asked.max_top_logprobs,
                            s.tool_call_parser or parser_for_template(tokenizer.chat_template), s.reasoning_parser,
                            engine, str(version))

    async def _load_single(self) -> ModelContext:
        s = self._settings
        engine = VersionEngine(self._triton, None)
        asked = await engine.metadata()  # always: what the engine can do is only known there
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
        name = s.served_model_name or asked.served_model_name or Path(tokenizer_dir).name
        tokenizer = await asyncio.to_thread(Tokenizer, tokenizer_dir, s.chat_template)
        tool_call_parser = s.tool_call_parser or parser_for_template(tokenizer.chat_template)
        return ModelContext(name, context_length, tokenizer, asked.max_top_logprobs, tool_call_parser,
                            s.reasoning_parser, engine)

    async def is_ready(self) -> bool:
        """Every served model's version ready in Triton (the single engine model's, by default)."""
        if not self.named:
            return await self._triton.is_ready()
        models = [model for model in self.store() if model.name in self.served_ids()]
        if not models:
            return False
        for model in models:
            current = self._contexts.get(model.name)
            version = current.version if current is not None else str(model.live_version)
            if not await self._triton.is_ready(model.name, version):
                return False
        return True
