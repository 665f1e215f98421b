"""The frontend's side of LoRA without servers: LORA_MODULES, stable task ids, the state every worker reads,
the weights sent on first use and after a cache miss, and vllm:lora_requests_info."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from frontend.generation.engine import EngineRequest, LoraWeights, SamplingOptions, TokenChunk
from frontend.generation.triton_engine import TritonEngine
from frontend.models.adapters import (AdapterSet, AdapterSpec, parse_lora_modules, lora_requests_info,
                                      task_id_of)
from frontend.models.lora import AdapterError, LoraTensors
from frontend.observability.metrics import Metrics
from frontend.api_types.errors import engine_error


def test_lora_modules_take_vllms_two_forms() -> None:
    assert parse_lora_modules("a=/x, b=/y") == [AdapterSpec("a", Path("/x")), AdapterSpec("b", Path("/y"))]
    assert parse_lora_modules(json.dumps([{"name": "a", "path": "/x", "base_model_name": "base"}])) == [
        AdapterSpec("a", Path("/x"), "base")]
    assert parse_lora_modules(json.dumps({"name": "a", "path": "/x"})) == [AdapterSpec("a", Path("/x"))]
    assert parse_lora_modules("") == []
    for bad in ("a", "a=/x,a=/y", "[{\"name\": \"a\"}]", "[oops"):
        with pytest.raises(ValueError):
            parse_lora_modules(bad)


def tensors(value: float) -> LoraTensors:
    weights = np.full((1, 8), value, dtype=np.float32)
    config = np.array([[1, 0, 2]], dtype=np.int32)
    import zlib
    return LoraTensors(weights, config, 2, ("q_proj",), zlib.crc32(weights.tobytes()))


def test_task_ids_are_stable_and_change_with_the_weights() -> None:
    assert task_id_of("a", tensors(1.0)) == task_id_of("a", tensors(1.0))
    assert task_id_of("a", tensors(1.0)) != task_id_of("a", tensors(2.0))
    assert task_id_of("a", tensors(1.0)) != task_id_of("b", tensors(1.0))
    assert 0 < task_id_of("a", tensors(1.0)) < 2 ** 63


def test_adapters_loaded_on_one_worker_are_seen_by_every_worker(tmp_path: Path) -> None:
    state = tmp_path / "lora.json"
    one, two = AdapterSet([], 64, state), AdapterSet([AdapterSpec("static", Path("/s"))], 64, state)
    one.add(AdapterSpec("a", Path("/a"), "base"))
    assert two.spec("a") == AdapterSpec("a", Path("/a"), "base")
    assert set(two.specs()) == {"a", "static"}
    assert two.remove("a") and one.spec("a") is None
    assert not one.remove("a")
    with pytest.raises(AdapterError, match="configured at start"):
        two.remove("static")


class FakeEngine:
    def __init__(self, name: str, running: int, leases: int):
        self.adapter = type("A", (), {"name": name})()
        self.running, self.leases = running, leases


def test_lora_requests_info_names_running_and_waiting_adapters() -> None:
    engines = [FakeEngine("b", 1, 1), FakeEngine("a", 1, 3), FakeEngine("c", 0, 0), FakeEngine("d", 0, 1)]
    assert lora_requests_info(engines) == (["a", "b"], ["a", "d"])
    metrics = Metrics()
    metrics.live.lora = lambda: (8, ["a", "b"], ["d"])
    text = metrics.render().decode()
    assert 'vllm:lora_requests_info{max_lora="8",running_lora_adapters="a,b",waiting_lora_adapters="d"}' in text


async def test_weights_are_sent_on_first_use_and_again_after_the_engine_lost_them() -> None:
    engine = TritonEngine("127.0.0.1:1", "tensorrt_llm")
    cached: set[int] = set()
    sent: list[bool] = []
    ids: list[str] = []

    async def lora_inputs(model, lora, with_weights):
        sent.append(with_weights)
        return [with_weights]

    async def generate(request, model=None, version="", extra_inputs=None):
        ids.append(request.request_id)
        if extra_inputs[0]:
            cached.add(request.lora.task_id)
        elif request.lora.task_id not in cached:
            raise engine_error(f"the engine failed the request: LoRA task {request.lora.task_id} not found in "
                               "cache. Please send LoRA weights with request")
        yield TokenChunk([1])

    engine._lora_inputs, engine._generate = lora_inputs, generate
    lora = LoraWeights("a", 7, None, None)
    request = EngineRequest("r", [1], SamplingOptions(max_tokens=1), lora=lora)
    for _ in range(2):
        assert [c.token_ids async for c in engine.generate(request)] == [[1]]
    cached.clear()  # evicted
    assert [c.token_ids async for c in engine.generate(request)] == [[1]]
    assert sent == [True, False, False, True]
    assert ids == ["r", "r", "r", "r-lora"]  # the retry must not be stopped by the failed call's stop-by-id
    await engine.close()
