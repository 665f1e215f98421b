"""Which named models the frontend serves, and which version, through the real launcher (issue 25; review
findings 8, 11 and 13):
1. a model built while serving, then the frontend killed (the supervisor restarts it): the new frontend
   serves what Triton has loaded, so readiness and the listing stay 200, and `make rollout` loads the model;
2. a rollout racing a fresh frontend's first requests (its model context not loaded yet): every request is
   served by a version Triton has loaded, and the model ends on the rolled-out version;
3. Triton killed mid-rollout: the restarted stack serves the version rollout.json names, and only it.

The stack and its models are those of test_model_versions.py (scripted checkpoints: each version's answer
names it). One launcher serves the three tests in order.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from typing import Iterator

import httpx
import pytest

from benchmarks.servers import wait_http_ok
from tests.integration.conftest import REPO_ROOT, Stack
from tests.integration.scripted_model import CHAT_MESSAGES
from tests.integration.test_model_versions import (ASSISTANT, CODER, CODER_TEXT, V1_TEXT, V2_TEXT, Served, build,
                                                   chat, launched, make, model_card, scripted_checkpoint)
from tests.integration.test_supervision import FRONTEND, TRITON, _child_pid

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

TEXTS = {1: V1_TEXT, 2: V2_TEXT}
RECOVERY_S = 300  # a restarted Triton reloads every model: a hang guard on a busy machine, not a speed
FIRST_REQUESTS = 6


@pytest.fixture(scope="module")
def served(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The assistant at version 1 with version 2 built (not live); nothing else yet."""
    out, checkpoints = tmp_path_factory.mktemp("registry_build"), tmp_path_factory.mktemp("registry_checkpoints")
    demo_dir = stack.scripted.demo.tokenizer_dir
    build(out, ASSISTANT, scripted_checkpoint(demo_dir, demo_dir, V1_TEXT, checkpoints / "assistant-v1"))
    build(out, ASSISTANT, scripted_checkpoint(demo_dir, demo_dir, V2_TEXT, checkpoints / "assistant-v2"))
    with launched(out) as served:
        deadline = time.monotonic() + 60  # the supervisor runs (a child killed before it starts ends the launcher)
        while "Press Ctrl+C to stop" not in served.log.read_text():
            assert time.monotonic() < deadline, served.log.read_text()[-3000:]
            time.sleep(0.2)
        yield served


def child(served: Served, marker: str, not_in: set[int] | None = None, timeout_s: float = 120) -> int:
    """The launcher's child process whose command line holds `marker`, other than `not_in`."""
    assert served.launcher is not None
    pid = _child_pid(served.launcher, marker, not_in or set(), timeout_s)
    assert pid is not None, f"the launcher exited: {served.log.read_text()[-3000:]}"
    return pid


def kill_frontend(served: Served) -> int:
    """SIGKILL the frontend's process group; the new frontend's pid, once the supervisor has started it."""
    old = child(served, FRONTEND)
    os.killpg(old, signal.SIGKILL)
    return child(served, FRONTEND, {old})


def triton_ready_index(served: Served) -> list[tuple[str, str]]:
    key = (served.build / "triton_control_key").read_text().strip()
    index = httpx.post(f"{served.triton_http}/v2/repository/index", json={"ready": True},
                       headers={"triton-control-key": key}, timeout=30).json()
    return sorted((m["name"], m["version"]) for m in index)


def wait_triton_serves(served: Served, expected: tuple[str, str], timeout_s: float = RECOVERY_S) -> None:
    """Until Triton itself (not the frontend, whose readiness check would load its contexts) has `expected`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if expected in triton_ready_index(served):
                return
        except (httpx.HTTPError, ValueError):
            pass
        assert time.monotonic() < deadline, f"Triton does not serve {expected}: {served.log.read_text()[-3000:]}"
        time.sleep(0.5)


def listed(served: Served) -> list[str]:
    response = httpx.get(f"{served.root}/v1/models", timeout=60)
    assert response.status_code == 200, response.text
    return [card["id"] for card in response.json()["data"]]


def ready_status(served: Served) -> int:
    return httpx.get(f"{served.root}/health/ready", timeout=60).status_code


def test_a_model_built_while_serving_survives_a_frontend_restart_and_rolls_out(served: Served, stack: Stack) -> None:
    """Finding 8: the restarted frontend took every model on disk as served; Triton had not loaded the new one,
    so readiness and /v1/models were 503 and `make rollout` answered "already live" without loading it."""
    demo_dir, sentencepiece_dir = stack.scripted.demo.tokenizer_dir, stack.scripted.sentencepiece_dir
    build(served.build, CODER, scripted_checkpoint(demo_dir, sentencepiece_dir, CODER_TEXT,
                                                   served.build.parent / "registry-coder"))
    kill_frontend(served)
    wait_http_ok(f"{served.root}/health/ready", RECOVERY_S, served.launcher)
    assert ready_status(served) == 200
    assert listed(served) == [ASSISTANT]  # what Triton has loaded
    assert httpx.get(f"{served.root}/v1/models/{CODER}", timeout=30).status_code == 404
    assert chat(served, ASSISTANT) == V1_TEXT

    result = make(served, "rollout", f"NAME={CODER}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{CODER}: version 1 is live (a model new to this server)" in result.stdout
    assert chat(served, CODER) == CODER_TEXT
    assert listed(served) == [ASSISTANT, CODER] and ready_status(served) == 200
    assert (CODER, "1") in triton_ready_index(served)


async def test_a_rollout_racing_the_first_requests_ends_on_a_loaded_version(served: Served) -> None:
    """Finding 11: a frontend that started while Triton did not answer has no model context; its first
    requests load version 1's while `make rollout` switches to version 2. Every request is answered by a
    loaded version, and afterwards every request goes to version 2 (not to version 1, unloaded)."""
    assert model_card(served, ASSISTANT)["live_version"] == 1
    log_before = served.log.read_text()
    # The supervisor restarts the killed frontend; as soon as its process exists (it takes seconds to import),
    # Triton is paused, and the launcher with it (its health check would restart a Triton that does not
    # answer): the new frontend's start-up load gets no answer, and it starts without contexts.
    triton, old = child(served, TRITON), child(served, FRONTEND)
    os.killpg(old, signal.SIGKILL)
    await asyncio.to_thread(child, served, FRONTEND, {old})
    assert served.launcher is not None
    os.kill(triton, signal.SIGSTOP)
    os.kill(served.launcher.pid, signal.SIGSTOP)
    try:
        await asyncio.to_thread(wait_http_ok, f"{served.root}/health/live", RECOVERY_S, served.launcher)
    finally:
        os.kill(triton, signal.SIGCONT)
        os.kill(served.launcher.pid, signal.SIGCONT)
    assert served.log.read_text().count("will retry on the next request") > log_before.count(
        "will retry on the next request"), "the new frontend loaded its contexts at start: no race to run"
    await asyncio.to_thread(wait_triton_serves, served, (ASSISTANT, "1"))

    body = {"model": ASSISTANT, "messages": CHAT_MESSAGES, "temperature": 0, "max_tokens": 32}
    answers: list[str] = []
    failures: list[str] = []

    async def one(client: httpx.AsyncClient) -> None:
        response = await client.post(f"{served.root}/v1/chat/completions", json=body)
        if response.status_code != 200:
            failures.append(f"{response.status_code} {response.text[:300]}")
        else:
            answers.append(response.json()["choices"][0]["message"]["content"])

    async with httpx.AsyncClient(timeout=120) as client:
        rollout = asyncio.create_task(asyncio.to_thread(make, served, "rollout", f"NAME={ASSISTANT}", "VERSION=2"))
        await asyncio.gather(*(one(client) for _ in range(FIRST_REQUESTS)))  # the first requests, with it
        while not rollout.done():  # and more, for as long as the rollout runs
            await asyncio.gather(*(one(client) for _ in range(2)))
        result = await rollout
        during = list(answers)
        answers.clear()
        await asyncio.gather(*(one(client) for _ in range(FIRST_REQUESTS)))
    assert failures == [], failures
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{ASSISTANT}: version 2 is live; version 1 unloaded" in result.stdout
    assert set(during) <= {V1_TEXT, V2_TEXT}, during
    assert answers == [V2_TEXT] * FIRST_REQUESTS
    assert model_card(served, ASSISTANT)["live_version"] == 2
    # Ready again once Triton has finished unloading version 1 (its strict readiness counts that model).
    await asyncio.to_thread(wait_http_ok, f"{served.root}/health/ready", 120, served.launcher)
    assert [v for name, v in triton_ready_index(served) if name == ASSISTANT] == ["2"]


def test_triton_killed_mid_rollout_restarts_on_the_version_rollout_json_names(served: Served) -> None:
    """Finding 13: Triton dies while a rollout has both versions in the policy. The launcher settles the
    files before restarting it, the rollout either fails or commits, and the frontend re-reads: the stack
    ends serving the version rollout.json names, with only that version loaded."""
    model_dir = served.build / "models" / ASSISTANT
    live = json.loads((model_dir / "rollout.json").read_text())["live"]
    target = 1 if live == 2 else 2
    both = "versions: [ 1, 2 ]"
    victim = child(served, TRITON)
    rollout = subprocess.Popen(["make", "--no-print-directory", "-o", ".venv/.installed", "rollout",
                                f"NAME={ASSISTANT}", f"VERSION={target}", f"BUILD={served.build}",
                                f"PY={sys.executable}"], cwd=REPO_ROOT, env=served.env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while both not in (model_dir / "config.pbtxt").read_text():  # version `target` is loading beside
        assert rollout.poll() is None, f"the rollout ended before Triton was killed: {rollout.communicate()[0]}"
        assert time.monotonic() < deadline, "the rollout never named both versions in the policy"
        time.sleep(0.005)
    os.killpg(victim, signal.SIGKILL)
    output = rollout.communicate(timeout=600)[0]
    print(f"\nrollout while Triton was killed: exit {rollout.returncode}: {output.strip()}")
    child(served, TRITON, {victim}, RECOVERY_S)  # restarted by the supervisor

    deadline = time.monotonic() + RECOVERY_S
    while True:
        state = json.loads((model_dir / "rollout.json").read_text())["live"]
        try:
            if (ready_status(served) == 200
                    and [v for name, v in triton_ready_index(served) if name == ASSISTANT] == [str(state)]):
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"not serving version {state} alone: {served.log.read_text()[-3000:]}"
        time.sleep(0.5)
    assert chat(served, ASSISTANT) == TEXTS[state]
    assert model_card(served, ASSISTANT)["live_version"] == state
    assert f"versions: [ {state} ]" in (model_dir / "config.pbtxt").read_text()
    assert os.readlink(model_dir / "live") == str(state)
    assert chat(served, ASSISTANT) == TEXTS[state]
