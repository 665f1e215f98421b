"""A self-healing `make serve`: the real launcher (`python -m launcher serve`) with tritonserver killed
under it.

One launcher, MAX_RESTARTS_PER_MINUTE=2, serving a slow test copy of the engine (>= 50 ms a step, so the
streams are still running when Triton dies on any machine):

1. twice: `kill -9` of tritonserver's process group while 3 streams run; the streams end with an error
   event then `[DONE]`, /health/ready is 503, and a completion is answered 200 again (within RECOVERY_S), with the
   same frontend and a new tritonserver;
2. `kill -9` of the frontend's group: a new frontend serves again, Triton untouched;
3. a burst: every new tritonserver is killed as soon as it appears, until the launcher gives up; it must
   do so within 3 kills (the budget is 2, and the round-1 restarts may still count), exit 1 with a message
   naming the setting, Triton's log tail, and leave nothing running.

A second launcher (default budget, API_KEYS_FILE) checks what must not change: SIGHUP reaches the frontend
the launcher runs now (one restarted after a kill), and SIGTERM while Triton is being restarted exits 0
with nothing left behind.

Processes are found through /proc (the launcher's children), never through log timing.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from launcher.ports import find_free_port
from launcher.tritonserver import group_alive
from tests.integration.conftest import read_stream
from tests.integration.engine_knobs import add_knob_model

# Each test starts a launcher and has Triton restart (and reload its model) several times: more than the suite's
# 300 s per test on a busy machine.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

REPO_ROOT = Path(__file__).resolve().parents[2]
SLOW = "tensorrt_llm_supervised_slow"  # its own name: this test's repository only
MAX_RESTARTS = 2
STREAMS = 3
RECOVERY_S = 120.0  # a hang guard: a restart reloads the engine model, which takes longer on a busy machine


# ----- processes under the launcher ---------------------------------------------------------------------
def _children(parent: int) -> dict[int, str]:
    """Live (non-zombie) children of `parent`: pid -> command line."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'.
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        if int(ppid) == parent and state != "Z":
            found[int(entry.name)] = cmdline
    return found


def _child_pid(launcher: subprocess.Popen[bytes], marker: str, not_in: set[int], timeout_s: float) -> int | None:
    """The launcher's child whose command line contains `marker` and that is none of `not_in` (waiting
    for it to appear); None if the launcher exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        for pid, cmdline in _children(launcher.pid).items():
            if marker in cmdline and pid not in not_in:
                return pid
        if launcher.poll() is not None:
            return None
        assert time.monotonic() < deadline, f"no new {marker!r} child of the launcher after {timeout_s} s"
        time.sleep(0.05)


TRITON, FRONTEND = "tritonserver --model-repository", "-m frontend"  # in their command lines


async def wait_status(client: httpx.AsyncClient, method: str, url: str, status: int, timeout_s: float,
                      launcher: subprocess.Popen[bytes], **kwargs: object) -> httpx.Response:
    """Poll until `url` answers `status` (connection errors are 'not yet'), while the launcher lives."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        assert launcher.poll() is None, f"launcher exited with {launcher.returncode}"
        try:
            response = await client.request(method, url, **kwargs)  # type: ignore[arg-type]
            if response.status_code == status:
                return response
            last = response.text
        except httpx.HTTPError as exc:
            last = exc
        assert time.monotonic() < deadline, f"{url} not {status} after {timeout_s} s: {last!r}"
        await asyncio.sleep(0.2)


# ----- the launcher under test --------------------------------------------------------------------------
class Launcher:
    """`python -m launcher serve` on free ports, its output in a file; stop() leaves nothing running."""

    def __init__(self, built_engine: Path, repository: Path, work: Path, **env: str) -> None:
        ports = {"FRONTEND_PORT": 0, "TRITON_HTTP_PORT": 0, "TRITON_GRPC_PORT": 0, "TRITON_METRICS_PORT": 0}
        while len(set(ports.values())) < len(ports):
            ports = {name: find_free_port() for name in ports}
        environment = {**os.environ, **{k: str(v) for k, v in ports.items()}, "FRONTEND_HOST": "127.0.0.1",
                       "ENGINE_MODEL": SLOW, "TOKENIZER_DIR": str(built_engine / "checkpoints" / "demo-tiny"),
                       "SHUTDOWN_GRACE_S": "5", "PYTHONUNBUFFERED": "1"}
        for name in ("API_KEYS", "API_KEYS_FILE", "SSL_CERTFILE", "SSL_KEYFILE", "MAX_RESTARTS_PER_MINUTE"):
            environment.pop(name, None)
        environment.update(env)
        self.environment = environment
        self.root = f"http://127.0.0.1:{ports['FRONTEND_PORT']}"
        self.shm_prefix = f"prefix{ports['TRITON_GRPC_PORT']}_"  # Triton's Python-backend regions
        self.output = work / "launcher.log"
        self.groups: set[int] = set()  # every tritonserver / frontend process group seen, for stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "launcher", "serve", "--model-repository", str(repository),
             "--work-dir", str(work / "work")],
            cwd=REPO_ROOT, env=environment, stdin=subprocess.DEVNULL, stdout=self.output.open("wb"),
            stderr=subprocess.STDOUT, start_new_session=True)

    def shm_regions(self) -> list[str]:
        """Shared-memory regions of this launcher's tritonservers still in /dev/shm."""
        return [p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(self.shm_prefix)]

    def log(self) -> str:
        return self.output.read_text(errors="replace")

    def survivors(self) -> dict[int, list[str]]:
        """The recorded process groups still alive: pgid -> "pid state command" of each member."""
        members: dict[int, list[str]] = {pgid: [] for pgid in self.groups if group_alive(pgid)}
        for entry in Path("/proc").iterdir():
            try:
                stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
            except OSError:
                continue
            if stat:
                state, _ppid, pgid = stat[stat.rindex(")") + 2:].split()[:3]
                if int(pgid) in members:
                    members[int(pgid)].append(f"{entry.name} {state} {stat[stat.index('(') + 1:stat.rindex(')')]}")
        return members

    async def wait_for_line(self, text: str, timeout_s: float) -> None:
        """Until the launcher has printed `text` (its own lines mark where supervision stands)."""
        deadline = time.monotonic() + timeout_s
        while text not in self.log():
            assert self.process.poll() is None, f"launcher exited with {self.process.returncode}"
            assert time.monotonic() < deadline, f"no {text!r} from the launcher after {timeout_s} s"
            await asyncio.sleep(0.1)

    async def wait_serving(self) -> None:
        # The banner's last line: from here on the launcher supervises (before it, any death is fatal).
        await self.wait_for_line("Press Ctrl+C to stop", 300)

    def child(self, marker: str, not_in: set[int] | None = None, timeout_s: float = 60) -> int:
        """A live child of the launcher, recorded for stop(); fails if the launcher has exited."""
        pid = _child_pid(self.process, marker, not_in or set(), timeout_s)
        assert pid is not None, f"launcher exited with {self.process.returncode}"
        self.groups.add(pid)
        return pid

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        for pgid in self.groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture()
def repository(built_engine: Path, tmp_path: Path) -> Path:
    """A repository holding only the slow engine copy (ENGINE_MODEL; the frontend gets TOKENIZER_DIR):
    one model loads in a fraction of the full repository's time, and these tests restart Triton often."""
    repo = tmp_path / "model_repository"
    shutil.copytree(built_engine / "model_repository" / "tensorrt_llm", repo / "tensorrt_llm")
    add_knob_model(repo, SLOW, test_step_delay_s=0.05)  # 450 tokens take >= 22 s
    shutil.rmtree(repo / "tensorrt_llm")
    return repo


# ----- the tests ----------------------------------------------------------------------------------------
async def test_launcher_restarts_what_dies_and_gives_up_past_its_budget(
        built_engine: Path, repository: Path, tmp_path: Path) -> None:
    launcher = Launcher(built_engine, repository, tmp_path, MAX_RESTARTS_PER_MINUTE=str(MAX_RESTARTS))
    root, log = launcher.root, launcher.log
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            await launcher.wait_serving()
            await wait_status(client, "GET", f"{root}/health/ready", 200, 60, launcher.process)
            first_frontend = launcher.child(FRONTEND)
            model = (await client.get(f"{root}/v1/models")).json()["data"][0]["id"]
            stream_body = {"model": model, "prompt": "keep going", "max_tokens": 450, "ignore_eos": True,
                           "stream": True}
            short_body = {**stream_body, "stream": False, "max_tokens": 2}
            killed: set[int] = set()

            # 1. Triton killed under load, twice: streams end properly, the frontend serves again.
            for round_ in (1, 2):
                victim = launcher.child(TRITON, killed)
                events = [asyncio.Event() for _ in range(STREAMS)]
                streams = [asyncio.create_task(read_stream(client, f"{root}/v1/completions", stream_body, e,
                                                           started_after=3))
                           for e in events]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
                os.killpg(victim, signal.SIGKILL)
                killed.add(victim)
                kill_time = time.monotonic()
                for payloads, _ in await asyncio.wait_for(asyncio.gather(*streams), 60):
                    assert payloads[-1] == "[DONE]"
                    assert json.loads(payloads[-2])["error"]["code"] == "service_unavailable"
                await wait_status(client, "GET", f"{root}/health/ready", 503, 60, launcher.process)
                response = await wait_status(client, "POST", f"{root}/v1/completions", 200,
                                             RECOVERY_S - (time.monotonic() - kill_time), launcher.process,
                                             json=short_body)
                assert response.json()["usage"]["completion_tokens"] == 2
                assert launcher.child(FRONTEND) == first_frontend  # the frontend stayed up
                assert (f"launcher: tritonserver (pid {victim}) was killed by SIGKILL (code -9); restart {round_} in"
                        in log())

            # 2. The frontend killed: a new one serves, Triton untouched.
            current_triton = launcher.child(TRITON, killed)
            os.killpg(first_frontend, signal.SIGKILL)
            launcher.child(FRONTEND, {first_frontend})
            await wait_status(client, "POST", f"{root}/v1/completions", 200, RECOVERY_S, launcher.process,
                              json=short_body)
            assert launcher.child(TRITON, killed) == current_triton
            assert f"launcher: frontend (pid {first_frontend}) was killed by SIGKILL (code -9); restart 1 in" in log()

        # 3. A burst of Triton deaths past the budget: the launcher gives up. Each kill lands as soon as the
        # next tritonserver appears (the back-off is all the wait); the round-1 restarts may still count.
        burst = 0
        while (victim := _child_pid(launcher.process, TRITON, killed, timeout_s=60)) is not None:
            launcher.groups.add(victim)
            os.killpg(victim, signal.SIGKILL)
            killed.add(victim)
            burst += 1
            assert burst <= MAX_RESTARTS + 1, f"still restarting after {burst} kills"
        launcher.process.wait(60)
        text = log()
        assert launcher.process.returncode == 1
        assert "error: tritonserver (pid" in text and "was killed by SIGKILL (code -9)" in text
        assert f"(MAX_RESTARTS_PER_MINUTE={MAX_RESTARTS}); giving up" in text
        assert "--- end of log ---" in text  # Triton's log tail came with it
        assert not launcher.survivors(), f"process groups outlived the launcher: {launcher.survivors()}"
        assert not launcher.shm_regions(), "killed tritonservers' shared memory left behind"
    except BaseException:
        print(f"----- launcher output ({launcher.output}) -----\n{log()[-30000:]}")  # shown with the failure
        raise
    finally:
        launcher.stop()


async def test_sighup_reaches_a_restarted_frontend_and_sigterm_stops_everything_mid_restart(
        built_engine: Path, repository: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("first-key\n")
    launcher = Launcher(built_engine, repository, tmp_path, API_KEYS_FILE=str(keys))
    root = launcher.root
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            await launcher.wait_serving()
            first_frontend = launcher.child(FRONTEND)
            os.killpg(first_frontend, signal.SIGKILL)
            second_frontend = launcher.child(FRONTEND, {first_frontend})
            await wait_status(client, "GET", f"{root}/v1/models", 200, RECOVERY_S, launcher.process,
                              headers={"Authorization": "Bearer first-key"})

            # SIGHUP to the launcher goes to the frontend it runs now: the new key works, the old one not.
            keys.write_text("second-key\n")
            launcher.process.send_signal(signal.SIGHUP)
            await wait_status(client, "GET", f"{root}/v1/models", 200, 60, launcher.process,
                              headers={"Authorization": "Bearer second-key"})
            assert (await client.get(f"{root}/v1/models",
                                     headers={"Authorization": "Bearer first-key"})).status_code == 401
            assert launcher.child(FRONTEND) == second_frontend

            # SIGTERM while Triton is being restarted: exit 0, frontend and the loading Triton both gone.
            victim = launcher.child(TRITON)
            os.killpg(victim, signal.SIGKILL)
            await launcher.wait_for_line("launcher: tritonserver restarted", 60)
            launcher.child(TRITON, {victim})
        launcher.process.send_signal(signal.SIGTERM)
        assert launcher.process.wait(60) == 0
        assert "Shutting down ..." in launcher.log()
        assert not launcher.survivors(), f"process groups outlived the launcher: {launcher.survivors()}"
        assert not launcher.shm_regions(), "killed tritonservers' shared memory left behind"
    except BaseException:
        print(f"----- launcher output ({launcher.output}) -----\n{launcher.log()[-30000:]}")
        raise
    finally:
        launcher.stop()
