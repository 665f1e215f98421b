"""What the frontend must know about each served model, and which engine model version serves it.

Two ways to serve (frontend/settings.py):
- one engine model (ENGINE_MODEL), described by Triton's configs: the default `make serve`;
- every named model of a repository (MODEL_REPOSITORY, `make engine NAME=...`), each at its live version,
  described by that version's own files (build_engine/model_store.py). A rollout swaps a model's context
  for the new version's (frontend/models/rollout.py) while requests that picked the old one finish on it.

Contexts load lazily, one load at a time per model (its requests wait for that load; a failure is kept for
LOAD_FAILURE_KEPT_S, so a burst of requests costs Triton one load, not one each), and are retried after that
until they load: the frontend can start before Triton and recover if Triton was down at start. Settings given
explicitly win over what Triton says. Nothing here reads the disk on the event loop (a thread does).

Which named models are served is what Triton has loaded (its repository index), not what is on disk: a model
built while serving joins when a rollout loads it, and one that failed to load is left out instead of making
every listing fail. A model's context is replaced under one lock (`switch()`, the lazy load, `refresh()`), and
`refresh()` re-routes a model whose version Triton no longer has ready (after a Triton restart, say) to the
version rollout.json names. A model whose live version Triton lacks is reported (503s, a log line), not
repaired here: the launcher owns that repair (launcher/engine_health.py settles the files, then loads), so one
party, not one per frontend worker, asks Triton to load it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

from build_engine import model_store
from frontend.generation.engine import EngineMetadata, EngineRequest, TokenChunk
from frontend.api_types.errors import OpenAIError, service_unavailable
from frontend.api_types.reply_bodies import ModelVersion
from frontend.settings import Settings
from frontend.text.tokenizer import Tokenizer
from frontend.parsing.tool_parsers import parser_for_template
from frontend.generation.triton_engine import STOP_GRACE_S, TritonEngine
from frontend.models.adapters import AdapterSet, AdapterSpec, parse_lora_modules
from frontend.models.lora import AdapterError, BaseShapes

log = logging.getLogger("frontend")

# Triton's repository index states (frontend/generation/triton_control.py TritonControl.model_index).
READY, LOADING = "READY", "LOADING"
# A request's 503, or a model name not in the last index, makes a request re-read Triton's index, at most this
# often: a client retrying a mistyped model id gets 404s from the last index, not a repository scan each.
REFRESH_AFTER_FAILURE_S = 1.0
LOAD_FAILURE_KEPT_S = 1.0  # a model's failed load answers the requests waiting on it (and later ones) this long
REPORT_EVERY_S = 30.0  # how often a model whose live version Triton lacks is logged again
RETIRE_MARGIN_S = 1.0  # past a stop's grace (its call cancelled), how long retired requests get to give back


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
        self.suspect = False  # a request on it got a 503: the registry re-reads Triton's index (refresh())

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

    async def drain_or_retire(self, grace_s: float) -> bool:
        """Wait up to `grace_s` for the requests on this version to finish (True); past it, stop the rest by
        id, each ending with a 503 (the rollout's promise), and wait for them to go (False). Triton would
        otherwise hold the unload until the longest of them ended on its own (executorImpl.cpp's loop runs
        while requests are active)."""
        if await self.drained(grace_s):
            return True
        failure = service_unavailable(f"version {self.version or '?'} of this model was retired by a rollout "
                                      "before the request ended; retry it (the new version serves it)")
        self.triton.retire(self.model, self.version, failure)
        await self.drained(STOP_GRACE_S + RETIRE_MARGIN_S)
        return False

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenChunk]:
        async with contextlib.aclosing(self.triton.generate(request, self.model, self.version)) as chunks:
            try:
                async for chunk in chunks:
                    yield chunk
            except OpenAIError as exc:
                if exc.status == 503:  # Triton restarted, or this version is gone: re-check what it serves
                    self.suspect = True
                raise

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
    tool_call_parser: str | None = None  # the family parser for tool_choice auto (frontend/parsing/tool_parsers.py)
    reasoning_parser: str | None = None
    engine: VersionEngine | None = None  # where its requests go (None only in unit tests)
    version: str = ""  # the engine model version serving it ("": the single engine model's)
    log_probs: str = "model"  # what the engine's log-probs are (EngineMetadata.log_probs)
    parent: str | None = None  # a LoRA adapter's base model (frontend/models/adapters.py); None: a model
    root: str | None = None  # a LoRA adapter's directory


class ModelRegistry:
    """The served models by id: one context each, loaded on first use, replaced by rollouts."""

    def __init__(self, settings: Settings, triton: TritonEngine):
        self._settings = settings
        self._triton = triton
        self._repository = settings.model_repository
        self._contexts: dict[str | None, ModelContext] = {}
        self._served: list[str] | None = None  # named models served: what Triton's index said at the last
        # refresh() (loaded or loading), + rolled out since; None: not read yet
        self._locks: dict[str | None, asyncio.Lock] = {}  # per model: every change of its context (_lock_for)
        self._failed_loads: dict[str | None, tuple[float, OpenAIError]] = {}  # when, and why, a load last failed
        self._unloaded: dict[str, str] = {}  # named models Triton tried to load and does not have: their states
        self._refreshed_at = -REFRESH_AFTER_FAILURE_S
        self._reported_at: dict[str, float] = {}
        self._holds: dict[str, asyncio.Event] = {}  # models whose new requests wait for a version swap: held()
        # Models whose versions a rollout of this worker is switching (frontend/models/rollout.py: "one rollout per
        # model"); refresh() leaves their contexts to it.
        self.rolling: set[str] = set()
        # LoRA adapters (frontend/models/adapters.py): listed and selected like models.
        self.adapters = AdapterSet(parse_lora_modules(settings.lora_modules), settings.lora_max_rank,
                                   settings.lora_state_file)
        self._shadowed_reported: set[str] = set()  # adapters named like a served model, logged once each

    @property
    def named(self) -> bool:
        """Whether the models are a repository's named models (else: the one engine model)."""
        return self._repository is not None

    def _lock_for(self, key: str | None) -> asyncio.Lock:
        """The lock of one model's context: its lazy load, switch() and _drop() hold it, so no context is stored
        over another; loads of different models do not wait for each other."""
        return self._locks.setdefault(key, asyncio.Lock())

    def store(self) -> list[model_store.ManagedModel]:
        """The named models on disk (a directory scan: call it from a thread on the serving path)."""
        return model_store.managed_models(self._repository) if self._repository is not None else []

    def find(self, name: str) -> model_store.ManagedModel:
        """A named model's directory (served or only built); 404 if there is none."""
        for model in self.store():
            if model.name == name:
                return model
        raise self.not_found(name)

    def served_ids(self) -> list[str]:
        """The named models Triton has loaded, as of the last refresh(): a model built while serving joins
        when it is rolled out (Triton loads it then), not before."""
        if self.named:
            return list(self._served or [])
        single = self._contexts.get(None)
        return [single.served_model_name] if single is not None else []

    async def get(self, model: str | None = None) -> ModelContext:
        """The context of `model` (None: the default one). 404 for a model this server does not serve. A LoRA
        adapter named like a served model never hides it (`_shadowed`)."""
        spec = self.adapters.spec(model) if model is not None else None
        if spec is not None and spec.base != spec.name:  # (an adapter that names itself as its base is shadowed)
            base = await self.get(spec.base)
            if not self._shadowed(spec):
                return await self.adapter_context(spec, base)
        key = model if self.named else None
        if self.named and (self._served is None or (key is not None and key not in self._served
                                                    and not self._index_is_fresh())):
            await self.refresh()  # 503 when Triton does not answer
        if self.named and key is None:
            ids = self.served_ids()
            if not ids:
                raise service_unavailable(f"no named model in {self._repository}; build one with "
                                          "`make engine NAME=...`")
            key = ids[0]
        if key is not None and key in self._holds:
            await self._wait_for_swap(key)
        context = self._contexts.get(key)
        if (self.named and context is not None and context.engine is not None and context.engine.suspect
                and not self._index_is_fresh()):
            with contextlib.suppress(OpenAIError):
                await self.refresh()
            context = self._contexts.get(key)
        if context is None:
            if self.named and key not in self.served_ids():
                if key in self._unloaded:  # loaded once (or tried): Triton's trouble, not the client's
                    raise service_unavailable(f"the model {key!r} is not loaded in Triton "
                                              f"({self._unloaded[key]}); retry the request later")
                raise self.not_found(key or "")
            async with self._lock_for(key):  # requests for this model wait for one load; switch() holds it too
                context = self._contexts.get(key)
                if context is None:
                    context = await self._load_once(key)
                    self._contexts[key] = context
                    log.info("serving %s%s (context length %d, tool-call parser %s)", context.served_model_name,
                             f" version {context.version}" if context.version else "", context.context_length,
                             context.tool_call_parser or "none")
        if model is not None and model != context.served_model_name:
            raise self.not_found(model)
        return context

    def _index_is_fresh(self) -> bool:
        return time.monotonic() - self._refreshed_at < REFRESH_AFTER_FAILURE_S

    async def _load_once(self, key: str | None) -> ModelContext:
        """Load `key`'s context, unless its last load failed less than LOAD_FAILURE_KEPT_S ago: then that
        failure again (the requests that queued behind a failing load do not each retry it)."""
        failed = self._failed_loads.get(key)
        if failed is not None and time.monotonic() - failed[0] < LOAD_FAILURE_KEPT_S:
            raise failed[1]
        try:
            context = await self._load(key)
        except OpenAIError as exc:
            self._failed_loads[key] = (time.monotonic(), exc)
            raise
        self._failed_loads.pop(key, None)
        return context

    def _is_model_name(self, name: str) -> bool:
        """A name a served model answers to (as of the last refresh, or of the contexts loaded)."""
        return name in self.served_ids() or any(c.served_model_name == name for c in self._contexts.values())

    def _shadowed(self, spec: AdapterSpec) -> bool:
        """An adapter (LORA_MODULES, or loaded before the model appeared) named like a served model: the model
        keeps its name, the adapter is neither served nor listed; said once in the log."""
        if not self._is_model_name(spec.name):
            return False
        if spec.name not in self._shadowed_reported:
            self._shadowed_reported.add(spec.name)
            log.error("LoRA adapter %s (%s) has the name of a served model: the model is served under it, the "
                      "adapter is not; give the adapter another name", spec.name, spec.path)
        return True

    async def adapter_context(self, spec: AdapterSpec, base: ModelContext | None = None) -> ModelContext:
        """An adapter's context: its base model's (`base`, when the caller has it), named after the adapter,
        with an engine that sends the adapter with each request. A base the server does not serve is a 404; an
        adapter that cannot serve it a 400."""
        base = base if base is not None else await self.get(spec.base)
        try:
            adapter = self.adapters.converted(spec) or await asyncio.to_thread(
                lambda: self.adapters.adapter(spec, base_shapes(base)))  # read and converted once, off the loop
        except AdapterError as exc:
            raise OpenAIError(400, f"The LoRA adapter '{spec.name}' cannot be served: {exc}",
                              "invalid_request_error", "model", "invalid_lora_adapter") from exc
        engine = self.adapters.engine(base.engine, adapter) if base.engine is not None else None
        return dataclasses.replace(base, served_model_name=spec.name, engine=engine,
                                   parent=base.served_model_name, root=str(spec.path))

    async def load_adapter(self, name: str, path: str, base: str | None) -> dict[str, Any]:
        """POST /v1/load_lora_adapter: convert and check the adapter against its base (a 400 that changes
        nothing when it cannot serve), then record it for every worker."""
        if self.adapters.spec(name) is not None:
            raise OpenAIError(400, f"The LoRA adapter '{name}' is already loaded; unload it first.",
                              "invalid_request_error", "lora_name", "lora_adapter_exists")
        if self._is_model_name(name):
            raise OpenAIError(400, f"'{name}' is a model's name.", "invalid_request_error", "lora_name",
                              "lora_adapter_exists")
        spec = AdapterSpec(name, Path(path), base)
        self.adapters.forget(spec)  # a directory loaded before may have changed: convert it again
        context = await self.adapter_context(spec)  # 404 (base) or 400 (adapter) before anything changes
        try:
            await asyncio.to_thread(self.adapters.add, spec)
        except AdapterError as exc:
            raise OpenAIError(400, str(exc), "invalid_request_error", "lora_name", "invalid_lora_adapter") from exc
        log.info("LoRA adapter %s loaded from %s (base %s)", name, path, context.parent)
        return {"status": "ok", "lora_name": name, "parent": context.parent}

    async def unload_adapter(self, name: str) -> dict[str, Any]:
        """POST /v1/unload_lora_adapter: new requests get 404; those in flight hold its engine and finish."""
        try:
            removed = await asyncio.to_thread(self.adapters.remove, name)
        except AdapterError as exc:
            raise OpenAIError(400, str(exc), "invalid_request_error", "lora_name", "invalid_lora_adapter") from exc
        if not removed:
            raise OpenAIError(404, f"The LoRA adapter '{name}' is not loaded.", "invalid_request_error",
                              "lora_name", "lora_adapter_not_found")
        log.info("LoRA adapter %s unloaded", name)
        return {"status": "ok", "lora_name": name}

    async def adapter_contexts(self) -> list[ModelContext]:
        """Every adapter that can be served (one that cannot is logged and left out of listings)."""
        contexts = []
        for spec in self.adapters.specs().values():
            try:
                base = await self.get(spec.base)
                if not self._shadowed(spec):
                    contexts.append(await self.adapter_context(spec, base))
            except OpenAIError as exc:
                log.warning("LoRA adapter %s is not listed: %s", spec.name, exc.message)
        return contexts

    @contextlib.asynccontextmanager
    async def held(self, name: str) -> AsyncIterator[None]:
        """While this is entered, new requests for `name` wait in get() (each up to the settings' rollout_hold_s, then a
        503) and go on to whatever context it ends with: a rollout that must unload a version before it can
        load the next (one GPU holds one TensorRT-LLM engine) makes clients wait instead of fail. Requests
        that got their context before it started keep it (and their lease)."""
        gate = asyncio.Event()
        self._holds[name] = gate
        try:
            yield
        finally:
            del self._holds[name]
            gate.set()

    async def _wait_for_swap(self, name: str) -> None:
        gate = self._holds[name]
        try:
            await asyncio.wait_for(gate.wait(), self._settings.rollout_hold_s)
        except asyncio.TimeoutError:
            raise service_unavailable(f"the model {name!r} is switching versions and has not finished within "
                                      f"{self._settings.rollout_hold_s:.0f} s; retry the request") from None

    def current(self, name: str) -> ModelContext | None:
        """The context a named model's requests go to now (None: none loaded yet)."""
        return self._contexts.get(name)

    async def all(self) -> list[ModelContext]:
        """Every served model's context; for named models, those that load (one that cannot is logged and
        left out). 503 only when Triton does not answer."""
        if not self.named:
            return [await self.get()]
        await self.refresh()
        contexts = []
        for name in self.served_ids():
            try:
                contexts.append(await self.get(name))
            except OpenAIError as exc:
                log.warning("model %s is not listed: %s", name, exc.message)
        return contexts

    async def refresh(self) -> dict[str, dict[str, str]]:
        """Re-read from Triton's repository index which named models it has loaded (or is loading): those are
        served. A model whose routed version Triton no longer has ready goes back to the version rollout.json
        names (its context is dropped; the next request loads that version's); if Triton lacks that version
        too (it restarted while a rollout changed the files), Triton is asked to load it. Models being
        rolled out are left to the rollout. Returns the index (name -> {version: state})."""
        index = await self._triton.model_index()
        self._refreshed_at = time.monotonic()
        served, unloaded = [], {}
        for model, live in await asyncio.to_thread(self._live_versions):
            states = index.get(model.name, {})
            if not {READY, LOADING} & set(states.values()):
                if states:  # a version failed to load, or was unloaded (a dead engine): 503s, not 404s
                    unloaded[model.name] = ", ".join(f"version {v}: {s or 'unknown'}" for v, s in states.items())
                if model.name not in self.rolling:
                    await self._drop(model.name, self._contexts.get(model.name))
                continue
            served.append(model.name)
            if model.name not in self.rolling:
                await self._reconcile(model.name, live, states)
        self._served, self._unloaded = served, unloaded
        return index

    def _live_versions(self) -> list[tuple[model_store.ManagedModel, str | None]]:
        """Each named model on disk and its live version (rollout.json; None when unreadable, logged)."""
        found = []
        for model in self.store():
            try:
                found.append((model, str(model.live_version)))
            except model_store.ModelStoreError as exc:
                log.error("model %s: %s", model.name, exc)
                found.append((model, None))
        return found

    async def _reconcile(self, name: str, live: str | None, states: dict[str, str]) -> None:
        context = self._contexts.get(name)
        if context is not None and context.engine is not None:
            context.engine.suspect = False
        if context is not None and states.get(context.version) != READY:
            await self._drop(name, context)
        if live is None or states.get(live) == READY or LOADING in states.values():
            return
        now = time.monotonic()
        if now - self._reported_at.get(name, -REPORT_EVERY_S) >= REPORT_EVERY_S:
            self._reported_at[name] = now
            log.warning("model %s: Triton does not have its live version %s ready (%s); its requests get 503s until "
                        "the launcher has it loaded again", name, live,
                        ", ".join(f"version {v}: {s}" for v, s in sorted(states.items())) or "not loaded")

    async def _drop(self, name: str, context: ModelContext | None) -> None:
        """Forget `context` unless a switch replaced it meanwhile: the next request loads the live version's."""
        if context is None:
            return
        async with self._lock_for(name):
            if self._contexts.get(name) is context:
                del self._contexts[name]
                log.warning("model %s: Triton no longer has version %s ready; re-reading its live version", name,
                            context.version)

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

    async def switch(self, context: ModelContext) -> ModelContext | None:
        """Route the model's new requests to `context`; returns the context they went to before. Under the
        registry's lock: a lazy load in progress finishes first, and its context is the one returned."""
        async with self._lock_for(context.served_model_name):
            previous = self._contexts.get(context.served_model_name)
            self._contexts[context.served_model_name] = context
            if context.served_model_name not in self.served_ids():
                self._served = [*self.served_ids(), context.served_model_name]
        return previous

    async def _load(self, key: str | None) -> ModelContext:
        if key is None:
            return await self._load_single()
        try:
            live = await asyncio.to_thread(lambda: self.find(key).live_version)
            if not await self._triton.is_ready(key, str(live)):
                raise service_unavailable(f"Triton does not have version {live} of model {key!r} (the live "
                                          "version) ready yet; retry the request")
            return await self.load_version(key, live)
        except (model_store.ModelStoreError, OSError, KeyError, ValueError) as exc:
            raise service_unavailable(f"the model {key!r} cannot be loaded: {exc}") from exc

    async def load_version(self, name: str, version: int) -> ModelContext:
        """A named model's context at `version`: that version's tokenizer, template and context length."""
        s = self._settings
        model, record = await asyncio.to_thread(lambda: (m := self.find(name), m.record(version)))
        engine = VersionEngine(self._triton, name, str(version))
        asked = await engine.metadata()  # what the engine can do (top log-probs) is only known there
        tokenizer = await asyncio.to_thread(Tokenizer, model.checkpoint_dir(version), s.chat_template)
        return ModelContext(name, int(record["max_seq_len"]), tokenizer, asked.max_top_logprobs,
                            s.tool_call_parser or parser_for_template(tokenizer.chat_template), s.reasoning_parser,
                            engine, str(version), asked.log_probs)

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
                            s.reasoning_parser, engine, log_probs=asked.log_probs)

    async def is_ready(self) -> bool:
        """Every model Triton has loaded (or is loading) served: the version its requests go to ready in
        Triton, its context loaded (the single engine model's, by default)."""
        if not self.named:
            return await self._triton.is_ready()
        try:
            index = await self.refresh()
        except OpenAIError:
            return False
        names = self.served_ids()
        if not names:
            return False
        for name in names:
            try:
                context = await self.get(name)
            except OpenAIError:
                return False
            if index.get(name, {}).get(context.version) != READY:
                return False
        return True


def base_shapes(context: ModelContext) -> BaseShapes | None:
    """What a LoRA adapter of this model must fit, from its checkpoint's config.json (None: not readable here,
    and the engine checks alone)."""
    directory = getattr(context.tokenizer, "directory", None)
    if directory is None or not (Path(directory) / "config.json").is_file():
        return None
    try:
        return BaseShapes.from_checkpoint(Path(directory))
    except (KeyError, ValueError, OSError):
        return None
