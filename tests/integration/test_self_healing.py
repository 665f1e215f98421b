"""A `make serve` that heals what a live process cannot show, and whose Triton takes orders only from it.

The real launcher (`python -m launcher serve`) over the slow test copy of the engine (>= 50 ms a step, so
streams are still running when the engine dies, on any machine):

1. Triton's control API without the launch's key: a raw unload and a raw load, over HTTP and over gRPC,
   are refused, and the model is still ready.
2. The engine model's Python-backend stub killed with SIGKILL (what the OOM killer does) under 4 streams:
   each stream ends with an error event and `[DONE]` within STREAM_END_S, and the stack answers again
   within RECOVER_S with nobody acting (the launcher restarts Triton: launcher/engine_health.py says why
   a reload cannot).
3. The engine model unloaded behind the frontend's back (the end state of an engine-thread crash, which
   unloads the model itself): the launcher loads it again, and the stack answers within RECOVER_S. With two
   frontend workers, Triton's log shows exactly one load of it (review finding 8: one owner per repair).
   The load alone (the stub's start) took 18 s of the 24 s on a machine with load average 15.

The bounds are what the issue asks of the product; the engine's step delay makes the streams outlive them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import tritonclient.grpc as grpcclient

from tests.integration.conftest import Stack, read_stream
from tests.integration.test_supervision import (SLOW, TRITON, Launcher, _children, repository,  # noqa: F401
                                                wait_status)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

STREAMS = 4
STREAM_END_S = 10.0
RECOVER_S = 60.0


def stub_pid(triton_pid: int, model: str) -> int | None:
    """The Python-backend stub process of `model`'s first instance (a child of tritonserver)."""
    for pid, cmdline in _children(triton_pid).items():
        if "triton_python_backend_stub" in cmdline and f" {model}_0_0 " in f"{cmdline} ":
            return pid
    return None


async def test_control_api_needs_the_key_and_the_engine_heals_from_a_dead_stub_and_an_unload(
        built_engine: Path, repository: Path, tmp_path: Path) -> None:  # noqa: F811
    launcher = Launcher(built_engine, repository, tmp_path, ENGINE_UNHEALTHY_S="5", FRONTEND_WORKERS="2")
    root = launcher.root
    env = launcher.environment
    triton_http = f"http://127.0.0.1:{env['TRITON_HTTP_PORT']}"
    triton_grpc = f"127.0.0.1:{env['TRITON_GRPC_PORT']}"
    key_file = tmp_path / "work" / "triton_control_key"
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            await launcher.wait_serving()
            model = (await client.get(f"{root}/v1/models")).json()["data"][0]["id"]
            short_body = {"model": model, "prompt": "hello", "max_tokens": 2, "ignore_eos": True}

            # 1. No key, no control: over HTTP and gRPC, unload and load are refused; the model stays ready.
            assert key_file.stat().st_mode & 0o777 == 0o600
            for action in ("unload", "load"):
                refused = await client.post(f"{triton_http}/v2/repository/models/{SLOW}/{action}")
                assert refused.status_code == 403, refused.text
                assert "restricted" in refused.text
            grpc_client = grpcclient.InferenceServerClient(triton_grpc)
            try:
                for action in (grpc_client.unload_model, grpc_client.load_model):
                    with pytest.raises(Exception, match="restricted"):
                        action(SLOW)
                with pytest.raises(Exception, match="restricted"):
                    grpc_client.get_model_repository_index()
                assert grpc_client.is_model_ready(SLOW)
            finally:
                grpc_client.close()
            assert (await client.get(f"{triton_http}/v2/models/{SLOW}/ready")).status_code == 200
            assert (await client.post(f"{root}/v1/completions", json=short_body)).status_code == 200

            # 2. The stub killed under 4 streams: the streams end at once, the stack comes back by itself.
            triton = launcher.child(TRITON)
            stub = stub_pid(triton, SLOW)
            assert stub is not None, _children(triton)
            stream_body = {**short_body, "prompt": "keep going", "max_tokens": 450, "stream": True}
            events = [asyncio.Event() for _ in range(STREAMS)]
            streams = [asyncio.create_task(read_stream(client, f"{root}/v1/completions", stream_body, e,
                                                       started_after=3)) for e in events]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
            os.kill(stub, signal.SIGKILL)
            killed_at = time.monotonic()
            for payloads, ended_at in await asyncio.wait_for(asyncio.gather(*streams), 60):
                assert payloads[-1] == "[DONE]"
                assert json.loads(payloads[-2])["error"]["code"] == "service_unavailable", payloads[-2]
                assert ended_at - killed_at < STREAM_END_S, f"a stream ended {ended_at - killed_at:.1f} s after"
            answer = await wait_status(client, "POST", f"{root}/v1/completions", 200,
                                       RECOVER_S - (time.monotonic() - killed_at), launcher.process, json=short_body)
            assert answer.json()["usage"]["completion_tokens"] == 2
            print(f"\nstub killed: streams ended, stack answering again {time.monotonic() - killed_at:.1f} s after")
            # The launcher restarted Triton: after its health probe found the stub dead ("does not serve: ...
            # is not healthy"), or because tritonserver aborted by itself (it sometimes does when a stub dies).
            assert "launcher: tritonserver restarted" in launcher.log()
            # The Triton with the dead stub was SIGKILLed a few seconds after SIGTERM, not left to wait out its
            # 30 s exit timeout on an unload that never ends (the restart waited for it).
            assert "Exit timeout expired" not in (tmp_path / "work" / "logs" / "tritonserver.log.1").read_text()

            # 3. The model unloaded behind the frontend's back (as a crashed engine unloads itself): reloaded.
            restarted = launcher.child(TRITON, {triton})
            triton_log = tmp_path / "work" / "logs" / "tritonserver.log"
            loads_before = triton_log.read_text().count(f"loading: {SLOW}:")
            key = key_file.read_text().strip()
            unloaded = await client.post(f"{triton_http}/v2/repository/models/{SLOW}/unload",
                                         headers={"triton-control-key": key})
            assert unloaded.status_code == 200, unloaded.text
            unloaded_at = time.monotonic()
            await wait_status(client, "GET", f"{root}/health/ready", 503, 60, launcher.process)
            answer = await wait_status(client, "POST", f"{root}/v1/completions", 200,
                                       RECOVER_S - (time.monotonic() - unloaded_at), launcher.process,
                                       json=short_body)
            assert answer.json()["usage"]["completion_tokens"] == 2
            print(f"model unloaded: stack answering again {time.monotonic() - unloaded_at:.1f} s after")
            await wait_status(client, "GET", f"{root}/health/ready", 200, 60, launcher.process)
            assert f"reloading {SLOW}" in launcher.log() and "serves again" in launcher.log()
            assert triton_log.read_text().count(f"loading: {SLOW}:") - loads_before == 1, triton_log.read_text()[-5000:]
            assert launcher.child(TRITON, {triton}) == restarted  # reloaded in place, not restarted
    except BaseException:
        print(f"----- launcher output ({launcher.output}) -----\n{launcher.log()[-30000:]}")
        raise
    finally:
        launcher.stop()


def test_the_liveness_probe_passes_a_serving_engine_and_fails_a_model_that_is_not_loaded(stack: Stack) -> None:
    """`python -m launcher.engine_health`, the CPU pod's Triton liveness probe, against the session's Triton."""
    port = stack.triton_grpc_url.rsplit(":", 1)[1]

    def probe(model: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "launcher.engine_health"], capture_output=True, text=True,
                              env={**os.environ, "TRITON_GRPC_PORT": port, "ENGINE_MODEL": model}, timeout=120)

    assert probe("tensorrt_llm").returncode == 0
    gone = probe("tensorrt_llm_never_loaded")
    assert gone.returncode == 1 and "not ready" in gone.stderr
