"""LoRA adapters through the whole stack, on the TensorRT-LLM contract double (tests/trtllm_contract): the
frontend converts PEFT adapters to TensorRT-LLM's lora_weights/lora_config, sends them on a task's first use and
again after the double's PEFT cache evicted it (rules.PeftCache, two tasks here), and serves each adapter as a
model: listed with its base as parent, selected by `model`, loaded and unloaded while serving."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from frontend.generation.engine import EngineRequest, LoraWeights, SamplingOptions
from frontend.generation.triton_engine import TritonEngine
from frontend.models.adapters import task_id_of
from frontend.models.lora import convert_peft
from tests.integration.conftest import CONTRACT_MODEL, Stack, frontend_on, read_stream

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.integration
ADMIN_KEY = "lora-admin-test-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def adapters(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three PEFT adapters of the demo checkpoint (random A, nonzero B), and one of rank 8 for the rank limit."""
    root = tmp_path_factory.mktemp("lora")
    made = {}
    for seed, (name, rank, modules) in enumerate([("a1", 4, ["q_proj", "v_proj"]), ("a2", 4, ["o_proj", "down_proj"]),
                                                  ("a3", 2, ["gate_proj", "up_proj"]), ("big", 8, ["q_proj"])]):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(stack.checkpoint_dir)
        model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules,
                                                          init_lora_weights=False))
        with torch.no_grad():
            for parameter_name, parameter in model.named_parameters():
                if "lora_B" in parameter_name:
                    parameter.normal_(0, 0.5)
        model.save_pretrained(root / name)
        made[name] = root / name
    return made


@pytest.fixture(scope="module")
def lora_url(stack: Stack, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    modules = json.dumps([{"name": "a1", "path": str(adapters["a1"]), "base_model_name": stack.model},
                          {"name": "a2", "path": str(adapters["a2"])}])
    with frontend_on(stack, CONTRACT_MODEL, tmp_path_factory.mktemp("lora_frontend"), LORA_MODULES=modules,
                     LORA_RUNTIME_UPDATES="true", ADMIN_API_KEYS=ADMIN_KEY, LORA_MAX_RANK="4") as url:
        yield url


def complete(url: str, model: str, **fields) -> httpx.Response:
    body = {"model": model, "prompt": "The lighthouse keeper", "max_tokens": 8, "temperature": 0, **fields}
    return httpx.post(f"{url}/completions", json=body, timeout=120)


def model_ids(url: str) -> list[str]:
    return [card["id"] for card in httpx.get(f"{url}/models", timeout=30).json()["data"]]


def test_adapters_are_listed_with_their_base_and_selected_by_model(stack: Stack, lora_url: str,
                                                                   adapters: dict[str, Path]) -> None:
    cards = {card["id"]: card for card in httpx.get(f"{lora_url}/models", timeout=30).json()["data"]}
    assert cards["a1"]["parent"] == stack.model and cards["a1"]["root"] == str(adapters["a1"])
    assert cards["a2"]["parent"] == stack.model and "parent" not in cards[stack.model]
    texts = {}
    for model in (stack.model, "a1", "a2"):
        response = complete(lora_url, model, ignore_eos=True)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == model
        texts[model] = response.json()["choices"][0]["text"]
    assert len(set(texts.values())) == 3  # each adapter really changes the model
    assert complete(lora_url, "a1", ignore_eos=True).json()["choices"][0]["text"] == texts["a1"]  # cached: same
    chat = httpx.post(f"{lora_url}/chat/completions", timeout=120, json={
        "model": "a2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["model"] == "a2", chat.text
    responses = httpx.post(f"{lora_url}/responses", timeout=120, json={"model": "a1", "input": "hi",
                                                                        "max_output_tokens": 4, "store": False})
    assert responses.status_code == 200 and responses.json()["model"] == "a1", responses.text
    missing = complete(lora_url, "a9")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


async def test_weights_go_with_a_tasks_first_request_only_and_again_after_an_eviction(
        stack: Stack, adapters: dict[str, Path]) -> None:
    engine = TritonEngine(stack.triton_grpc_url, CONTRACT_MODEL)
    sent: list[tuple[str, bool]] = []
    lora_inputs = engine._lora_inputs

    async def recording(model: str, lora: LoraWeights, with_weights: bool):
        sent.append((lora.name, with_weights))
        return await lora_inputs(model, lora, with_weights)

    engine._lora_inputs = recording
    loras = {}
    for name in ("a1", "a2", "a3"):
        tensors = convert_peft(adapters[name], 64, None)
        loras[name] = LoraWeights(name, task_id_of(f"{name}-direct", tensors), tensors.weights, tensors.config)
    try:
        for i, name in enumerate(["a1", "a1", "a2", "a3", "a1"]):  # a3 evicts a1, the least recently used
            request = EngineRequest(f"lora-{i}", [1, 2, 3, 4], SamplingOptions(max_tokens=3, ignore_eos=True),
                                    lora=loras[name])
            tokens = [t for chunk in [c async for c in engine.generate(request)] for t in chunk.token_ids]
            assert len(tokens) == 3
    finally:
        await engine.close()
    assert sent == [("a1", True), ("a1", False), ("a2", True), ("a3", True), ("a1", False), ("a1", True)]


async def test_loading_while_streams_run_and_unloading_lets_the_stream_finish(lora_url: str,
                                                                             adapters: dict[str, Path]) -> None:
    async with httpx.AsyncClient(timeout=120) as client:
        load = {"lora_name": "a3", "lora_path": str(adapters["a3"])}
        assert (await client.post(f"{lora_url}/load_lora_adapter", json=load)).status_code == 401
        before = model_ids(lora_url)
        for bad, code in (({"lora_path": str(adapters["big"])}, "rank 8 is over"),
                          ({"lora_path": str(adapters["a3"] / "missing")}, "adapter_config.json")):
            refused = await client.post(f"{lora_url}/load_lora_adapter", json={**load, **bad}, headers=ADMIN)
            assert refused.status_code == 400 and code in refused.json()["error"]["message"], refused.text
        assert model_ids(lora_url) == before  # a refused adapter changes nothing
        # Eight streams on a1; a3 is loaded while they run: none fails.
        body = {"model": "a1", "prompt": "Once", "max_tokens": 24, "ignore_eos": True, "stream": True}
        started = [asyncio.Event() for _ in range(8)]
        streams = [asyncio.create_task(read_stream(client, f"{lora_url}/completions", body, event))
                   for event in started]
        await asyncio.gather(*(event.wait() for event in started))
        loaded = await client.post(f"{lora_url}/load_lora_adapter", json=load, headers=ADMIN)
        assert loaded.status_code == 200, loaded.text
        for payloads, _ in await asyncio.gather(*streams):
            assert payloads[-1] == "[DONE]" and json.loads(payloads[-2])["choices"][0]["finish_reason"] == "length"
        assert "a3" in model_ids(lora_url)
        # A stream on a3 outlives a3's unloading; the next request is a 404.
        started_a3 = asyncio.Event()
        stream = asyncio.create_task(read_stream(client, f"{lora_url}/completions",
                                                 {**body, "model": "a3", "max_tokens": 32}, started_a3))
        await started_a3.wait()
        unloaded = await client.post(f"{lora_url}/unload_lora_adapter", json={"lora_name": "a3"}, headers=ADMIN)
        assert unloaded.status_code == 200, unloaded.text
        after = await client.post(f"{lora_url}/completions", json={**body, "model": "a3", "stream": False})
        assert after.status_code == 404, after.text
        payloads, _ = await stream
        assert payloads[-1] == "[DONE]" and json.loads(payloads[-2])["choices"][0]["finish_reason"] == "length"
        again = await client.post(f"{lora_url}/unload_lora_adapter", json={"lora_name": "a3"}, headers=ADMIN)
        assert again.status_code == 404
