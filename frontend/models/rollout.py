"""Rollout and rollback of a named model's versions, without dropping a request.

A rollout to version N of a model whose live version is L (build_engine/model_store.py for the layout):
  1. the version policy becomes [L, N] and the `live` link points at N; Triton loads N beside L (a failure
     here restores the policy and the link, and L serves on as if nothing happened);
  2. the frontend loads N's tokenizer and template, then sends the model's new requests to N;
  3. requests that picked L finish on it, for at most `rollout_grace_s`;
  4. the state file records N as live and L as the rollback target, and the policy becomes [N]: Triton
     unloads L. Requests still on L past the grace period are stopped by id and end with an error (503):
     Triton would wait for each to end on its own before it unloads L (VersionEngine.drain_or_retire).
That needs room for two engines at once. A TensorRT-LLM engine sizes its KV cache from the GPU memory free when
it loads (kv_cache_free_gpu_mem_fraction), so beside a live engine the next one either fails to load or keeps a
tiny cache for good (tensorrtllm_backend docs/llama_multi_instance.md). A model whose config says
`rollout_strategy: swap` (values/trtllm.json) is therefore rolled out by swapping instead:
  1. the model's new requests are held in the frontend (ModelRegistry.held: they wait, they do not fail);
  2. requests on L finish, for at most `rollout_grace_s`; the rest are stopped by id and end with an error;
  3. Triton unloads L, then loads N alone (policy [N], `live` -> N), and the frontend loads N's context;
  4. the held requests go to N; the state file records N as live and L as the rollback target.
If N fails to load, L is loaded again and the held requests go to it. The pause is the drain plus the unload
and the load (an engine load on a GPU: seconds to minutes). A tensor-parallel engine (world_size > 1) is
refused: its other ranks are separate tritonservers that never see the load (roll such a model out at pod
level: a new Deployment revision).
A rollback is a rollout to the recorded previous version. One rollout per model at a time. Each edit of the
policy, link and state holds the model's lock (model_store.ManagedModel.locked), which a build's prune takes
too: a version named in the policy is never pruned, so N cannot vanish while it loads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Protocol, TypeVar

from tritonclient.utils import InferenceServerException

from build_engine import model_store
from frontend.api_types.errors import OpenAIError, invalid_request
from frontend.models.registry import READY, ModelContext, ModelRegistry
from frontend.generation.triton_engine import TritonEngine
from frontend.generation.triton_errors import client_message

log = logging.getLogger("frontend.models.rollout")


def _conflict(message: str, code: str) -> OpenAIError:
    return OpenAIError(409, message, "invalid_request_error", None, code)


SWAP = "swap"  # the `rollout_strategy` parameter that makes a rollout unload the old version first
UNLOAD_POLL_S = 0.1
UNLOAD_REPORT_S = 60.0  # how often a rollout says which versions Triton is still unloading
INDEX_SILENCE_S = 120.0  # how long a rollout asks again a Triton that does not answer in time
T = TypeVar("T")


def _load_failed(name: str, target: int, reason: str, serving: int | None) -> OpenAIError:
    still = f"; version {serving} still serves" if serving is not None else ""
    return OpenAIError(422, f"version {target} of model '{name}' failed to load{still}. Reason: {reason}",
                       "invalid_request_error", "version", "version_load_failed")


def _reason(exc: BaseException) -> str:
    return client_message(exc.message() if isinstance(exc, InferenceServerException) else str(exc))


class Fleet(Protocol):
    """The other frontend workers, as a rollout run by this one reaches them (frontend/workers/shared.py): each
    call returns once every other worker has done the step. `SOLO` when this process is the only one."""

    async def begin(self, name: str) -> bool: ...  # False: a rollout of `name` runs already, somewhere

    def end(self, name: str) -> None: ...

    async def switch(self, name: str, version: str, retire: str | None, grace_s: float) -> bool: ...

    async def hold(self, name: str, grace_s: float) -> bool: ...

    async def unhold(self, name: str) -> None: ...


class _Solo:
    async def begin(self, name: str) -> bool:
        return True

    def end(self, name: str) -> None:
        pass

    async def switch(self, name: str, version: str, retire: str | None, grace_s: float) -> bool:
        return True

    async def hold(self, name: str, grace_s: float) -> bool:
        return True

    async def unhold(self, name: str) -> None:
        pass


SOLO: Fleet = _Solo()


class FleetMember:
    """This worker's part in a rollout that another worker runs: the fleet commands, on the local registry."""

    def __init__(self, registry: ModelRegistry):
        self._registry = registry
        self._holds: dict[str, tuple[asyncio.Event, asyncio.Task[None]]] = {}

    async def run(self, command: dict[str, Any]) -> dict[str, Any]:
        op, name = command["op"], command["name"]
        if op == "switch":
            return {"drained": await self.switch(name, int(command["version"]), command["retire"], command["grace_s"])}
        if op == "hold":
            return {"drained": await self.hold(name, command["grace_s"])}
        if op == "unhold":
            await self.unhold(name)
            return {}
        raise ValueError(f"unknown fleet command {op!r}")

    async def switch(self, name: str, version: int, retire: str | None, grace_s: float) -> bool:
        """Route `name`'s new requests to `version`; with `retire`, wait (up to `grace_s`) until no request here
        holds that version any more."""
        old = await self._registry.switch(await self._registry.load_version(name, version))
        if retire is None or old is None or old.engine is None or old.version != retire:
            return True
        return await old.engine.drain_or_retire(grace_s)

    async def hold(self, name: str, grace_s: float) -> bool:
        """Hold `name`'s new requests (until `unhold`) and wait, up to `grace_s`, for those on its version.
        Until `unhold`, this worker's registry also leaves the model to the rollout: seeing no version of it
        ready mid-swap, it must not repair it (load rollout.json's version back) under the rollout's feet."""
        self._registry.rolling.add(name)
        release, entered = asyncio.Event(), asyncio.Event()

        async def holding() -> None:
            async with self._registry.held(name):
                entered.set()
                await release.wait()

        self._holds[name] = (release, asyncio.get_running_loop().create_task(holding()))
        await entered.wait()
        current = self._registry.current(name)
        return await current.engine.drain_or_retire(grace_s) if current is not None and current.engine is not None \
            else True

    async def unhold(self, name: str) -> None:
        held = self._holds.pop(name, None)
        if held is not None:
            held[0].set()
            await held[1]
        self._registry.rolling.discard(name)


class Rollouts:
    def __init__(self, registry: ModelRegistry, triton: TritonEngine, grace_s: float, fleet: Fleet = SOLO):
        self._registry = registry
        self._triton = triton
        self._grace_s = grace_s
        self._fleet = fleet
        self._busy = registry.rolling  # shared: the registry does not repair a model while it is rolled out

    def _model(self, name: str) -> model_store.ManagedModel:
        if not self._registry.named:
            raise invalid_request("this server serves one engine model, not a repository of named models "
                                  "(MODEL_REPOSITORY); it has no versions to roll out")
        return self._registry.find(name)

    async def rollback(self, name: str) -> dict[str, Any]:
        previous = self._model(name).previous_version
        if previous is None:
            raise _conflict(f"model '{name}' has no previous version to roll back to", "no_previous_version")
        return await self.rollout(name, previous)

    async def rollout(self, name: str, version: int | None = None) -> dict[str, Any]:
        model = self._model(name)
        if name in self._busy or not await self._fleet.begin(name):
            raise _conflict(f"a rollout of model '{name}' is in progress; try again when it is done",
                            "rollout_in_progress")
        self._busy.add(name)
        try:
            return await self._rollout(model, version)
        finally:
            self._busy.discard(name)
            self._fleet.end(name)

    async def _rollout(self, model: model_store.ManagedModel, version: int | None) -> dict[str, Any]:
        started = time.monotonic()
        name, live, on_disk = model.name, model.live_version, model.versions()
        target = max(on_disk) if version is None else version
        if target not in on_disk:
            raise OpenAIError(404, f"model '{name}' has no version {target} on disk (versions: "
                                   f"{', '.join(map(str, on_disk))})", "invalid_request_error", "version",
                              "version_not_found")
        if target == live:
            # Built while serving (its first version joins now), or Triton lost it (a restart that could not
            # load it): load it. Loaded but not routed yet: route it. Else nothing to do.
            loaded = (await self._triton.model_index()).get(name, {}).get(str(live)) == READY
            current = self._registry.current(name)
            routed = current.version == str(live) if current is not None else name in self._registry.served_ids()
            if loaded and routed:  # (a served model without a context yet loads it at its first request)
                return self._result(model, live, None, drained=True, started=started, changed=False)
            context = await (self._registry.load_version(name, live) if loaded else self._load_first(model, live))
            await self._registry.switch(context)
            await self._fleet.switch(name, str(live), None, self._grace_s)
            return self._result(model, live, None, drained=True, started=started, changed=True)
        if await self._triton.parameter(name, "rollout_strategy") == SWAP:
            return await self._swap(model, live, target, started)
        context = await self._load_beside(model, live, target)
        old = await self._registry.switch(context)
        log.info("model %s: new requests go to version %d; waiting up to %.0f s for version %d to drain",
                 name, target, self._grace_s, live)
        # Every worker routes its new requests to `target`, then waits for its own requests on `live`.
        here, elsewhere = await asyncio.gather(self._drained(old), self._fleet.switch(name, str(target), str(live),
                                                                                      self._grace_s))
        drained = here and elsewhere
        if not drained:
            log.warning("model %s: request(s) still on version %d after %.0f s; unloading it anyway", name, live,
                        self._grace_s)
        with model.locked():  # beside no build's prune: `live` becomes the rollback target, kept
            model.commit(live=target, previous=live)
            model.set_loaded([target])
            model.point_live_link(target)  # again: the launcher's settle() may have undone it (a Triton restart)
        try:
            await self._triton.load_model(name)  # unloads the old version
        except InferenceServerException as exc:  # version `target` serves; the old one may linger loaded
            log.error("model %s: unloading version %d failed: %s", name, live, client_message(exc.message()))
        return self._result(model, target, live, drained=drained, started=started, changed=True)

    async def _swap(self, model: model_store.ManagedModel, live: int, target: int, started: float) -> dict[str, Any]:
        """Unload `live`, then load `target`, with the model's new requests held meanwhile (module docstring)."""
        name = model.name
        for version in (live, target):
            if int(model.record(version).get("world_size") or 1) > 1:
                raise _conflict(f"version {version} of model '{name}' is a tensor-parallel engine (world_size "
                                f"{model.record(version)['world_size']}): its ranks are separate processes that an "
                                "in-place rollout cannot reach; roll it out at pod level", "rollout_not_supported")
        async with self._registry.held(name):
            try:
                return await self._swap_held(model, live, target, started)
            finally:
                await self._fleet.unhold(name)

    async def _drained(self, old: ModelContext | None) -> bool:
        """Whether every request of this worker on `old` has finished within the grace period; those still
        on it then are stopped, and end with an error (VersionEngine.drain_or_retire)."""
        return old is None or old.engine is None or await old.engine.drain_or_retire(self._grace_s)

    async def _swap_held(self, model: model_store.ManagedModel, live: int, target: int,
                         started: float) -> dict[str, Any]:
        """The swap, with the model's new requests held by every worker."""
        name = model.name
        log.info("model %s: holding new requests; waiting up to %.0f s for version %d to drain", name,
                 self._grace_s, live)
        here, elsewhere = await asyncio.gather(self._drained(self._registry.current(name)),
                                               self._fleet.hold(name, self._grace_s))
        drained = here and elsewhere
        if not drained:
            log.warning("model %s: request(s) still on version %d after %.0f s; unloading it anyway", name, live,
                        self._grace_s)
        with model.locked():
            if target not in model.versions():
                raise OpenAIError(404, f"model '{name}' has no version {target} on disk any more",
                                  "invalid_request_error", "version", "version_not_found")
            model.set_loaded([target])
            model.point_live_link(target)
        try:
            await self._unload(name)
            await self._triton.load_model(name)
            context = await self._loaded(name, target)
        except (InferenceServerException, OpenAIError, model_store.ModelStoreError, OSError, RuntimeError,
                KeyError, ValueError) as exc:
            reason = _reason(exc)
            log.error("model %s: version %d failed to load (%s); loading version %d again", name, target,
                      reason, live)
            raise _load_failed(name, target, reason, await self._restore(model, live)) from exc
        await self._registry.switch(context)
        await self._fleet.switch(name, str(target), None, self._grace_s)  # still held everywhere: nothing to drain
        with model.locked():
            model.commit(live=target, previous=live)
        return self._result(model, target, live, drained=drained, started=started, changed=True)

    async def _unload(self, name: str) -> None:
        """Unload every version of `name` and wait until Triton holds none of them any more (its GPU memory
        is free only then)."""
        await self._triton.unload_model(name)
        started = reported = time.monotonic()
        while held := {version: state for version, state in
                       (await self._patiently(self._triton.model_index)).get(name, {}).items()
                       if state in ("READY", "UNLOADING")}:
            if time.monotonic() - reported >= UNLOAD_REPORT_S:
                reported = time.monotonic()
                log.warning("model %s: Triton still holds %s %.0f s after the unload began (a model unloads once "
                            "Triton has released every request to it)", name,
                            ", ".join(f"version {v} {state}" for v, state in sorted(held.items())),
                            reported - started)
            await asyncio.sleep(UNLOAD_POLL_S)

    async def _loaded(self, name: str, version: int) -> ModelContext:
        """`version` of `name`, which Triton has just loaded: checked READY in its index, then its context."""
        if (await self._patiently(self._triton.model_index)).get(name, {}).get(str(version)) != READY:
            raise RuntimeError(f"Triton does not report version {version} ready after loading it")
        return await self._patiently(lambda: self._registry.load_version(name, version))

    @staticmethod
    async def _patiently(ask: Callable[[], Awaitable[T]]) -> T:
        """`ask()`, asked again while Triton does not answer in time (a 503), for up to INDEX_SILENCE_S. A
        busy Triton (loading an engine on a loaded machine) may miss the client's deadline: that is not a
        failed load, and a rollout that took it for one would unload what had just loaded, restore the old
        version the same way and leave the model with no version at all."""
        started = time.monotonic()
        while True:
            try:
                return await ask()
            except OpenAIError as exc:
                if exc.status != 503 or time.monotonic() - started > INDEX_SILENCE_S:
                    raise
                log.warning("Triton did not answer in time (%s); asking again", exc.message)
                await asyncio.sleep(UNLOAD_POLL_S)

    async def _restore(self, model: model_store.ManagedModel, live: int) -> int | None:
        """After a failed swap: `live` loaded and routed again; the version serving (None if even it fails)."""
        with model.locked():
            model.set_loaded([live])
            model.point_live_link(live)
        try:
            await self._unload(model.name)  # whatever of the failed version did load
            await self._triton.load_model(model.name)
            await self._registry.switch(await self._loaded(model.name, live))
            await self._fleet.switch(model.name, str(live), None, self._grace_s)
            return live
        except (InferenceServerException, OpenAIError, model_store.ModelStoreError, OSError, RuntimeError,
                KeyError, ValueError) as exc:  # the registry's repair loads it later; readiness says 503 meanwhile
            log.error("model %s: version %d did not load again either: %s", model.name, live, _reason(exc))
            return None

    async def _load_first(self, model: model_store.ManagedModel, version: int) -> ModelContext:
        try:
            await asyncio.to_thread(model.settle)  # the policy and link as rollout.json says: `version` alone
            await self._triton.load_model(model.name)
            return await self._registry.load_version(model.name, version)
        except (InferenceServerException, OpenAIError, model_store.ModelStoreError, OSError, KeyError,
                ValueError) as exc:
            raise _load_failed(model.name, version, _reason(exc), None) from exc

    async def _load_beside(self, model: model_store.ManagedModel, live: int, target: int) -> ModelContext:
        """Load `target` next to `live` and its context; on any failure, put everything back as it was."""
        name = model.name
        # Under the model's lock (a build may be pruning): once the policy names `target`, no prune deletes it.
        with model.locked():
            if target not in model.versions():
                raise OpenAIError(404, f"model '{name}' has no version {target} on disk any more",
                                  "invalid_request_error", "version", "version_not_found")
            model.set_loaded([live, target])
            model.point_live_link(target)
        try:
            await self._triton.load_model(name)
            return await self._loaded(name, target)
        except (InferenceServerException, OpenAIError, model_store.ModelStoreError, OSError, RuntimeError,
                KeyError, ValueError) as exc:
            reason = _reason(exc)
            with model.locked():
                model.set_loaded([live])
                model.point_live_link(live)
            try:
                await self._triton.load_model(name)  # unloads `target` if it did load
            except InferenceServerException:
                pass
            log.error("model %s: version %d failed to load; version %d still serves: %s", name, target, live,
                      reason)
            raise _load_failed(name, target, reason, live) from exc

    @staticmethod
    def _result(model: model_store.ManagedModel, live: int, previous: int | None, *, drained: bool,
                started: float, changed: bool) -> dict[str, Any]:
        return {"model": model.name, "live_version": live, "previous_version": previous, "changed": changed,
                "drained": drained, "seconds": round(time.monotonic() - started, 3)}

