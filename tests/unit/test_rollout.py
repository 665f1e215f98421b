"""The rollout sequence (frontend/rollout.py) against a fake Triton: what it asks Triton to load, in which
order, what it leaves on disk, and how it waits for the old version's requests."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from tritonclient.utils import InferenceServerException

from build_engine import model_store
from frontend.errors import OpenAIError
from frontend.model_context import ModelContext, ModelRegistry, VersionEngine
from frontend.rollout import Rollouts
from frontend.settings import Settings

NAME = "assistant"


class FakeTriton:
    """Records, at each load_model, the version policy and live link on disk; fails the loads it is told to."""

    def __init__(self, model: model_store.ManagedModel):
        self.model = model
        self.others: list[str] = []  # loads of other models
        self.loads: list[tuple[list[int], int | None]] = []
        self.fail_versions: set[int] = set()
        self.gate: asyncio.Event | None = None  # when set: the first load waits for it

    async def load_model(self, name: str) -> None:
        if name != self.model.name:
            self.others.append(name)
            return
        loaded = self.model.loaded_versions()
        self.loads.append((loaded, self.model.live_link_target()))
        if self.gate is not None:
            await self.gate.wait()
        failing = self.fail_versions & set(loaded)
        if failing:
            raise InferenceServerException(f"load failed for model '{name}': version {min(failing)} is at "
                                           "UNAVAILABLE state: corrupt weights")

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
    (await registry.get(NAME)).engine.lease()  # never released
    result = await Rollouts(registry, triton, grace_s=0.05).rollout(NAME, 2)  # type: ignore[arg-type]
    assert result["drained"] is False and triton.loads[-1] == ([2], 2)


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

    from frontend.app import create_app

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
