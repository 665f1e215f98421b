"""LoRA adapters are models: listed in /v1/models with their base as `parent`, selected by `model`.

An adapter is configured at start (LORA_MODULES, vLLM's `name=path,...` or JSON list with `base_model_name`) or
loaded and unloaded while serving (POST /v1/load_lora_adapter, /v1/unload_lora_adapter, when enabled). Each is
converted once to the engines' tensors (frontend/models/lora.py) and given a task id derived from its name and
its converted weights: the same on every frontend worker and after a restart, and a new one when an adapter is
reloaded with other weights, so no engine cache ever serves stale weights under an old id.

Adapters loaded while serving are kept in a state file (LORA_STATE_FILE) that every worker re-reads when it
changes (a stat per lookup), so a load or unload on one worker is seen by all. A request holds its adapter's
engine (AdapterEngine) from the start: unloading only stops new requests (404); those in flight finish.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from dataclasses import dataclass, field, replace
from hashlib import blake2b
from pathlib import Path
from typing import Any, AsyncIterator

from frontend.generation.engine import EngineRequest, LoraWeights, TokenChunk
from frontend.models.lora import AdapterError, BaseShapes, LoraTensors, convert_peft


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter as configured: its name, directory and base model (None: the default model)."""

    name: str
    path: Path
    base: str | None = None


def parse_lora_modules(value: str) -> list[AdapterSpec]:
    """LORA_MODULES as vLLM's --lora-modules takes it: `name=path,name=path`, or JSON (one object or a list of
    {"name", "path", "base_model_name"})."""
    value = value.strip()
    if not value:
        return []
    if value[0] in "[{":
        try:
            items = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"LORA_MODULES is not valid JSON: {exc}") from exc
        items = items if isinstance(items, list) else [items]
        specs = []
        for item in items:
            if not isinstance(item, dict) or not item.get("name") or not item.get("path"):
                raise ValueError("each LORA_MODULES entry needs a name and a path")
            specs.append(AdapterSpec(str(item["name"]), Path(item["path"]), item.get("base_model_name") or None))
    else:
        specs = []
        for part in filter(None, (p.strip() for p in value.split(","))):
            name, sep, path = part.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"LORA_MODULES entry {part!r} is not name=path")
            specs.append(AdapterSpec(name.strip(), Path(path.strip())))
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError("LORA_MODULES names an adapter twice")
    return specs


def task_id_of(name: str, tensors: LoraTensors) -> int:
    """A stable lora_task_id (63 bits: TensorRT-LLM takes uint64, some tools int64): the adapter's name and weights."""
    digest = blake2b(f"{name}\0{tensors.checksum}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1 or 1


@dataclass(frozen=True)
class Adapter:
    spec: AdapterSpec
    tensors: LoraTensors
    task_id: int
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def name(self) -> str:
        return self.spec.name

    def weights(self) -> LoraWeights:
        return LoraWeights(self.name, self.task_id, self.tensors.weights, self.tensors.config)


class AdapterEngine:
    """A base model version's engine through one adapter: every request carries the adapter, leases go to the
    base (a rollout of the base waits for adapter requests too). `running` counts its requests generating,
    `leases` those in flight (vllm:lora_requests_info)."""

    def __init__(self, base: Any, adapter: Adapter):
        self.base, self.adapter = base, adapter
        self._lora = adapter.weights()
        self.leases = 0
        self.running = 0

    def lease(self) -> None:
        self.leases += 1
        self.base.lease()

    def release(self) -> None:
        self.leases -= 1
        self.base.release()

    @property
    def suspect(self) -> bool:
        return self.base.suspect

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenChunk]:
        self.running += 1
        try:
            async with contextlib.aclosing(self.base.generate(replace(request, lora=self._lora))) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self.running -= 1

    async def is_ready(self) -> bool:
        return await self.base.is_ready()

    async def metadata(self):
        return await self.base.metadata()

    async def close(self) -> None:
        """The base engine's owner closes it."""


class AdapterSet:
    """The adapters served: those configured at start and those loaded while serving (the state file's)."""

    def __init__(self, specs: list[AdapterSpec], max_rank: int, state_file: Path | None = None):
        self.max_rank = max_rank
        self.state_file = state_file
        self._static = {spec.name: spec for spec in specs}
        self._dynamic: dict[str, AdapterSpec] = {}
        self._state_stamp: tuple[int, int] | None = None
        self._converted: dict[tuple[str, Path, str | None], Adapter] = {}  # converted once (name, path, base)
        self._engines: dict[tuple[int, int], AdapterEngine] = {}  # (id(base engine), task id) -> its engine

    def specs(self) -> dict[str, AdapterSpec]:
        self._read_state()
        return {**self._dynamic, **self._static}

    def spec(self, name: str) -> AdapterSpec | None:
        return self.specs().get(name)

    def adapter(self, spec: AdapterSpec, shapes: BaseShapes | None) -> Adapter:
        """The adapter converted (once per name, path and base); AdapterError if it cannot be served."""
        key = (spec.name, spec.path, spec.base)
        if key not in self._converted:
            tensors = convert_peft(spec.path, self.max_rank, shapes)
            self._converted[key] = Adapter(spec, tensors, task_id_of(spec.name, tensors))
        return self._converted[key]

    def converted(self, spec: AdapterSpec) -> Adapter | None:
        """The adapter if it was converted already (no file read)."""
        return self._converted.get((spec.name, spec.path, spec.base))

    def forget(self, spec: AdapterSpec) -> None:
        """Drop a conversion, so that the next use reads the directory again."""
        self._converted.pop((spec.name, spec.path, spec.base), None)

    def engine(self, base: Any, adapter: Adapter) -> AdapterEngine:
        """One AdapterEngine per base engine and adapter: its counts are the adapter's on that base."""
        key = (id(base), adapter.task_id)
        engine = self._engines.get(key)
        if engine is None or engine.base is not base:
            engine = self._engines[key] = AdapterEngine(base, adapter)
        return engine

    def engines(self) -> list[AdapterEngine]:
        return list(self._engines.values())

    def requests_info(self) -> tuple[list[str], list[str]]:
        """vllm:lora_requests_info's adapters: (with requests generating, with requests not generating yet)."""
        return lora_requests_info(self.engines())


    # ----- loaded while serving ------------------------------------------------------------------------
    def add(self, spec: AdapterSpec) -> None:
        """Record a loaded adapter for every worker (the caller converted and checked it first)."""
        if spec.name in self._static:
            raise AdapterError(f"the adapter {spec.name!r} is configured at start (LORA_MODULES); it cannot be "
                               "replaced while serving")
        self._update(lambda state: state.__setitem__(spec.name, {"path": str(spec.path), "base": spec.base}))

    def remove(self, name: str) -> bool:
        """Forget a loaded adapter (False: there was none by that name)."""
        if name in self._static:
            raise AdapterError(f"the adapter {name!r} is configured at start (LORA_MODULES); it cannot be "
                               "unloaded while serving")
        return self._update(lambda state: state.pop(name, None) is not None)

    def _update(self, change) -> Any:
        if self.state_file is None:
            state = {name: {"path": str(s.path), "base": s.base} for name, s in self._dynamic.items()}
            result = change(state)
            self._dynamic = _specs(state)
            return result
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.state_file.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # workers load and unload one at a time
            state = _read(self.state_file)
            result = change(state)
            temporary = self.state_file.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_text(json.dumps(state))
            temporary.replace(self.state_file)
        self._state_stamp = None
        self._read_state()
        return result

    def _read_state(self) -> None:
        if self.state_file is None:
            return
        try:
            stat = self.state_file.stat()
            stamp = (stat.st_mtime_ns, stat.st_ino)
        except FileNotFoundError:
            stamp = (0, 0)
        if stamp != self._state_stamp:
            self._dynamic = _specs(_read(self.state_file))
            self._state_stamp = stamp


def _read(path: Path) -> dict[str, dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _specs(state: dict[str, dict[str, Any]]) -> dict[str, AdapterSpec]:
    return {name: AdapterSpec(name, Path(item["path"]), item.get("base")) for name, item in state.items()}


def lora_requests_info(engines: list[AdapterEngine]) -> tuple[list[str], list[str]]:
    """(adapters with a request generating, adapters with a request in flight that is not generating yet:
    waiting for admission), each name once, sorted."""
    running = sorted({e.adapter.name for e in engines if e.running > 0})
    waiting = sorted({e.adapter.name for e in engines if e.leases > e.running})
    return running, waiting
