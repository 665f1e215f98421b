"""Production hardening against real servers on loopback: API keys (and SIGHUP reload), overload (429 +
Retry-After, never a hang or a 500), rate limits, body and prompt limits, deadlines, /metrics, the JSON
access log, HTTPS (and the launcher's https probe), and draining on SIGTERM.

Each frontend here is started with the settings under test against the session stack's Triton."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from launcher.__main__ import banner, build_parser, served_model_id
from launcher.config import load_config
from launcher.loopback import http_get
from launcher.ports import find_free_port
from tests.integration.conftest import (ENGINE_WAIT_S, SLOW_MODEL, Stack, engine_settled, read_stream, start_frontend,
                                        stop_process, wait_engine, wait_http_ok)
from tests.tls import self_signed_certificate

pytestmark = pytest.mark.integration

KEY_A, KEY_B, KEY_ENV = "sk-test-alpha-0123456789", "sk-test-bravo-0123456789", "sk-env-charlie-0123456789"


@dataclass
class Frontend:
    root: str
    process: subprocess.Popen
    log: Path

    def log_lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()

    def access_records(self) -> list[dict]:
        records = []
        for line in self.log_lines():
            if line.startswith("{"):
                record = json.loads(line)
                if record.get("event") == "request":
                    records.append(record)
        return records


def launch(stack: Stack, log: Path, scheme: str = "http", **env: str) -> Frontend:
    port = find_free_port()
    process = start_frontend(stack.triton_grpc_url, port, log, **env)
    root = f"{scheme}://127.0.0.1:{port}"
    try:
        if scheme == "https":
            deadline = time.monotonic() + 120
            while True:
                assert process.poll() is None, log.read_text()
                try:
                    if httpx.get(f"{root}/health/ready", verify=False, timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline
                time.sleep(0.3)
        else:
            wait_http_ok(f"{root}/health/ready", 120, process)
    except BaseException:
        stop_process(process)
        raise
    return Frontend(root, process, log)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat_body(stack: Stack, **fields) -> dict:
    return {"model": stack.model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4, **fields}


def assert_error(response: httpx.Response, status: int, code: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error


def sse_payloads(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def metrics_when(root: str, condition, what: str, headers: dict[str, str] | None = None,
                 within_s: float = ENGINE_WAIT_S) -> str:
    """The frontend's /metrics text once `condition(text)` holds. A request's metrics are recorded, and its slot
    released, after its last byte went out: a client can read /metrics before that."""
    deadline = time.monotonic() + within_s
    while not condition(text := httpx.get(f"{root}/metrics", headers=headers, timeout=10).text):
        assert time.monotonic() < deadline, f"/metrics: no {what} after {within_s:.0f} s"
        time.sleep(0.05)
    return text


@pytest.fixture(scope="module")
def secured(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Frontend, Path]]:
    """Keys from a file and from the environment, 8 in flight + 8 queued, small body and prompt limits."""
    tmp = tmp_path_factory.mktemp("secured")
    keys_file = tmp / "api_keys"
    keys_file.write_text(f"# test keys\n{KEY_A}\n{KEY_B}\n")
    frontend = launch(stack, tmp / "frontend.log", API_KEYS_FILE=str(keys_file), API_KEYS=KEY_ENV,
                      MAX_IN_FLIGHT="8", MAX_QUEUED="8", MAX_BODY_BYTES="20000", MAX_PROMPT_TOKENS="100",
                      REQUEST_TIMEOUT_S="120")
    try:
        yield frontend, keys_file
    finally:
        stop_process(frontend.process)


@pytest.fixture(scope="module")
def slow_secured(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontend]:
    """8 in flight + 8 queued, with a key, on the slow test engine (>= 50 ms a step: conftest.SLOW_MODEL), so
    that a stream lasts at least (tokens x 50 ms) however fast this machine is."""
    frontend = launch(stack, tmp_path_factory.mktemp("slow_secured") / "frontend.log", API_KEYS=KEY_A,
                      MAX_IN_FLIGHT="8", MAX_QUEUED="8", REQUEST_TIMEOUT_S="120", ENGINE_MODEL=SLOW_MODEL)
    try:
        yield frontend
    finally:
        stop_process(frontend.process)


# ----- auth -----------------------------------------------------------------------------------------------
def test_api_keys_no_key_wrong_key_right_key_and_revocation_on_sighup(stack: Stack, secured) -> None:
    frontend, keys_file = secured
    url = f"{frontend.root}/v1/chat/completions"
    error = assert_error(httpx.post(url, json=chat_body(stack), timeout=60), 401, "invalid_api_key")
    assert error["type"] == "invalid_request_error"
    assert_error(httpx.post(url, json=chat_body(stack), headers=auth(KEY_A[:-1] + "x"), timeout=60), 401,
                 "invalid_api_key")
    assert_error(httpx.post(url, json=chat_body(stack), headers={"Authorization": KEY_A}, timeout=60), 401,
                 "invalid_api_key")  # not a Bearer header
    assert_error(httpx.get(f"{frontend.root}/v1/models", timeout=60), 401, "invalid_api_key")
    for key in (KEY_A, KEY_B, KEY_ENV):
        response = httpx.post(url, json=chat_body(stack), headers=auth(key), timeout=60)
        assert response.status_code == 200, response.text
    assert httpx.get(f"{frontend.root}/v1/models", headers=auth(KEY_A), timeout=60).status_code == 200
    # health endpoints and (by default) /metrics are open
    assert httpx.get(f"{frontend.root}/health/live", timeout=10).status_code == 200
    assert httpx.get(f"{frontend.root}/health/ready", timeout=10).status_code == 200
    assert httpx.get(f"{frontend.root}/metrics", timeout=10).status_code == 200

    keys_file.write_text(f"{KEY_A}\n")  # revoke B
    frontend.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 60
    while httpx.post(url, json=chat_body(stack), headers=auth(KEY_B), timeout=60).status_code != 401:
        assert time.monotonic() < deadline, "key B still accepted after SIGHUP"
        time.sleep(0.2)
    assert httpx.post(url, json=chat_body(stack), headers=auth(KEY_A), timeout=60).status_code == 200
    assert httpx.post(url, json=chat_body(stack), headers=auth(KEY_ENV), timeout=60).status_code == 200
    assert frontend.process.poll() is None
    log = frontend.log.read_text()
    for key in (KEY_A, KEY_B, KEY_ENV):
        assert key not in log, "an API key was logged"
    assert "API keys reloaded" in log


# ----- limits ---------------------------------------------------------------------------------------------
def test_body_size_and_prompt_token_limits_answer_before_triton(stack: Stack, secured) -> None:
    frontend, _ = secured
    url = f"{frontend.root}/v1/completions"
    big = {"model": stack.model, "prompt": "x" * 30000, "max_tokens": 1}
    assert_error(httpx.post(url, json=big, headers=auth(KEY_A), timeout=60), 413, "request_too_large")

    async def chunked() -> httpx.Response:  # no Content-Length: counted while read
        async def parts():
            yield b'{"model": "demo-tiny", "prompt": "'
            for _ in range(30):
                yield b"y" * 1000
            yield b'"}'

        async with httpx.AsyncClient(timeout=60) as client:
            return await client.post(url, content=parts(), headers={**auth(KEY_A), "Content-Type": "application/json"})

    assert_error(asyncio.run(chunked()), 413, "request_too_large")
    long_prompt = {"model": stack.model, "prompt": "hello " * 300, "max_tokens": 1}
    error = assert_error(httpx.post(url, json=long_prompt, headers=auth(KEY_A), timeout=60), 400, "prompt_too_long")
    assert error["param"] == "prompt" and "100" in error["message"]
    assert httpx.post(url, json={**long_prompt, "prompt": "hello"}, headers=auth(KEY_A), timeout=60).status_code == 200


async def test_overload_64_streams_against_8_in_flight_and_8_queued(stack: Stack, slow_secured: Frontend) -> None:
    frontend = slow_secured
    url = f"{frontend.root}/v1/completions"
    # 40 tokens on the slow engine: >= 2 s a stream, so the 64 arrive while the first 16 hold every place
    body = {"model": stack.model, "prompt": "count with me", "max_tokens": 40, "ignore_eos": True, "stream": True}

    async def one(client: httpx.AsyncClient) -> tuple[str, int]:
        async with client.stream("POST", url, json=body, headers=auth(KEY_A)) as response:
            raw = (await response.aread()).decode()
            if response.status_code == 429:
                assert int(response.headers["Retry-After"]) >= 1
                assert json.loads(raw)["error"]["code"] == "overloaded"
                return "429", 429
            assert response.status_code == 200, raw
            payloads = sse_payloads(raw)
            assert payloads[-1] == "[DONE]" and not any("error" in json.loads(p) for p in payloads[:-1]), raw[-500:]
            finishes = [json.loads(p)["choices"][0].get("finish_reason") for p in payloads[:-1]
                        if json.loads(p).get("choices")]
            assert finishes[-1] == "length"
            return "complete", 200

    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        started = time.monotonic()
        outcomes = await asyncio.wait_for(asyncio.gather(*(one(client) for _ in range(64))), 240)
        took = time.monotonic() - started
        counts = {kind: sum(1 for k, _ in outcomes if k == kind) for kind in ("complete", "429")}
        print(f"\noverload: 64 streams vs 8 in flight + 8 queued -> {counts['complete']} complete, "
              f"{counts['429']} x 429 with Retry-After, 0 other, in {took:.1f} s")
        assert counts["complete"] + counts["429"] == 64
        assert counts["complete"] >= 16 and counts["429"] >= 1
    # and it serves normally afterwards: new connections (the pool's idle ones may be past uvicorn's keep-alive
    # timeout, and a connection the server closes as the client reuses it is a ReadError, not an answer)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        again = await asyncio.gather(*(one(client) for _ in range(8)))
        assert all(kind == "complete" for kind, _ in again)
    # every place given back (released after each stream's last byte, which the client may see first)
    metrics = await asyncio.to_thread(
        metrics_when, frontend.root, lambda text: "tritonllm_requests_in_flight 0.0" in text
        and "tritonllm_requests_queued 0.0" in text, "tritonllm_requests_in_flight and _queued at 0")
    assert re.search(r'tritonllm_requests_rejected_total\{reason="queue_full"\} [1-9]', metrics)


def test_rate_limits_per_key_requests_and_tokens_per_minute(stack: Stack, tmp_path: Path) -> None:
    frontend = launch(stack, tmp_path / "frontend.log", API_KEYS=f"{KEY_A},{KEY_B}", RATE_LIMIT_RPM="3",
                      RATE_LIMIT_TPM="400", METRICS_REQUIRE_KEY="true")
    url = f"{frontend.root}/v1/completions"
    body = {"model": stack.model, "prompt": "hello", "max_tokens": 4}
    try:
        assert_error(httpx.get(f"{frontend.root}/metrics", timeout=10), 401, "invalid_api_key")
        assert httpx.get(f"{frontend.root}/metrics", headers=auth(KEY_B), timeout=10).status_code == 200
        for _ in range(3):
            assert httpx.post(url, json=body, headers=auth(KEY_A), timeout=60).status_code == 200
        limited = httpx.post(url, json=body, headers=auth(KEY_A), timeout=60)
        error = assert_error(limited, 429, "rate_limit_exceeded")
        assert error["type"] == "requests" and int(limited.headers["Retry-After"]) >= 1
        # the tokenizer helpers do work too: they count against the same budget
        tokenize = httpx.post(f"{frontend.root}/tokenize", json={"prompt": "hello"}, headers=auth(KEY_A), timeout=60)
        assert assert_error(tokenize, 429, "rate_limit_exceeded")["type"] == "requests"
        # key B has its own budget; a request that can never fit the token budget is refused
        too_big = httpx.post(url, json={**body, "max_tokens": 450}, headers=auth(KEY_B), timeout=60)
        assert assert_error(too_big, 400, "tokens_per_minute_exceeded")["param"] == "max_tokens"  # never a retry
        # 300 reserved (prompt + max_tokens) and all of it used (ignore_eos): a second 300 does not fit
        full = {**body, "max_tokens": 298, "ignore_eos": True}
        assert httpx.post(url, json=full, timeout=60, headers=auth(KEY_B)).status_code == 200
        assert httpx.post(url, json=full, timeout=60, headers=auth(KEY_B)).status_code == 429
    finally:
        stop_process(frontend.process)


# ----- deadlines ------------------------------------------------------------------------------------------
def test_request_timeout_header_cancels_the_triton_request(stack: Stack, slow_secured: Frontend) -> None:
    frontend = slow_secured
    url = f"{frontend.root}/v1/completions"
    # 450 tokens on the slow engine take >= 22.5 s: only the 0.5 s deadline can end these requests sooner
    body = {"model": stack.model, "prompt": "go on", "max_tokens": 450, "ignore_eos": True}
    headers = {**auth(KEY_A), "X-Request-Timeout": "0.5"}
    before = engine_settled(stack.triton_metrics_url, SLOW_MODEL)
    started = time.monotonic()
    response = httpx.post(url, json=body, headers=headers, timeout=60)
    assert time.monotonic() - started < 15  # generous for a 0.5 s deadline, and far from the request's end
    error = assert_error(response, 504, "timeout")
    assert "0.5" in error["message"]
    started = time.monotonic()
    streamed = httpx.post(url, json={**body, "stream": True}, headers=headers, timeout=60)
    assert time.monotonic() - started < 15 and streamed.status_code == 200
    payloads = sse_payloads(streamed.text)
    assert payloads[-1] == "[DONE]" and json.loads(payloads[-2])["error"]["code"] == "timeout"
    assert_error(httpx.post(url, json=body, headers={**auth(KEY_A), "X-Request-Timeout": "soon"}, timeout=60),
                 400, None)
    # the engine let go of both requests (it says they were cancelled): no slot stays busy
    wait_engine(stack.triton_metrics_url, SLOW_MODEL,
                lambda now: now["cancelled_requests_total"] == before["cancelled_requests_total"] + 2,
                "both timed-out requests to be cancelled")
    wait_engine(stack.triton_metrics_url, SLOW_MODEL,
                lambda now: now["active_slots"] == 0 and now["queued_requests"] == 0, "no slot to stay busy")


# ----- observability --------------------------------------------------------------------------------------
def test_metrics_and_one_json_access_log_line_per_request_without_text(stack: Stack, secured) -> None:
    frontend, _ = secured
    secret_prompt = "my-secret-prompt-text-42"
    assert_error(httpx.post(f"{frontend.root}/v1/chat/completions", json=chat_body(stack), timeout=60), 401,
                 "invalid_api_key")  # counted below, whatever ran before
    response = httpx.post(f"{frontend.root}/v1/chat/completions", headers={**auth(KEY_A), "X-Request-Id": "rid-obs-1"},
                          json=chat_body(stack, messages=[{"role": "user", "content": secret_prompt}], max_tokens=5,
                                         stream=True, ignore_eos=True), timeout=60)
    assert response.status_code == 200
    families = ("tritonllm_time_to_first_token_seconds_bucket", "tritonllm_inter_token_latency_seconds_bucket",
                "tritonllm_request_duration_seconds_bucket", "tritonllm_request_queue_time_seconds_bucket",
                "tritonllm_prompt_tokens_total", "tritonllm_completion_tokens_total",
                "tritonllm_requests_in_flight", "tritonllm_requests_queued")
    counted = (r'tritonllm_requests_total\{finish_reason="length",model="demo-tiny",'
               r'route="/v1/chat/completions",status="200",version=""\}',
               r'tritonllm_requests_total\{finish_reason="none",model="",route="/v1/chat/completions",'
               r'status="401",version=""\}')
    # a request is counted after its last byte went out, which the client may see first
    metrics = metrics_when(frontend.root, lambda text: all(re.search(c, text) for c in counted),
                           "count of both requests")
    for family in families:
        assert family in metrics, family
    deadline = time.monotonic() + 60
    while not [r for r in frontend.access_records() if r["request_id"] == "rid-obs-1"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    (record,) = [r for r in frontend.access_records() if r["request_id"] == "rid-obs-1"]
    assert record["route"] == "/v1/chat/completions" and record["status"] == 200
    assert record["completion_tokens"] == 5 and record["prompt_tokens"] > 0 and record["finish_reason"] == "length"
    assert record["ttft_s"] > 0 and record["duration_s"] >= record["ttft_s"] and record["queue_s"] >= 0
    assert len(record["key_id"]) == 12
    assert secret_prompt not in frontend.log.read_text()


# ----- TLS ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed_certificate(tmp_path_factory.mktemp("tls"))


def test_https_and_the_launcher_probe_use_tls(stack: Stack, tmp_path: Path, certificate, monkeypatch) -> None:
    cert, key = certificate
    frontend = launch(stack, tmp_path / "frontend.log", scheme="https", SSL_CERTFILE=str(cert), SSL_KEYFILE=str(key))
    try:
        response = httpx.post(f"{frontend.root}/v1/chat/completions", json=chat_body(stack), verify=False, timeout=60)
        assert response.status_code == 200
        with pytest.raises(httpx.HTTPError):  # plain http is not served
            httpx.get(frontend.root.replace("https", "http") + "/health/live", timeout=5)
        monkeypatch.setenv("SSL_CERTFILE", str(cert))
        monkeypatch.setenv("SSL_KEYFILE", str(key))
        monkeypatch.setenv("FRONTEND_PORT", frontend.root.rsplit(":", 1)[1])
        monkeypatch.delenv("API_KEYS", raising=False)
        monkeypatch.delenv("API_KEYS_FILE", raising=False)
        cfg = load_config(build_parser().parse_args(["serve"]))
        assert cfg.frontend_base == frontend.root
        answer = http_get(f"{cfg.frontend_base}/health/ready")
        assert answer is not None and answer[0] == 200
        assert served_model_id(cfg) == stack.model
        assert "https://" in banner(cfg, stack.model)
    finally:
        stop_process(frontend.process)


# ----- graceful shutdown ----------------------------------------------------------------------------------
async def test_sigterm_drains_then_cancels_streams_with_an_error_event(stack: Stack, tmp_path: Path) -> None:
    # The slow test engine takes >= 50 ms a step: 450 tokens cannot finish within the 3 s grace on any machine.
    frontend = launch(stack, tmp_path / "frontend.log", SHUTDOWN_GRACE_S="3", ENGINE_MODEL=SLOW_MODEL)
    url = f"{frontend.root}/v1/completions"
    short = {"model": stack.model, "prompt": "short", "max_tokens": 8, "ignore_eos": True, "stream": True}
    long = {**short, "prompt": "long", "max_tokens": 450}

    try:
        async with httpx.AsyncClient(timeout=60) as client:
            events = [asyncio.Event() for _ in range(2)]
            long_streams = [asyncio.create_task(read_stream(client, url, long, e)) for e in events]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
            frontend.process.send_signal(signal.SIGTERM)
            term = time.monotonic()
            # not ready any more while the streams still drain (they can only end by the grace's end)
            while (await client.get(f"{frontend.root}/health/ready")).status_code != 503:
                assert not any(s.done() for s in long_streams), "still ready after SIGTERM when the grace ended"
                await asyncio.sleep(0.05)
            refused = await client.post(url, json={**short, "stream": False})
            assert_error(refused, 503, "service_unavailable")
            results = await asyncio.wait_for(asyncio.gather(*long_streams), 60)
        for payloads, ended in results:
            # held for the grace, then cut: an error event, long before the >= 22.5 s they would have taken
            assert 2.5 < ended - term < 20
            assert payloads[-1] == "[DONE]"
            assert json.loads(payloads[-2])["error"]["code"] == "service_unavailable"
        frontend.process.wait(60)
    finally:
        stop_process(frontend.process)


async def test_sigterm_lets_short_streams_finish(stack: Stack, tmp_path: Path) -> None:
    # 40 tokens on the slow engine: >= 2 s, so the streams are mid-way at SIGTERM, well within the grace.
    frontend = launch(stack, tmp_path / "frontend.log", SHUTDOWN_GRACE_S="120", ENGINE_MODEL=SLOW_MODEL)
    body = {"model": stack.model, "prompt": "short", "max_tokens": 40, "ignore_eos": True, "stream": True}
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            events = [asyncio.Event() for _ in range(3)]
            streams = [asyncio.create_task(read_stream(client, f"{frontend.root}/v1/completions", body, e))
                       for e in events]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)  # each has its first token
            frontend.process.send_signal(signal.SIGTERM)
            results = await asyncio.wait_for(asyncio.gather(*streams), 60)
        for payloads, _ in results:
            assert payloads[-1] == "[DONE]" and not any("error" in json.loads(p) for p in payloads[:-1])
            assert json.loads(payloads[-2])["choices"][0]["finish_reason"] == "length"
        frontend.process.wait(60)  # exits long before the 120 s grace: it waited for nothing left in flight
    finally:
        stop_process(frontend.process)
