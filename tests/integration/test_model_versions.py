"""Several named models, and a rollout and rollback under live load, through the real launcher (with two
frontend workers: the rollout goes through one of them, and the looping streams reach both).

`make engine NAME=...` builds, `python -m launcher serve` (what `make serve` runs) serves, and
`make rollout` / `make rollback` switch versions while six streams loop on the model and one on another.
The checkpoints are scripted (tests/integration/scripted_model.py): greedy decoding of the chat prompt
walks a fixed chain, so every answer is known exactly and names the checkpoint (and tokenizer) it came
from, whatever else runs in the batch.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import httpx
import openai
import pytest

from benchmarks.servers import wait_http_ok
from frontend.settings import Settings
from launcher.ports import find_free_port
from tests.integration.conftest import REPO_ROOT, Stack
from tests.integration.scripted_model import CHAT_MESSAGES, _chain, write_scripted_checkpoint
from tests.trtllm_contract.double import make_named_contract_doubles

# Builds, a launcher start and several engine loads per test: generous bounds for slow machines.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ASSISTANT, CODER = "assistant", "coder"
V1_TEXT, V2_TEXT = "Version one.", "Second build!"
CODER_TEXT = " 你好🚀👍"  # as the SentencePiece tokenizer spells it (its `▁` is a space): only the coder's own
# tokenizer turns the coder's tokens into this text
STREAMS = 6
HELD_REQUEST_WAIT_S = Settings.model_fields["rollout_hold_s"].default + 60
LOAD_WAIT_S = 300  # for the looping streams' next answers: a bound for a hung stack, not a speed
# The launcher's own shutdown is bounded (frontend drain 30 s + 10 s, Triton 35 s, leftovers 5 s); this is a bound
# for a hung launcher, not a speed: the tests read the log of a clean stop (Triton unloading its models).
LAUNCHER_STOP_S = 300
BUILD_FLAGS = ["--max-batch-size", "8", "--max-seq-len", "256"]


@dataclass(frozen=True)
class Served:
    build: Path  # the build folder (BUILD=...): models/, the admin key, logs
    root: str  # http://127.0.0.1:<frontend port>
    env: dict[str, str]  # the ports, as `make rollout` must see them
    triton_http: str
    log: Path
    launcher: subprocess.Popen[bytes] | None = None  # `python -m launcher serve`


def build(build_dir: Path, name: str, checkpoint: Path) -> subprocess.CompletedProcess[str]:
    """`make engine MODEL=<checkpoint> NAME=<name>`, as the Makefile runs it."""
    return subprocess.run([sys.executable, "-m", "build_engine", "--model", str(checkpoint), "--name", name,
                           "--output-dir", str(build_dir), *BUILD_FLAGS], cwd=REPO_ROOT, capture_output=True,
                          text=True, check=True)


def scripted_checkpoint(demo_dir: Path, tokenizer_dir: Path, text: str, target: Path) -> Path:
    """A checkpoint of the demo shape whose greedy answer to CHAT_MESSAGES is `text` under `tokenizer_dir`."""
    chain = _chain(tokenizer_dir, text.lstrip())
    assert chain.text == text, (chain.text, text)
    write_scripted_checkpoint(demo_dir, target, [chain])
    if tokenizer_dir != demo_dir:
        for item in tokenizer_dir.iterdir():
            shutil.copy2(item, target / item.name)
    return target


@contextmanager
def launched(out: Path, frontend_workers: int = 1) -> Iterator[Served]:
    """`python -m launcher serve` (what `make serve` runs) on the named models of `out`, on free ports, with
    `frontend_workers` frontend processes."""
    ports = {name: str(find_free_port()) for name in
             ("FRONTEND_PORT", "TRITON_HTTP_PORT", "TRITON_GRPC_PORT", "TRITON_METRICS_PORT")}
    env = {**os.environ, **ports, "FRONTEND_WORKERS": str(frontend_workers)}
    env.pop("ADMIN_API_KEYS", None)
    env.pop("ADMIN_API_KEYS_FILE", None)
    log = out / "launcher.log"
    process = subprocess.Popen([sys.executable, "-m", "launcher", "serve", "--model-repository", str(out / "models"),
                                "--work-dir", str(out)], cwd=REPO_ROOT, env=env, stdout=log.open("w"),
                               stderr=subprocess.STDOUT, start_new_session=True)
    root = f"http://127.0.0.1:{ports['FRONTEND_PORT']}"
    try:
        wait_http_ok(f"{root}/health/ready", 300, process)
        yield Served(out, root, env, f"http://127.0.0.1:{ports['TRITON_HTTP_PORT']}", log, process)
    finally:
        stop_launcher(process)


def stop_launcher(process: subprocess.Popen) -> None:
    """SIGTERM, as Ctrl+C would, then wait for the launcher's whole shutdown: with two workers on a busy machine it
    takes longer than benchmarks' stop_process waits before SIGKILL, which left Triton unloading (its last
    'successfully unloaded' line missing from the log)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(LAUNCHER_STOP_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise AssertionError(f"the launcher did not stop within {LAUNCHER_STOP_S} s of SIGTERM")


def build_two_models(stack: Stack, out: Path, checkpoints: Path) -> None:
    demo_dir, sentencepiece_dir = stack.scripted.demo.tokenizer_dir, stack.scripted.sentencepiece_dir
    build(out, ASSISTANT, scripted_checkpoint(demo_dir, demo_dir, V1_TEXT, checkpoints / "assistant-v1"))
    build(out, CODER, scripted_checkpoint(demo_dir, sentencepiece_dir, CODER_TEXT, checkpoints / "coder"))


@pytest.fixture(scope="module")
def served(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    out = tmp_path_factory.mktemp("named_build")
    build_two_models(stack, out, tmp_path_factory.mktemp("checkpoints"))
    with launched(out, frontend_workers=2) as served:  # a rollout through one worker reaches the other
        yield served


def chat(served: Served, model: str) -> str:
    client = openai.OpenAI(base_url=f"{served.root}/v1", api_key="unused", max_retries=0, timeout=120)
    answer = client.chat.completions.create(model=model, messages=CHAT_MESSAGES, temperature=0, max_tokens=32)
    return answer.choices[0].message.content or ""


def make(served: Served, *args: str) -> subprocess.CompletedProcess[str]:
    """`make rollout|rollback ...` against the running server (the venv is already installed)."""
    return subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", *args, f"BUILD={served.build}",
                           f"PY={sys.executable}"], cwd=REPO_ROOT, env=served.env, capture_output=True, text=True,
                          timeout=600)


def model_card(served: Served, model: str) -> dict:
    response = httpx.get(f"{served.root}/v1/models/{model}", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_two_models_each_with_its_own_tokenizer(served: Served) -> None:
    cards = httpx.get(f"{served.root}/v1/models", timeout=30).json()["data"]
    assert sorted(card["id"] for card in cards) == [ASSISTANT, CODER]
    assert all(card["live_version"] == 1 and card["versions"][0]["status"] == "live" for card in cards)
    assert chat(served, ASSISTANT) == V1_TEXT
    assert chat(served, CODER) == CODER_TEXT  # the same prompt, rendered and decoded by the coder's tokenizer
    tokens = {model: httpx.post(f"{served.root}/tokenize", json={"model": model, "prompt": CODER_TEXT},
                                timeout=30).json()["tokens"] for model in (ASSISTANT, CODER)}
    assert tokens[ASSISTANT] != tokens[CODER]
    missing = httpx.post(f"{served.root}/v1/chat/completions", timeout=30,
                         json={"model": "nope", "messages": CHAT_MESSAGES, "max_tokens": 2})
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert error["code"] == "model_not_found" and f"'{ASSISTANT}'" in error["message"] and f"'{CODER}'" in error["message"]


def test_admin_routes_need_the_admin_key(served: Served) -> None:
    url = f"{served.root}/admin/models/{ASSISTANT}/rollout"
    assert httpx.post(url, json={"version": 1}, timeout=30).status_code == 401
    wrong = httpx.post(url, json={"version": 1}, headers={"Authorization": "Bearer not-the-key"}, timeout=30)
    assert wrong.status_code == 401 and wrong.json()["error"]["message"] == "Incorrect admin key provided."
    key_file = served.build / "admin_api_key"
    assert key_file.stat().st_mode & 0o077 == 0  # only its owner may read it


async def loop_streams(served: Served, model: str, stop: asyncio.Event, progress: asyncio.Condition,
                       answers: list[str], failures: list[str]) -> None:
    """Stream the chat request again and again until `stop`; every answer, or what went wrong, and a
    `progress` notification after each."""
    body = {"model": model, "messages": CHAT_MESSAGES, "temperature": 0, "max_tokens": 32, "stream": True}
    # A request held by a swap waits up to the server's rollout_hold_s (then gets a 503, a failure here): the
    # client waits longer, so that a slow swap on a busy machine is not taken for a lost request.
    async with httpx.AsyncClient(timeout=HELD_REQUEST_WAIT_S) as client:
        while not stop.is_set():
            try:
                async with client.stream("POST", f"{served.root}/v1/chat/completions", json=body) as response:
                    if response.status_code != 200:
                        failures.append(f"{response.status_code} {(await response.aread())[:200]!r}")
                        continue
                    text, done = [], False
                    async for line in response.aiter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: "):
                            chunk = json.loads(line[len("data: "):])
                            if "error" in chunk:
                                failures.append(f"error event {chunk['error']}")
                            elif chunk["choices"]:
                                text.append(chunk["choices"][0]["delta"].get("content") or "")
                    if not done:
                        failures.append("stream ended without [DONE]")
                    answers.append("".join(text))
            except httpx.HTTPError as exc:
                failures.append(repr(exc))
            finally:
                async with progress:
                    progress.notify_all()


async def answers_while(served: Served, action: list[str]) -> tuple[subprocess.CompletedProcess[str], list[str],
                                                                  list[str], list[str], list[str]]:
    """Run `make <action>` while STREAMS streams loop on the assistant and one on the coder; keep the load
    on until every assistant stream has had an answer after the action returned."""
    stop, progress = asyncio.Event(), asyncio.Condition()
    answers: list[list[str]] = [[] for _ in range(STREAMS)]
    coder_answers: list[str] = []
    failures: list[str] = []

    async def answered(enough: Callable[[], bool]) -> None:
        async with asyncio.timeout(LOAD_WAIT_S), progress:
            await progress.wait_for(lambda: enough() or bool(failures))

    tasks = [asyncio.create_task(loop_streams(served, ASSISTANT, stop, progress, answers[i], failures))
             for i in range(STREAMS)]
    tasks.append(asyncio.create_task(loop_streams(served, CODER, stop, progress, coder_answers, failures)))
    try:
        await answered(lambda: sum(map(len, answers)) >= STREAMS)  # the load is on before the action starts
        result = await asyncio.to_thread(make, served, *action)
        counts = [len(a) for a in answers]
        # Two more answers per stream: the first may have picked the old version before the switch.
        await answered(lambda: all(len(a) >= c + 2 for a, c in zip(answers, counts)))
        after = [a[-1] for a in answers]
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    return result, [text for a in answers for text in a], after, coder_answers, failures


async def test_rollout_and_rollback_under_load_drop_nothing(served: Served, stack: Stack) -> None:
    demo_dir = stack.scripted.demo.tokenizer_dir
    v2 = scripted_checkpoint(demo_dir, demo_dir, V2_TEXT, served.build.parent / "assistant-v2")
    built = await asyncio.to_thread(build, served.build, ASSISTANT, v2)
    assert "version:          2" in built.stdout
    card = model_card(served, ASSISTANT)
    assert card["live_version"] == 1 and [v["version"] for v in card["versions"]] == [1, 2]
    assert chat(served, ASSISTANT) == V1_TEXT  # built, not live

    result, answers, after, coder, failures = await answers_while(served, ["rollout", f"NAME={ASSISTANT}", "VERSION=2"])
    assert failures == []
    assert result.returncode == 0, result.stdout + result.stderr
    print(f"\nrollout under load: {len(answers)} assistant + {len(coder)} coder answers, {len(failures)} failed; "
          f"{result.stdout.strip()}")  # figures for `pytest -s` (the closing notes quote them)
    assert "assistant: version 2 is live; version 1 unloaded" in result.stdout
    assert set(answers) <= {V1_TEXT, V2_TEXT} and V1_TEXT in answers and V2_TEXT in answers
    assert after == [V2_TEXT] * STREAMS
    assert set(coder) == {CODER_TEXT}, coder  # the other model unaffected
    assert chat(served, ASSISTANT) == V2_TEXT
    card = model_card(served, ASSISTANT)
    assert (card["live_version"], card["previous_version"]) == (2, 1)
    key = (served.build / "triton_control_key").read_text().strip()  # the launch's key (restricted API)
    index = httpx.post(f"{served.triton_http}/v2/repository/index", json={"ready": True},
                       headers={"triton-control-key": key}, timeout=30).json()
    assert sorted((m["name"], m["version"]) for m in index) == [(ASSISTANT, "2"), (CODER, "1")]
    metrics = httpx.get(f"{served.root}/metrics", timeout=30).text
    assert 'model="assistant"' in metrics and 'version="2"' in metrics

    result, answers, after, coder, failures = await answers_while(served, ["rollback", f"NAME={ASSISTANT}"])
    assert failures == []
    assert result.returncode == 0, result.stdout + result.stderr
    print(f"rollback under load: {len(answers)} assistant + {len(coder)} coder answers, {len(failures)} failed; "
          f"{result.stdout.strip()}")
    assert "assistant: version 1 is live; version 2 unloaded" in result.stdout
    assert set(answers) <= {V1_TEXT, V2_TEXT} and after == [V1_TEXT] * STREAMS
    assert set(coder) == {CODER_TEXT}, coder
    assert chat(served, ASSISTANT) == V1_TEXT
    assert_clean_unloads((served.build / "logs" / "tritonserver.log").read_text())


def assert_clean_unloads(log: str) -> None:
    """Every unloaded version's stub exited cleanly: its metric families were released in finalize(), not in
    the interpreter's shutdown, where they segfaulted the stub at every unload (and once hung it, leaving the
    version UNLOADING for good)."""
    assert "successfully unloaded" in log
    assert "Segfault encountered" not in log, log[max(0, log.index("Segfault encountered") - 2000):][:6000]


def test_a_version_that_fails_to_load_leaves_the_live_one_serving(served: Served, stack: Stack) -> None:
    live = model_card(served, ASSISTANT)["live_version"]
    demo_dir = stack.scripted.demo.tokenizer_dir
    broken = build(served.build, ASSISTANT, scripted_checkpoint(demo_dir, demo_dir, V2_TEXT,
                                                                 served.build.parent / "assistant-v3"))
    version = int(broken.stdout.split("version:")[1].split()[0])
    (served.build / "models" / ASSISTANT / str(version) / "checkpoint" / "model.safetensors").write_bytes(b"corrupt")
    result = make(served, "rollout", f"NAME={ASSISTANT}", f"VERSION={version}")
    assert result.returncode != 0
    assert f"version {version} of model '{ASSISTANT}' failed to load; version {live} still serves" in result.stderr
    card = model_card(served, ASSISTANT)
    assert card["live_version"] == live
    assert chat(served, ASSISTANT) == (V1_TEXT if live == 1 else V2_TEXT)
    assert chat(served, CODER) == CODER_TEXT
    config = (served.build / "models" / ASSISTANT / "config.pbtxt").read_text()
    assert f"versions: [ {live} ]" in config  # the policy on disk is back to the live version alone


async def test_the_tensorrt_llm_layout_swaps_versions_under_load_through_the_live_link(
        stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same two models and rollout in the TensorRT-LLM layout, run by the contract double, which (like
    the C++ backend) reads its engine from the shared config's gpt_model_path only: version 2 serves its
    own weights only if the rollout pointed the `live` link at it before loading it. The TensorRT-LLM values
    say `rollout_strategy: swap` (one GPU holds one engine): the old version is unloaded before the new one
    loads, with the six looping streams held meanwhile, and not one of their requests fails."""
    out, checkpoints = tmp_path_factory.mktemp("named_trtllm"), tmp_path_factory.mktemp("checkpoints_trtllm")
    build_two_models(stack, out, checkpoints)
    demo_dir = stack.scripted.demo.tokenizer_dir
    build(out, ASSISTANT, scripted_checkpoint(demo_dir, demo_dir, V2_TEXT, checkpoints / "assistant-v2"))
    make_named_contract_doubles(out / "models")
    config = (out / "models" / ASSISTANT / "config.pbtxt").read_text()
    assert f'{out / "models" / ASSISTANT / "live" / "engine"}"' in config and "versions: [ 1 ]" in config
    assert 'key: "rollout_strategy"\n  value: { string_value: "swap" }' in config
    with launched(out, frontend_workers=2) as served:
        assert (chat(served, ASSISTANT), chat(served, CODER)) == (V1_TEXT, CODER_TEXT)
        result, answers, after, coder, failures = await answers_while(
            served, ["rollout", f"NAME={ASSISTANT}", "VERSION=2"])
        assert failures == []
        assert result.returncode == 0, result.stdout + result.stderr
        print(f"\nswap under load: {len(answers)} assistant + {len(coder)} coder answers, {len(failures)} failed; "
              f"{result.stdout.strip()}")
        assert set(answers) <= {V1_TEXT, V2_TEXT} and after == [V2_TEXT] * STREAMS
        assert set(coder) == {CODER_TEXT}, coder
        result, answers, after, coder, failures = await answers_while(served, ["rollback", f"NAME={ASSISTANT}"])
        assert failures == [] and result.returncode == 0, result.stdout + result.stderr
        assert set(answers) <= {V1_TEXT, V2_TEXT} and after == [V1_TEXT] * STREAMS
        assert (chat(served, ASSISTANT), chat(served, CODER)) == (V1_TEXT, CODER_TEXT)
    assert served.launcher.returncode == 0, served.log.read_text()[-4000:]  # a clean stop, nothing killed
    log = (out / "logs" / "tritonserver.log").read_text()
    assert "TEST MODEL, the TensorRT-LLM contract double" in log  # the double served, not the CPU model
    # Never two versions at once: each load of the assistant starts after the version before it has unloaded.
    events = re.findall(rf"loading: {ASSISTANT}:(\d+)|successfully unloaded '{ASSISTANT}' version (\d+)", log)
    order = [("load", loading) if loading else ("unloaded", unloaded) for loading, unloaded in events]
    assert order == [("load", "1"), ("unloaded", "1"), ("load", "2"), ("unloaded", "2"), ("load", "1"),
                     ("unloaded", "1")], order  # the last: the launcher stopping
