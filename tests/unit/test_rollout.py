"""The rollout sequence (frontend/models/rollout.py) against a fake Triton: what it asks Triton to load, in which
order, what it leaves on disk, and how it waits for the old version's requests."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from tritonclient.utils import InferenceServerException

from build_engine import model_store
from frontend.api_types.errors import OpenAIError, service_unavailable
from frontend.models.registry import ModelContext, ModelRegistry, VersionEngine
from frontend.models.rollout import FleetMember, Rollouts
from frontend.settings import Settings

NAME = "assistant"


class FakeTriton:
    """Records, at each load_model, the version policy and live link on disk; fails the loads it is told to.
    Its repository index: the versions each model's policy named at its last load that succeeded (the
    policy on disk at the start for `model`, as Triton loads at its start)."""

    def __init__(self, model: model_store.ManagedModel):
        self.model = model
        self.others: list[str] = []  # loads of other models
        self.loads: list[tuple[list[int], int | None]] = []
        self.fail_versions: set[int] = set()
        self.gate: asyncio.Event | None = None  # when set: the first load waits for it
        self.ready: dict[str, set[int]] = {model.name: set(model.loaded_versions())}
        self.strategy = "beside"  # the model config's rollout_strategy
        self.most_loaded = len(self.ready[model.name])  # the most versions of the model loaded at once
        self.retired: list[tuple[str | None, str, int]] = []  # retire() calls: model, version, the error's status
        self.on_retire: list = []  # what a retire ends (each called): the stopped requests giving back their leases

    async def parameter(self, model: str, key: str) -> str:
        return self.strategy if key == "rollout_strategy" else ""

    def retire(self, model: str | None, version: str, failure: OpenAIError) -> int:
        self.retired.append((model, version, failure.status))
        for end in self.on_retire:
            end()
        return len(self.on_retire)

    async def unload_model(self, name: str) -> None:
        self.loads.append(([], None))
        self.ready[name] = set()

    async def model_index(self) -> dict[str, dict[str, str]]:
        return {name: {str(v): "READY" for v in versions} for name, versions in self.ready.items()}

    async def load_model(self, name: str) -> None:
        if name != self.model.name:
            self.others.append(name)
            self.ready[name] = set(model_store.ManagedModel(self.model.directory.parent / name).loaded_versions())
            return
        loaded = self.model.loaded_versions()
        self.loads.append((loaded, self.model.live_link_target()))
        if self.gate is not None:
            await self.gate.wait()
        failing = self.fail_versions & set(loaded)
        if failing:
            raise InferenceServerException(f"load failed for model '{name}': version {min(failing)} is at "
                                           "UNAVAILABLE state: corrupt weights")
        self.ready[name] = set(loaded)
        self.most_loaded = max(self.most_loaded, len(loaded))

    async def is_ready(self, model: str | None = None, version: str = "") -> bool:
        return True


class FakeRegistry(ModelRegistry):
    """Contexts without tokenizers: only their engines (and leases) matter here."""

    async def load_version(self, name: str, version: int) -> ModelContext:
        return ModelContext(name, 256, None, 0, engine=VersionEngine(self._triton, name, str(version)),  # type: ignore[arg-type]
                            version=str(version))


def make_model(root: Path, versions: list[int], live: int, previous: int | None = None,
               name: str = NAME) -> model_store.ManagedModel:
    model = model_store.ManagedModel(root / "models" / name)
    for version in versions:
        (model.engine_dir(version)).mkdir(parents=True)
        (model.engine_dir(version) / model_store.ENGINE_RECORD).write_text(json.dumps({"max_seq_len": 256}))
    model.config_path.write_text(f'name: "{name}"\n{model_store.version_policy_line([live])}\n')
    model.point_live_link(live)
    model.commit(live=live, previous=previous)
    return model


@pytest.fixture
def setup(tmp_path: Path):
    model = make_model(tmp_path, [1, 2, 3], live=1)
    triton = FakeTriton(model)
    registry = FakeRegistry(Settings(model_repository=tmp_path / "models"), triton)  # type: ignore[arg-type]
    return model, triton, registry


async def test_rollout_loads_beside_switches_then_unloads(setup) -> None:
    model, triton, registry = setup
    old = await registry.get(NAME)
    result = await Rollouts(registry, triton, grace_s=5).rollout(NAME, 2)  # type: ignore[arg-type]
    assert triton.loads == [([1, 2], 2), ([2], 2)]  # the link names the version being loaded
    assert (result["live_version"], result["previous_version"], result["drained"]) == (2, 1, True)
    assert model.state() == {"live": 2, "previous": 1} and model.loaded_versions() == [2]
    current = await registry.get(NAME)
    assert current.version == "2" and current is not old


async def test_the_old_version_is_unloaded_only_after_its_requests_finish(setup) -> None:
    model, triton, registry = setup
    old = await registry.get(NAME)
    old.engine.lease()  # a request that picked version 1 and is still streaming
    task = asyncio.create_task(Rollouts(registry, triton, grace_s=60).rollout(NAME, 2))  # type: ignore[arg-type]
    while (await registry.get(NAME)).version != "2":  # new requests already go to version 2 ...
        await asyncio.sleep(0)
    await asyncio.sleep(0.05)
    assert len(triton.loads) == 1 and model.loaded_versions() == [1, 2]  # ... while version 1 stays loaded
    old.engine.release()
    assert (await task)["drained"] is True
    assert triton.loads[-1] == ([2], 2)


async def test_past_the_grace_period_the_old_version_goes_anyway(setup) -> None:
    _, triton, registry = setup
    engine = (await registry.get(NAME)).engine
    engine.lease()  # released only when the rollout stops it (audit round 3, R5)
    triton.on_retire.append(engine.release)
    result = await Rollouts(registry, triton, grace_s=0.05).rollout(NAME, 2)  # type: ignore[arg-type]
    assert result["drained"] is False and triton.loads[-1] == ([2], 2)
    assert triton.retired == [(NAME, "1", 503)], "what outlived the grace was not stopped with a 503"


async def test_a_swap_stops_what_outlives_the_grace_before_it_unloads(setup) -> None:
    """Audit round 3, R5: Triton unloads a TensorRT-LLM version only once its requests have ended."""
    _, triton, registry = setup
    triton.strategy = "swap"
    engine = (await registry.get(NAME)).engine
    engine.lease()
    triton.on_retire.append(lambda: (engine.release(), triton.loads.append(("retired", None))))
    result = await Rollouts(registry, triton, grace_s=0.05).rollout(NAME, 2)  # type: ignore[arg-type]
    assert result["drained"] is False and triton.retired == [(NAME, "1", 503)]
    assert triton.loads.index(("retired", None)) < triton.loads.index(([], None)), "stopped after the unload"


async def test_a_version_that_fails_to_load_leaves_everything_as_it_was(setup) -> None:
    model, triton, registry = setup
    before = await registry.get(NAME)
    triton.fail_versions = {3}
    with pytest.raises(OpenAIError) as raised:
        await Rollouts(registry, triton, grace_s=5).rollout(NAME, 3)  # type: ignore[arg-type]
    error = raised.value
    assert (error.status, error.code) == (422, "version_load_failed")
    assert "version 3 of model 'assistant' failed to load; version 1 still serves" in error.message
    assert "corrupt weights" in error.message
    assert model.loaded_versions() == [1] and model.live_link_target() == 1
    assert model.state() == {"live": 1, "previous": None}
    assert await registry.get(NAME) is before


async def test_refusals(setup) -> None:
    model, triton, registry = setup
    rollouts = Rollouts(registry, triton, grace_s=5)  # type: ignore[arg-type]
    for call, status, code in ((rollouts.rollback(NAME), 409, "no_previous_version"),
                               (rollouts.rollout(NAME, 9), 404, "version_not_found"),
                               (rollouts.rollout("other"), 404, "model_not_found")):
        with pytest.raises(OpenAIError) as raised:
            await call
        assert (raised.value.status, raised.value.code) == (status, code)
    triton.gate = asyncio.Event()
    first = asyncio.create_task(rollouts.rollout(NAME, 2))
    while not triton.loads:
        await asyncio.sleep(0)
    with pytest.raises(OpenAIError) as raised:
        await rollouts.rollout(NAME, 3)
    assert (raised.value.status, raised.value.code) == (409, "rollout_in_progress")
    triton.gate.set()
    await first
    assert (await rollouts.rollout(NAME, 2))["changed"] is False  # already live: nothing to do
    assert (await rollouts.rollback(NAME))["live_version"] == 1



async def test_a_model_built_while_serving_joins_when_rolled_out(setup, tmp_path: Path) -> None:
    _, triton, registry = setup
    await registry.refresh()
    assert registry.served_ids() == [NAME]
    make_model(tmp_path, [1], live=1, name="coder")  # `make engine NAME=coder` while serving
    with pytest.raises(OpenAIError) as raised:
        await registry.get("coder")
    assert raised.value.status == 404  # not served until Triton has loaded it
    result = await Rollouts(registry, triton, grace_s=5).rollout("coder")  # type: ignore[arg-type]
    assert (result["live_version"], result["previous_version"], result["changed"]) == (1, None, True)
    assert triton.others == ["coder"] and registry.served_ids() == [NAME, "coder"]
    assert (await registry.get("coder")).version == "1"


def test_admin_routes_are_closed_without_admin_keys_and_keys_do_not_cross() -> None:
    from fastapi.testclient import TestClient

    from frontend.http.app import create_app

    closed = TestClient(create_app(Settings()))  # no lifespan: no Triton needed to be refused
    response = closed.post(f"/admin/models/{NAME}/rollout", json={})
    assert response.status_code == 403 and response.json()["error"]["code"] == "admin_disabled"
    keyed = TestClient(create_app(Settings(api_keys="api-key", admin_api_keys="admin-key")))
    as_api = keyed.post(f"/admin/models/{NAME}/rollback", headers={"Authorization": "Bearer api-key"})
    assert as_api.status_code == 401 and as_api.json()["error"]["message"] == "Incorrect admin key provided."
    as_admin = keyed.post("/v1/completions", headers={"Authorization": "Bearer admin-key"},
                          json={"model": NAME, "prompt": "hi"})
    assert as_admin.status_code == 401 and as_admin.json()["error"]["message"] == "Incorrect API key provided."


async def test_a_prune_during_the_load_spares_the_version_being_loaded(setup) -> None:
    """A build's prune (`make engine NAME=... KEEP_VERSIONS=1`) while version 2, older than the newest and not
    the rollback target, is loading: the policy names it, so it stays (build_engine/model_store.py)."""
    model, triton, registry = setup
    triton.gate = asyncio.Event()
    task = asyncio.create_task(Rollouts(registry, triton, grace_s=5).rollout(NAME, 2))  # type: ignore[arg-type]
    while not triton.loads:
        await asyncio.sleep(0)
    assert model.prune(1) == []  # 1 live, 2 in the policy, 3 the newest
    assert model.versions() == [1, 2, 3]
    triton.gate.set()
    assert (await task)["live_version"] == 2
    assert model.prune(1) == []  # 1 is now the rollback target


# ----- what Triton has loaded, and the registry's lock (issue 25) ------------------------------------------
class GatedRegistry(FakeRegistry):
    """Its context loads of version `gated` wait for `gate` (a lazy first load that takes a while)."""

    gate: asyncio.Event
    gated = 1
    started: asyncio.Event

    async def load_version(self, name: str, version: int) -> ModelContext:
        if version == self.gated:
            self.started.set()
            await self.gate.wait()
        return await super().load_version(name, version)


async def test_a_rollout_racing_the_first_load_ends_on_the_new_version(setup) -> None:
    """Finding 11: the first request's lazy load of version 1 is in progress when a rollout to 2 switches; the
    switch waits for it and retires the context it stored, which is never stored over version 2."""
    model, triton, _ = setup
    registry = GatedRegistry(Settings(model_repository=model.directory.parent), triton)  # type: ignore[arg-type]
    registry.gate, registry.started = asyncio.Event(), asyncio.Event()
    first = asyncio.create_task(registry.get(NAME))
    await registry.started.wait()  # version 1 loading, under the lock
    rollout = asyncio.create_task(Rollouts(registry, triton, grace_s=5).rollout(NAME, 2))  # type: ignore[arg-type]
    while len(triton.loads) < 1:
        await asyncio.sleep(0)
    await asyncio.sleep(0.05)
    assert not rollout.done()  # its switch waits for the lazy load
    registry.gate.set()
    old = await first
    assert old.version == "1"
    old.engine.lease()  # the first request streams on version 1: the rollout waits for it
    await asyncio.sleep(0.05)
    assert (await registry.get(NAME)).version == "2"
    old.engine.release()
    result = await rollout
    assert (result["live_version"], result["drained"]) == (2, True)
    assert (await registry.get(NAME)).version == "2" and triton.loads[-1] == ([2], 2)


async def test_the_switch_and_the_lazy_load_hold_one_lock(setup) -> None:
    model, triton, registry = setup
    await registry.refresh()
    async with registry._lock_for(NAME):
        switched = asyncio.create_task(registry.switch(await registry.load_version(NAME, 2)))
        await asyncio.sleep(0.05)
        assert not switched.done() and registry.current(NAME) is None
    assert await switched is None and registry.current(NAME).version == "2"  # type: ignore[union-attr]
    assert (await registry.get(NAME)).version == "2"  # the lazy load does not replace it with rollout.json's 1


async def test_an_unknown_model_is_answered_from_the_last_index_while_it_is_fresh(
        setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review finding 7: a client retrying a mistyped model id got a Triton repository index read (a scan of
    its model directory) per request; now at most one per REFRESH_AFTER_FAILURE_S."""
    from frontend.models import registry as registry_module

    model, triton, registry = setup
    reads = 0
    index = triton.model_index

    async def counted() -> dict[str, dict[str, str]]:
        nonlocal reads
        reads += 1
        return await index()

    triton.model_index = counted
    now = [1000.0]
    monkeypatch.setattr(registry_module.time, "monotonic", lambda: now[0])
    for _ in range(50):
        with pytest.raises(OpenAIError) as raised:
            await registry.get("no-such-model")
        assert raised.value.status == 404
    assert reads == 1
    now[0] += registry_module.REFRESH_AFTER_FAILURE_S
    with pytest.raises(OpenAIError):
        await registry.get("no-such-model")
    assert reads == 2


async def test_requests_waiting_on_a_failing_load_share_its_failure(setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review finding 7: requests queued behind a model's load each retried it after it failed; now one load,
    its 503 for all of them (for LOAD_FAILURE_KEPT_S), and a load of another model does not wait for it."""
    model, triton, registry = setup
    await registry.refresh()
    attempts = 0
    gate = asyncio.Event()
    load_version = registry.load_version

    async def failing(name: str, version: int) -> ModelContext:
        nonlocal attempts
        if name != NAME:
            return await load_version(name, version)
        attempts += 1
        await gate.wait()
        raise service_unavailable("Triton is busy")

    registry.load_version = failing  # type: ignore[method-assign]
    waiting = [asyncio.create_task(registry.get(NAME)) for _ in range(20)]
    while attempts == 0:
        await asyncio.sleep(0)
    make_model(model.directory.parent.parent, [1], live=1, name="coder")
    triton.ready["coder"] = {1}
    await registry.refresh()
    coder = await asyncio.wait_for(registry.get("coder"), 60)  # not behind the other model's load (it would hang)
    assert coder.version == "1"
    gate.set()
    results = await asyncio.gather(*waiting, return_exceptions=True)
    assert attempts == 1 and all(isinstance(r, OpenAIError) and r.status == 503 for r in results)


async def test_served_models_are_what_triton_has_loaded(setup, tmp_path: Path) -> None:
    """Finding 8: after a frontend restart, a model built while serving (on disk, never loaded by Triton) is
    neither served nor in the way of readiness and the listing; a rollout loads it."""
    _, triton, _ = setup
    make_model(tmp_path, [1], live=1, name="coder")
    registry = FakeRegistry(Settings(model_repository=tmp_path / "models"), triton)  # type: ignore[arg-type]
    assert [c.served_model_name for c in await registry.all()] == [NAME]
    assert await registry.is_ready()
    with pytest.raises(OpenAIError) as raised:
        await registry.get("coder")
    assert raised.value.status == 404
    result = await Rollouts(registry, triton, grace_s=5).rollout("coder")  # type: ignore[arg-type]
    assert (result["live_version"], result["changed"]) == (1, True) and triton.others == ["coder"]
    assert [c.served_model_name for c in await registry.all()] == [NAME, "coder"]
    assert await registry.is_ready()


async def test_a_model_that_failed_to_load_is_left_out_not_failing_all(setup, tmp_path: Path) -> None:
    _, triton, registry = setup
    make_model(tmp_path, [1], live=1, name="coder")
    triton.ready["coder"] = set()
    states = {"coder": {"1": "UNAVAILABLE"}}
    index = triton.model_index

    async def with_failure() -> dict[str, dict[str, str]]:
        return {**(await index()), **states}

    triton.model_index = with_failure  # type: ignore[method-assign]
    assert [c.served_model_name for c in await registry.all()] == [NAME]
    assert await registry.is_ready()
    with pytest.raises(OpenAIError) as raised:
        await registry.get("coder")
    assert raised.value.status == 503 and "not loaded in Triton" in raised.value.message


async def test_rolling_out_the_live_version_loads_it_when_triton_lacks_it(setup) -> None:
    """The `target == live` branch: a model Triton does not have ready is loaded, not reported as live."""
    model, triton, registry = setup
    assert (await registry.get(NAME)).version == "1"
    triton.ready[NAME] = set()  # e.g. Triton restarted and could not load it then
    result = await Rollouts(registry, triton, grace_s=5).rollout(NAME, 1)  # type: ignore[arg-type]
    assert result["changed"] is True and triton.loads == [([1], 1)]
    assert triton.ready[NAME] == {1} and (await registry.get(NAME)).version == "1"
    result = await Rollouts(registry, triton, grace_s=5).rollout(NAME, 1)  # type: ignore[arg-type]
    assert result["changed"] is False and len(triton.loads) == 1  # loaded and routed: nothing to do


async def test_a_triton_restart_mid_rollout_goes_to_the_version_rollout_json_names(setup) -> None:
    """Finding 13, the frontend's side: it routes version 2 (switched), but the restarted Triton has only 1
    (the launcher settled the files while rollout.json still said 1): the next refresh re-routes to 1."""
    model, triton, registry = setup
    await registry.switch(await registry.load_version(NAME, 2))
    triton.ready[NAME] = {1}
    assert await registry.is_ready()  # version 2 dropped, version 1's context loaded
    assert (await registry.get(NAME)).version == "1"


async def test_the_frontend_reports_a_live_version_triton_lacks_and_loads_nothing(setup) -> None:
    """Review finding 8: the rollout committed 2 (its last load failed: Triton was down) after the launcher's
    settle, and the restarted Triton loaded 1. A frontend worker does not repair that (every worker would, each
    its own load_model): it answers 503 and logs; the launcher repairs (the next test)."""
    model, triton, registry = setup
    model.commit(live=2, previous=1)
    model.set_loaded([1, 2])
    triton.ready[NAME] = {1}
    assert not await registry.is_ready()
    assert not await registry.is_ready()
    assert triton.loads == [] and NAME not in registry.rolling and model.loaded_versions() == [1, 2]


def test_the_launcher_settles_then_loads_a_named_model_whose_live_version_triton_lacks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same state, from the launcher's health check: the model is missing, and reload() settles its files
    (policy and link back to rollout.json's 2) before the one load_model."""
    from launcher import engine_health

    model = make_model(tmp_path, [1, 2], live=1)
    model.commit(live=2, previous=1)
    model.set_loaded([1, 2])
    loads: list[tuple[str, list[int], int | None]] = []

    class FakeClient:
        def __init__(self, url: str) -> None:
            pass

        def load_model(self, name: str, headers: object = None) -> None:
            loads.append((name, model.loaded_versions(), model.live_link_target()))

        def close(self) -> None:
            pass

    health = engine_health.EngineHealth("127.0.0.1:1", "key", lambda: [NAME], probe=lambda url, name: None,
                                        repository=tmp_path / "models")
    index = {NAME: [{"name": NAME, "version": "1", "state": "READY"}]}
    health._index = lambda: index  # type: ignore[method-assign]
    problem = health.check()
    assert problem is not None and problem.missing == (NAME,)
    monkeypatch.setattr(engine_health.grpcclient, "InferenceServerClient", FakeClient)
    health.reload(problem.missing)
    assert loads == [(NAME, [2], 2)]
    index[NAME] = [{"name": NAME, "version": "2", "state": "READY"}]
    assert health.check() is None


def test_the_launcher_settles_every_model_before_each_triton_restart(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 13, the launcher's side: a rollout interrupted by Triton's death (both versions in the policy,
    the link on the new one, rollout.json on the old) is undone before the supervisor starts Triton again."""
    from types import SimpleNamespace

    import launcher.processes as launcher_processes

    model = make_model(tmp_path, [1, 2], live=1)
    started: list[tuple[list[int], int | None]] = []

    class FakeServer:
        pid = None

        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def start(self) -> None:
            started.append((model.loaded_versions(), model.live_link_target()))

        def stop(self) -> None:
            pass

    monkeypatch.setattr(launcher_processes, "TritonServer", FakeServer)
    monkeypatch.setattr(launcher_processes, "rotate_log", lambda path: None)
    cfg = SimpleNamespace(model_repository=tmp_path / "models", http_port=1, grpc_port=2, metrics_port=3,
                          triton_log=tmp_path / "t.log", work_dir=tmp_path, engine_model=NAME,
                          triton_ready_timeout_s=60.0, engine_unhealthy_s=10.0)
    triton = launcher_processes.TritonProcess(cfg, "key")  # type: ignore[arg-type]
    triton.start()
    with model.locked():  # a rollout to 2 in progress when Triton dies
        model.set_loaded([1, 2])
        model.point_live_link(2)
    triton.start()  # the supervisor's restart
    assert started == [([1], 1), ([1], 1)]


# ----- swap (rollout_strategy "swap": TensorRT-LLM, one engine per GPU) -------------------------------------
async def test_a_swap_holds_new_requests_drains_unloads_then_loads_the_new_version_alone(setup) -> None:
    model, triton, registry = setup
    triton.strategy = "swap"
    old = await registry.get(NAME)
    old.engine.lease()  # a request still streaming on version 1
    triton.gate = asyncio.Event()  # the load of version 2 waits for the test
    rollout = asyncio.create_task(Rollouts(registry, triton, grace_s=60).rollout(NAME, 2))  # type: ignore[arg-type]
    while NAME not in registry._holds:
        await asyncio.sleep(0)
    held = asyncio.create_task(registry.get(NAME))  # a new request: waits, does not fail
    await asyncio.sleep(0.05)
    assert not held.done() and triton.loads == []  # nothing unloaded while version 1 has a request
    old.engine.release()
    while len(triton.loads) < 2:
        await asyncio.sleep(0)
    assert triton.loads == [([], None), ([2], 2)]  # unloaded first, then version 2 alone
    assert not held.done()
    triton.gate.set()
    result = await rollout
    assert (await held).version == "2" and triton.most_loaded == 1
    assert (result["live_version"], result["previous_version"], result["drained"]) == (2, 1, True)
    assert model.state() == {"live": 2, "previous": 1} and model.loaded_versions() == [2]


async def test_a_swap_that_fails_to_load_serves_the_old_version_again(setup) -> None:
    model, triton, registry = setup
    triton.strategy = "swap"
    await registry.get(NAME)
    triton.fail_versions = {3}
    with pytest.raises(OpenAIError) as raised:
        await Rollouts(registry, triton, grace_s=5).rollout(NAME, 3)  # type: ignore[arg-type]
    assert (raised.value.status, raised.value.code) == (422, "version_load_failed")
    assert "version 1 still serves" in raised.value.message and "corrupt weights" in raised.value.message
    assert triton.loads == [([], None), ([3], 3), ([], None), ([1], 1)]
    assert model.loaded_versions() == [1] and model.live_link_target() == 1
    assert model.state() == {"live": 1, "previous": None} and (await registry.get(NAME)).version == "1"


async def test_a_swap_waits_through_a_triton_that_does_not_answer_in_time(setup) -> None:
    """A busy Triton may miss the client's deadline while the old version unloads and right after the new one
    loaded: the swap asks again. Before, it took either for a failed load, and its restore failed the same way,
    leaving the model with no version loaded."""
    model, triton, registry = setup
    triton.strategy = "swap"
    await registry.get(NAME)
    index, calls, silent_at = triton.model_index, [0], []

    async def busy() -> dict[str, dict[str, str]]:
        calls[0] += 1
        if calls[0] % 2:  # every other call: no answer in time
            silent_at.append(len(triton.loads))
            raise service_unavailable("the inference server's repository index is not answering: Deadline Exceeded")
        return await index()

    triton.model_index = busy  # type: ignore[method-assign]
    result = await Rollouts(registry, triton, grace_s=5).rollout(NAME, 2)  # type: ignore[arg-type]
    assert silent_at == [1, 2]  # once while version 1 unloaded, once after version 2 loaded
    assert triton.loads == [([], None), ([2], 2)]
    assert (result["live_version"], result["previous_version"]) == (2, 1) and model.loaded_versions() == [2]


async def test_a_held_request_gives_up_with_a_503_after_rollout_hold_s(setup, tmp_path: Path) -> None:
    _, triton, _ = setup
    registry = FakeRegistry(Settings(model_repository=tmp_path / "models", rollout_hold_s=0.05), triton)  # type: ignore[arg-type]
    await registry.get(NAME)
    async with registry.held(NAME):
        with pytest.raises(OpenAIError) as raised:
            await registry.get(NAME)
    assert raised.value.status == 503 and "switching versions" in raised.value.message


async def test_a_tensor_parallel_engine_is_not_swapped_in_place(setup) -> None:
    model, triton, registry = setup
    triton.strategy = "swap"
    (model.engine_dir(2) / model_store.ENGINE_RECORD).write_text(json.dumps({"max_seq_len": 256, "world_size": 2}))
    with pytest.raises(OpenAIError) as raised:
        await Rollouts(registry, triton, grace_s=5).rollout(NAME, 2)  # type: ignore[arg-type]
    assert (raised.value.status, raised.value.code) == (409, "rollout_not_supported")
    assert "pod level" in raised.value.message and triton.loads == []


class OtherWorker:
    """The rollout `Fleet` of a server with one other worker, run in-process: the other worker's registry and
    its FleetMember (the coordinator's wire is tested in test_workers.py)."""

    def __init__(self, registry: ModelRegistry):
        self.registry = registry
        self.member = FleetMember(registry)

    async def begin(self, name: str) -> bool:
        return True

    def end(self, name: str) -> None:
        pass

    async def switch(self, name: str, version: str, retire: str | None, grace_s: float) -> bool:
        return await self.member.switch(name, int(version), retire, grace_s)

    async def hold(self, name: str, grace_s: float) -> bool:
        return await self.member.hold(name, grace_s)

    async def unhold(self, name: str) -> None:
        await self.member.unhold(name)


async def test_a_rollout_waits_for_the_other_workers_requests_on_the_old_version(setup, tmp_path: Path) -> None:
    model, triton, registry = setup
    other = OtherWorker(FakeRegistry(Settings(model_repository=tmp_path / "models"), triton))  # type: ignore[arg-type]
    theirs = await other.registry.get(NAME)
    theirs.engine.lease()  # a stream on the other worker, on version 1
    task = asyncio.create_task(Rollouts(registry, triton, grace_s=60, fleet=other).rollout(NAME, 2))  # type: ignore[arg-type]
    while (await other.registry.get(NAME)).version != "2":  # the other worker's new requests go to 2 ...
        await asyncio.sleep(0)
    await asyncio.sleep(0.05)
    assert len(triton.loads) == 1 and model.loaded_versions() == [1, 2]  # ... and 1 stays until its stream ends
    theirs.engine.release()
    assert (await task)["drained"] is True
    assert triton.loads[-1] == ([2], 2) and (await registry.get(NAME)).version == "2"


async def test_a_swap_holds_the_other_workers_new_requests_until_the_new_version_serves(setup, tmp_path: Path) -> None:
    model, triton, registry = setup
    triton.strategy = "swap"
    other = OtherWorker(FakeRegistry(Settings(model_repository=tmp_path / "models"), triton))  # type: ignore[arg-type]
    await other.registry.get(NAME)
    triton.gate = asyncio.Event()  # the new version's load waits
    task = asyncio.create_task(Rollouts(registry, triton, grace_s=60, fleet=other).rollout(NAME, 2))  # type: ignore[arg-type]
    while not triton.loads or triton.loads[-1][0] != [2]:
        await asyncio.sleep(0)
    arriving = asyncio.create_task(other.registry.get(NAME))  # a request reaching the other worker mid-swap
    await asyncio.sleep(0.05)
    assert not arriving.done()  # held, not failed, and not sent to the unloaded version
    triton.gate.set()
    assert (await arriving).version == "2"
    assert (await task)["live_version"] == 2 and triton.most_loaded == 1


async def test_a_lora_adapter_named_like_a_served_model_never_hides_it(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """LORA_MODULES naming an adapter after a served model: the model keeps its name (served, listed once), the
    adapter is left out, and the log says so once. Also for an adapter that names itself as its base."""
    model = make_model(tmp_path, [1], live=1)
    triton = FakeTriton(model)
    modules = json.dumps([{"name": NAME, "path": str(tmp_path / "no-adapter")},
                          {"name": "twin", "path": str(tmp_path / "no-adapter"), "base_model_name": "twin"}])
    registry = FakeRegistry(Settings(model_repository=tmp_path / "models", lora_modules=modules), triton)  # type: ignore[arg-type]
    for _ in range(2):
        context = await registry.get(NAME)
        assert (context.served_model_name, context.parent, context.version) == (NAME, None, "1")
    assert await registry.adapter_contexts() == []
    shadowed = [r.getMessage() for r in caplog.records if "has the name of a served model" in r.getMessage()]
    assert len(shadowed) == 1 and NAME in shadowed[0]
    with pytest.raises(OpenAIError) as missing:
        await registry.get("twin")  # its base is itself: a model this server does not have
    assert missing.value.status == 404
