"""A client no one here wrote, unchanged: OpenAI's Codex CLI (`codex exec`, the pinned npm package, installed by
`make test` into build/codex) against the stack, with its default features (namespace tools, a hosted web_search,
`include: ["reasoning.encrypted_content"]`, `store: false`): a new conversation, then `codex exec resume --last`,
which sends the first turn back as input. Both exit 0, print no ERROR line, and Codex reads each stream to its
`response.completed` (its `turn.completed` event, with the usage it parsed from it).

Codex's first request is a ~30k-token prompt (its instructions and tool schemas), past the tiny engine's context,
so this builds a long-context engine of the scripted model (tests/integration/scripted_model.py: whatever the
prompt, its answer is a short fixed text, then its end; at Codex's default temperature too, its successor's
probability being 1 - 4e-7): the same weights with 64k positions, served with the demo ChatML template, which
carries tools (llama3_json calls). Nothing leaves loopback: Codex's proxy variables point at a closed port.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import string
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.integration.conftest import REPO_ROOT, Stack, frontend_on

pytestmark = pytest.mark.integration

CODEX_VERSION = "0.171.0"  # Makefile CODEX_VERSION
CODEX_DIR = REPO_ROOT / "build" / "codex"
LONG_MODEL = "tensorrt_llm_scripted_long"
LONG_SERVED_NAME = "scripted-long"
LONG_POSITIONS = 65536
LONG_SEQ_LEN = 49152  # Codex's ~30k-token prompt and its answer, with room for the second turn's history
CODEX_TIMEOUT_S = 900  # a hang guard: a 30k-token prefill on two shared cores takes minutes


@pytest.fixture(scope="module")
def codex_binary() -> Path:
    """The pinned Codex CLI, installed as `make codex-cli` installs it if it is not yet."""
    binary = CODEX_DIR / "node_modules" / ".bin" / "codex"
    stamp = CODEX_DIR / f".installed-{CODEX_VERSION}"
    if not stamp.exists():  # a missing npm fails here, naming it: a skip would hide the untested client
        assert shutil.which("npm") is not None, "npm not found: install Node.js with npm to run the Codex CLI test"
        subprocess.run(["make", "codex-cli"], check=True, cwd=REPO_ROOT)
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True, check=True).stdout
    assert CODEX_VERSION in version, version
    return binary


@pytest.fixture(scope="module")
def long_url(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The scripted model with a long context, built and loaded into the session Triton, with a frontend."""
    work = tmp_path_factory.mktemp("long")
    checkpoint = work / LONG_SERVED_NAME
    shutil.copytree(stack.scripted.checkpoint_dir, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config["max_position_embeddings"] = LONG_POSITIONS  # RoPE needs no table: the weights serve any position
    (checkpoint / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    subprocess.run([sys.executable, "-m", "build_engine", "--model", str(checkpoint), "--output-dir", str(work),
                    "--max-batch-size", "2", "--max-seq-len", str(LONG_SEQ_LEN)],
                   check=True, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    target = stack.repository / LONG_MODEL
    shutil.copytree(work / "model_repository" / "tensorrt_llm", target, ignore=shutil.ignore_patterns("__pycache__"))
    config_file = target / "config.pbtxt"
    config_file.write_text(re.sub(r'^name:\s*"[^"]*"', f'name: "{LONG_MODEL}"', config_file.read_text(), count=1,
                                  flags=re.M))
    httpx.post(f"{stack.triton_http_url}/v2/repository/models/{LONG_MODEL}/load", headers=stack.triton_control,
               timeout=300).raise_for_status()
    with frontend_on(stack, LONG_MODEL, work, SERVED_MODEL_NAME=LONG_SERVED_NAME, TOKENIZER_DIR=str(checkpoint),
                     RESPONSES_DB_URL=f"sqlite:///{work / 'responses.sqlite3'}",
                     RESPONSES_REASONING_KEYS="codex-test-key-of-at-least-32-characters") as url:
        yield url


def codex_home(tmp_path: Path, base_url: str) -> dict[str, str]:
    """Codex's environment: its home and config in `tmp_path`, our stack as a custom Responses provider."""
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    (home / ".codex" / "config.toml").write_text(f'''model = "{LONG_SERVED_NAME}"
model_provider = "stack"
check_for_update_on_startup = false

[model_providers.stack]
name = "stack"
base_url = "{base_url}"
wire_api = "responses"
env_key = "STACK_API_KEY"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = {CODEX_TIMEOUT_S * 1000}
''')
    return {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home / ".codex"),
            "STACK_API_KEY": "unused", "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
            "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9", "ALL_PROXY": "http://127.0.0.1:9",
            "RUST_LOG": "error"}


def codex_exec(binary: Path, env: dict[str, str], workdir: Path, *args: str) -> tuple[list[dict[str, Any]], str]:
    """Run `codex exec --json ...`: its JSONL events, and everything it printed (for the failure message)."""
    started = time.monotonic()
    done = subprocess.run([str(binary), "exec", *args], env=env, cwd=workdir, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=CODEX_TIMEOUT_S)
    printed = f"exit {done.returncode} after {time.monotonic() - started:.0f} s\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, printed
    assert not [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("ERROR")], printed
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    print(printed)
    return events, printed


def turn_usage(events: list[dict[str, Any]], printed: str) -> dict[str, Any]:
    completed = [event for event in events if event.get("type") == "turn.completed"]
    assert len(completed) == 1 and not [e for e in events if e.get("type") in ("turn.failed", "error")], printed
    # Codex's one advisory (an `error` item, not an error): it knows no metadata of a model it has never heard of.
    advisories = [e["item"]["message"] for e in events if e.get("type") == "item.completed"
                  and e["item"].get("type") == "error"]
    assert all(message.startswith(f"Model metadata for `{LONG_SERVED_NAME}` not found") for message in advisories), \
        printed
    return completed[0]["usage"]


def test_codex_exec_runs_a_turn_and_resumes_it(stack: Stack, codex_binary: Path, long_url: str,
                                               tmp_path: Path) -> None:
    env = codex_home(tmp_path, long_url)
    workdir = tmp_path / "work"
    workdir.mkdir()
    common = ["--json", "--skip-git-repo-check"]
    events, printed = codex_exec(codex_binary, env, workdir, *common, "Say hello.")
    first = turn_usage(events, printed)
    assert first["input_tokens"] > 10_000, first  # the long agent prompt, served whole
    messages = [e["item"]["text"] for e in events
                if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"]
    assert messages == [stack.scripted.demo.text], printed  # the scripted answer, as Codex parsed it

    hits_before = stack.engine_metric("prefix_cache_hits_tokens_total", LONG_MODEL)
    events, printed = codex_exec(codex_binary, env, workdir, "resume", "--last", *common, "Say it again.")
    # Codex reports the thread's usage so far: the resumed turn's own prompt is the difference, and it holds the
    # whole first turn (store false: sent back as input), whose prompt the engine's prefix cache finds.
    resumed = turn_usage(events, printed)["input_tokens"] - first["input_tokens"]
    assert resumed > first["input_tokens"], (first, resumed)
    assert stack.engine_metric("prefix_cache_hits_tokens_total", LONG_MODEL) - hits_before \
        >= first["input_tokens"] // 2
    messages = [e["item"]["text"] for e in events
                if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"]
    assert messages == [stack.scripted.demo.text], printed


@pytest.mark.slow  # about a minute of prefill on two cores: `make soak` runs it, `make test` does not
def test_a_30k_token_prompt_is_served(long_url: str) -> None:
    """What a coding agent's first request costs here: a 30k-token prompt (words no cache holds), one token out."""
    rng = random.Random(30)
    words = " ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9)))
                     for _ in range(6800))
    started = time.monotonic()
    response = httpx.post(f"{long_url}/responses", timeout=CODEX_TIMEOUT_S, json={
        "model": LONG_SERVED_NAME, "input": words, "max_output_tokens": 1, "store": False})
    elapsed = time.monotonic() - started
    assert response.status_code == 200, response.text
    tokens = response.json()["usage"]["input_tokens"]
    assert 28_000 <= tokens < LONG_SEQ_LEN
    print(f"{tokens}-token prompt: first token after {elapsed:.1f} s")
