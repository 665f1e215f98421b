"""launcher: port checks, locating tritonserver, one real tritonserver on a trivial Python model, the
supervision logic (restart budget, back-off, which process died) on scripted processes and a fake clock, and
launcher.mpi's command across hosts (hosts, remote launch agent, forwarded environment).

The real-server tests use the nvidia-pytriton wheel's tritonserver (CPU only); they take a few seconds.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import urllib.request
from pathlib import Path

import pytest

from tritonclient.utils import InferenceServerException

import launcher.mpi as launcher_mpi
from launcher import engine_health
from launcher.__main__ import build_parser
from launcher.config import LaunchError, load_config
from launcher.engine_health import EngineHealth, Problem
from launcher.ports import PortInUseError, check_ports_free, find_free_port
from launcher.processes import rotate_log
from launcher.supervise import RestartBudget, RestartBudgetExceeded, Supervisor, describe_exit
from launcher.tritonserver import (STACK_DUMP_SIGNAL, TritonServer, TritonStartError, catches_signal,
                                  find_tritonserver, group_alive, group_members, remove_shm_regions)

IDENTITY_CONFIG = """\
name: "identity"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

IDENTITY_MODEL = textwrap.dedent("""\
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            responses = []
            for request in requests:
                data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
                out = pb_utils.Tensor("OUTPUT0", data)
                responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
            return responses
""")


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shared so the backend dir (a few MB) is assembled once per module."""
    return tmp_path_factory.mktemp("launcher_work")


def _free_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(find_free_port())
    return sorted(ports)


def _server(repo: Path, work_dir: Path, tmp_path: Path) -> TritonServer:
    http, grpc, metrics = _free_ports(3)
    return TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics,
                        log_file=tmp_path / "logs" / "tritonserver.log", work_dir=work_dir, model_name="identity")


def _identity_repo(root: Path, config: str = IDENTITY_CONFIG) -> Path:
    model_dir = root / "identity"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(config)
    (model_dir / "1" / "model.py").write_text(IDENTITY_MODEL)
    return root


# ----- ports --------------------------------------------------------------------------------------------
def test_check_ports_free_names_the_env_var_of_a_taken_port() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        taken = held.getsockname()[1]
        free = find_free_port()
        with pytest.raises(PortInUseError) as info:
            check_ports_free({"TRITON_HTTP_PORT": free, "TRITON_GRPC_PORT": taken})
    message = str(info.value)
    assert f"port {taken} (TRITON_GRPC_PORT) is already in use" in message
    assert "set TRITON_GRPC_PORT to a free port" in message
    assert info.value.env_var == "TRITON_GRPC_PORT" and info.value.port == taken


def test_check_ports_free_passes_when_all_free() -> None:
    check_ports_free({"A": find_free_port(), "B": find_free_port()})


# ----- locating tritonserver ----------------------------------------------------------------------------
def test_find_tritonserver_gives_runnable_binary_and_python_backend(work_dir: Path) -> None:
    install = find_tritonserver(work_dir)
    assert install.binary.is_file() and os.access(install.binary, os.X_OK)
    python_dir = install.backend_dir / "python"
    assert (python_dir / "libtriton_python.so").is_file()
    stub = python_dir / "triton_python_backend_stub"
    assert stub.is_file() and os.access(stub, os.X_OK)
    # Second call reuses the copies (same size) and gives the same answer.
    assert find_tritonserver(work_dir) == install


def test_command_binds_loopback_with_given_ports(work_dir: Path, tmp_path: Path) -> None:
    server = TritonServer(tmp_path / "repo", http_port=18000, grpc_port=18001, metrics_port=18002,
                          log_file=tmp_path / "t.log", work_dir=work_dir, extra_args=["--log-info=true"])
    argv = server.command()
    for flag in ("--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1",
                 "--http-port=18000", "--grpc-port=18001", "--metrics-port=18002",
                 f"--model-repository={tmp_path / 'repo'}", "--disable-auto-complete-config",
                 "--backend-config=python,shm-region-prefix-name=prefix18001_", "--exit-on-error=true"):
        assert flag in argv
    assert argv[-1] == "--log-info=true"
    assert server.pid is None
    server.stop()  # never started: a no-op


# ----- a real tritonserver ------------------------------------------------------------------------------
def test_real_server_serves_identity_and_stops_cleanly(work_dir: Path, tmp_path: Path) -> None:
    server = _server(_identity_repo(tmp_path / "repo"), work_dir, tmp_path)
    try:
        server.start()
        pgid = server.pid
        assert pgid is not None
        server.wait_ready(120)
        body = {"inputs": [{"name": "INPUT0", "shape": [3], "datatype": "FP32", "data": [1.0, 2.5, -3.0]}]}
        request = urllib.request.Request(
            f"http://127.0.0.1:{server.http_port}/v2/models/identity/infer",
            data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as resp:
            answer = json.loads(resp.read())
        (output,) = answer["outputs"]
        assert output["name"] == "OUTPUT0" and output["data"] == [1.0, 2.5, -3.0]
    finally:
        server.stop()
    assert not group_alive(pgid)
    server.stop()  # idempotent


def test_wait_ready_reports_broken_config_with_log(work_dir: Path, tmp_path: Path) -> None:
    broken = IDENTITY_CONFIG.replace("TYPE_FP32", "TYPE_NOT_A_TYPE", 1)
    server = _server(_identity_repo(tmp_path / "repo", broken), work_dir, tmp_path)
    try:
        server.start()
        with pytest.raises(TritonStartError) as info:
            server.wait_ready(120)
    finally:
        server.stop()
    message = str(info.value)
    assert "exited with code" in message
    assert str(server.log_file) in message and "TYPE_NOT_A_TYPE" in message


def test_only_a_process_that_catches_the_dump_signal_counts_as_catching_it() -> None:
    """The launcher sends the stack-dump signal only where it is caught: its default action kills."""
    ready = "import sys, time; print('ready', flush=True); time.sleep(60)"
    with_handler = f"import faulthandler, signal; faulthandler.register(signal.{STACK_DUMP_SIGNAL.name}); {ready}"
    children = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
                for code in (with_handler, ready)]
    try:
        for child in children:
            assert child.stdout.readline() == b"ready\n"  # its handler, if any, is in place
        assert [catches_signal(child.pid, STACK_DUMP_SIGNAL) for child in children] == [True, False]
        assert [group_members(child.pid) for child in children] == [[child.pid] for child in children]
    finally:
        for child in children:
            child.kill()
            child.wait()
    assert not catches_signal(children[0].pid, STACK_DUMP_SIGNAL)  # gone


# ----- supervision: restart budget, back-off, which process died ---------------------------------------
class FakeClock:
    """Time that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeChild:
    """A supervised process whose deaths and readiness the test scripts."""

    def __init__(self, name: str, ready_timeout_s: float = 100.0, unhealthy_grace_s: float = 10.0) -> None:
        self.name = name
        self.ready_timeout_s = ready_timeout_s
        self.unhealthy_grace_s = unhealthy_grace_s
        self.exit_code: int | None = None
        self.is_ready = True
        self.problem: Problem | None = None  # what health() reports
        self.repairs: list[Problem] = []
        self.starts = 0
        self.stops = 0
        self.failed_stops = 0  # stops of a child that died or did not serve (a short grace: no clean exit)
        self._pid = 100

    @property
    def pid(self) -> int | None:
        return self._pid

    def poll(self) -> int | None:
        return self.exit_code

    def start(self) -> None:
        self.starts += 1
        self._pid += 1
        self.exit_code = None

    def stop(self, *, failed: bool = False) -> None:
        self.stops += 1
        self.failed_stops += failed

    def ready(self) -> bool:
        return self.is_ready

    def failure_detail(self) -> str:
        return f"--- last lines of {self.name}'s log ---"

    def health(self) -> Problem | None:
        return self.problem

    def repair(self, problem: Problem) -> None:
        self.repairs.append(problem)


def _supervisor(max_per_minute: int, *children: FakeChild) -> tuple[Supervisor, FakeClock, list[str]]:
    clock, lines = FakeClock(), []
    return Supervisor(list(children), max_per_minute, clock=clock, log=lines.append), clock, lines


def _restart(supervisor: Supervisor, clock: FakeClock, child: FakeChild, code: int = -9) -> float:
    """Kill `child`, let the supervisor notice, wait out its back-off; returns the back-off it chose."""
    child.exit_code = code
    supervisor.step()
    assert supervisor.phase(child.name) == "waiting"
    waited = 0.0
    while supervisor.phase(child.name) == "waiting":
        clock.advance(0.25)
        waited += 0.25
        supervisor.step()
    return waited


def test_budget_allows_n_restarts_in_a_sliding_minute() -> None:
    clock = FakeClock()
    budget = RestartBudget(3, clock=clock)
    assert [budget.take() is not None for _ in range(3)] == [True, True, True]
    assert budget.take() is None and budget.recent() == 3  # a refused restart spends nothing
    clock.advance(59.9)
    assert budget.take() is None
    clock.advance(0.2)  # the first three are now more than a minute old
    assert budget.recent() == 0 and budget.take() is not None


def test_budget_window_slides_rather_than_resetting_each_minute() -> None:
    clock = FakeClock()
    budget = RestartBudget(2, clock=clock)
    budget.take()
    clock.advance(40)
    budget.take()
    clock.advance(30)  # 70 s after the first, 30 s after the second: one slot free, not two
    assert budget.recent() == 1
    assert budget.take() is not None and budget.take() is None


def test_backoff_doubles_per_recent_restart_capped_and_resets_after_a_quiet_minute() -> None:
    clock = FakeClock()
    budget = RestartBudget(10, clock=clock, backoff_base_s=1.0, backoff_max_s=10.0)
    assert [budget.take() for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    clock.advance(61)
    assert budget.take() == 1.0


def test_zero_budget_never_restarts_and_negative_is_refused() -> None:
    assert RestartBudget(0, clock=FakeClock()).take() is None
    with pytest.raises(ValueError):
        RestartBudget(-1)


def test_describe_exit_names_the_signal() -> None:
    assert describe_exit(-9) == "was killed by SIGKILL (code -9)"
    assert describe_exit(1) == "exited with code 1"
    assert describe_exit(0) == "exited with code 0"


def test_only_the_dead_process_is_restarted_after_its_backoff() -> None:
    triton, frontend = FakeChild("tritonserver"), FakeChild("frontend")
    supervisor, clock, lines = _supervisor(5, triton, frontend)
    supervisor.step()
    assert (triton.starts, frontend.starts) == (0, 0) and lines == []
    triton.exit_code = -9
    triton.is_ready = False
    supervisor.step()
    assert lines == ["launcher: tritonserver (pid 100) was killed by SIGKILL (code -9); restart 1 in 1.0 s "
                     "(1 of at most 5 in the last minute)"]
    assert triton.failed_stops == 1 and triton.starts == 0  # leftovers stopped at once, the restart waits
    clock.advance(0.9)
    supervisor.step()
    assert triton.starts == 0 and supervisor.phase("tritonserver") == "waiting"
    clock.advance(0.1)
    supervisor.step()
    assert triton.starts == 1 and supervisor.phase("tritonserver") == "starting"
    assert lines[-1] == "launcher: tritonserver restarted (pid 101, restart 1); waiting until it is ready"
    clock.advance(3)
    supervisor.step()
    assert supervisor.phase("tritonserver") == "starting"  # loading its model
    triton.is_ready = True
    supervisor.step()
    assert supervisor.phase("tritonserver") == "running"
    assert lines[-1] == "launcher: tritonserver ready again, 3.0 s after restart 1"
    assert (frontend.starts, frontend.stops) == (0, 0) and supervisor.phase("frontend") == "running"


def test_frontend_crash_is_restarted_with_its_own_budget() -> None:
    triton, frontend = FakeChild("tritonserver"), FakeChild("frontend")
    supervisor, clock, lines = _supervisor(1, triton, frontend)
    _restart(supervisor, clock, frontend, code=1)
    assert "launcher: frontend (pid 100) exited with code 1; restart 1 in 1.0 s" in lines[0]
    assert frontend.starts == 1 and triton.starts == 0
    _restart(supervisor, clock, triton)  # Triton's budget is untouched by the frontend's restart
    assert triton.starts == 1
    frontend.exit_code = 1
    with pytest.raises(RestartBudgetExceeded, match=r"^frontend \(pid 101\) exited with code 1; "):
        supervisor.step()


def test_giving_up_past_the_budget_says_why_and_shows_the_log() -> None:
    triton = FakeChild("tritonserver")
    supervisor, clock, lines = _supervisor(2, triton)
    backoffs = [_restart(supervisor, clock, triton), _restart(supervisor, clock, triton)]
    assert backoffs == [1.0, 2.0]
    assert [line.split(";")[1] for line in lines if "killed" in line] == [" restart 1 in 1.0 s (1 of at most 2 in the last minute)",
                                                                         " restart 2 in 2.0 s (2 of at most 2 in the last minute)"]
    triton.exit_code = -9
    stops = triton.stops
    with pytest.raises(RestartBudgetExceeded) as info:
        supervisor.step()
    message = str(info.value)
    assert message.startswith("tritonserver (pid 102) was killed by SIGKILL (code -9); it was already restarted "
                              "2 times in the last minute (MAX_RESTARTS_PER_MINUTE=2); giving up\n")
    assert message.endswith("--- last lines of tritonserver's log ---")
    assert triton.stops == stops + 1 and triton.starts == 2


def test_the_budget_recovers_after_a_minute_up() -> None:
    triton = FakeChild("tritonserver")
    supervisor, clock, _ = _supervisor(2, triton)
    _restart(supervisor, clock, triton)
    _restart(supervisor, clock, triton)
    clock.advance(61)
    supervisor.step()
    assert _restart(supervisor, clock, triton) == 1.0  # budget and back-off both fresh
    assert supervisor.restarts("tritonserver") == 3


def test_a_restart_that_dies_while_loading_counts_against_the_budget() -> None:
    triton = FakeChild("tritonserver")
    supervisor, clock, lines = _supervisor(2, triton)
    triton.is_ready = False
    _restart(supervisor, clock, triton)
    assert supervisor.phase("tritonserver") == "starting"
    triton.exit_code = 1  # the model failed to load
    supervisor.step()
    assert supervisor.phase("tritonserver") == "waiting" and "restart 2 in 2.0 s" in lines[-1]


def test_a_restart_that_never_gets_ready_is_treated_as_dead() -> None:
    triton = FakeChild("tritonserver", ready_timeout_s=30)
    supervisor, clock, lines = _supervisor(5, triton)
    triton.is_ready = False
    _restart(supervisor, clock, triton)
    clock.advance(30)
    supervisor.step()
    assert supervisor.phase("tritonserver") == "starting"
    clock.advance(0.5)
    supervisor.step()
    assert supervisor.phase("tritonserver") == "waiting"
    assert "tritonserver (pid 101) was not ready 30 s after restart 1; restart 2 in 2.0 s" in lines[-1]
    assert triton.stops == 2


def test_zero_restarts_means_the_first_death_ends_supervision() -> None:
    frontend = FakeChild("frontend")
    supervisor, _, _ = _supervisor(0, frontend)
    frontend.exit_code = -11
    with pytest.raises(RestartBudgetExceeded, match=r"SIGSEGV.*restarts are off \(MAX_RESTARTS_PER_MINUTE=0\)"):
        supervisor.step()


# ----- supervision settings and the Triton log across restarts ------------------------------------------
def test_max_restarts_per_minute_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args(["serve"])
    monkeypatch.delenv("MAX_RESTARTS_PER_MINUTE", raising=False)
    assert load_config(args).max_restarts_per_minute == 5
    monkeypatch.setenv("MAX_RESTARTS_PER_MINUTE", "2")
    assert load_config(args).max_restarts_per_minute == 2
    monkeypatch.setenv("MAX_RESTARTS_PER_MINUTE", "0")
    assert load_config(args).max_restarts_per_minute == 0
    for bad in ("-1", "many"):
        monkeypatch.setenv("MAX_RESTARTS_PER_MINUTE", bad)
        with pytest.raises(LaunchError, match="MAX_RESTARTS_PER_MINUTE"):
            load_config(args)


def test_rotate_log_keeps_the_previous_run(tmp_path: Path) -> None:
    log = tmp_path / "tritonserver.log"
    rotate_log(log)  # nothing yet: nothing to do
    log.write_text("first run\n")
    rotate_log(log)
    assert not log.exists() and (tmp_path / "tritonserver.log.1").read_text() == "first run\n"
    log.write_text("second run\n")
    rotate_log(log)
    assert (tmp_path / "tritonserver.log.1").read_text() == "second run\n"


def test_remove_shm_regions_takes_only_the_servers_own_prefix(tmp_path: Path) -> None:
    for name in ("prefix4502_a", "prefix4502_b", "prefix45021_c", "other"):
        (tmp_path / name).write_bytes(b"x")
    assert sorted(remove_shm_regions("prefix4502_", tmp_path)) == ["prefix4502_a", "prefix4502_b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "prefix45021_c"]
    assert remove_shm_regions("prefix1_", tmp_path / "missing") == []


def test_a_killed_server_leaves_no_shared_memory_after_stop(work_dir: Path, tmp_path: Path) -> None:
    server = _server(_identity_repo(tmp_path / "repo"), work_dir, tmp_path)
    shm = Path("/dev/shm")
    try:
        server.start()
        server.wait_ready(120)
        assert any(p.name.startswith(server.shm_prefix) for p in shm.iterdir())  # the stub's regions
        os.killpg(server.pid, signal.SIGKILL)  # as a crash: Triton gets no chance to clean up
        server._proc.wait(30)  # type: ignore[union-attr]
    finally:
        server.stop()
    assert not [p.name for p in shm.iterdir() if p.name.startswith(server.shm_prefix)]


# ----- supervision beyond process exit: an engine that no longer serves ----------------------------------
UNLOADED = Problem("model(s) no longer loaded (m: UNAVAILABLE unloaded)", ("m",))
DEAD_STUB = Problem("the engine model 'm' no longer serves: Stub process 'm_0_0' is not healthy.", definitive=True)
NOT_ANSWERING = Problem("Triton's repository index is not answering (connection refused)")


def test_a_version_unloading_or_loading_is_a_transition_not_a_lost_model() -> None:
    """A swap rollout unloads the old version before loading the new one: the model has no READY version
    meanwhile, and reloading it then broke the unload. Only a model with no version READY, LOADING or
    UNLOADING is missing."""
    indexes = iter([
        {"assistant": [{"name": "assistant", "version": "1", "state": "READY"}]},
        {"assistant": [{"name": "assistant", "version": "1", "state": "UNLOADING"}]},
        {"assistant": [{"name": "assistant", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"},
                       {"name": "assistant", "version": "2", "state": "LOADING"}]},
        {"assistant": [{"name": "assistant", "version": "2", "state": "UNAVAILABLE", "reason": "stub died"}]},
    ])
    health = EngineHealth("127.0.0.1:1", "key", lambda: ["assistant"], probe=lambda url, model: None)
    health._index = lambda: next(indexes)  # type: ignore[method-assign]
    assert health.check() is None  # READY
    assert health.check() is None  # its only version unloading: a swap under way
    assert health.check() is None  # the next version loading
    problem = health.check()
    assert problem is not None and problem.missing == ("assistant",) and "stub died" in problem.reason


class FakeProbeClient:
    """tritonclient's gRPC client as a probe uses it: the engine's answer is delivered when the test says."""

    def __init__(self, url: str) -> None:
        self.callback = None
        self.stopped: list[bool] = []  # cancel_requests of each stop_stream()
        self.closed = threading.Event()

    def start_stream(self, callback) -> None:
        self.callback = callback

    def async_stream_infer(self, *args, **kwargs) -> None:
        pass

    def stop_stream(self, cancel_requests: bool = False) -> None:
        self.stopped.append(cancel_requests)

    def close(self) -> None:
        self.closed.set()


@pytest.mark.parametrize("answer", [None, "Stub process 'm_0_0' is not healthy."])
def test_a_probe_answered_closes_its_stream_and_one_answered_late_is_not_cancelled(
        monkeypatch: pytest.MonkeyPatch, answer: str | None) -> None:
    """Cancelling a stream just after its final response can leak the request in tritonserver 2.51 (server PR
    #8078), and a leaked request keeps its model from ever unloading: a probe closes its side once answered,
    also when the answer comes after the probe gave up waiting; only one never answered is cancelled."""
    clients: list[FakeProbeClient] = []
    error = None if answer is None else InferenceServerException(answer)

    class Answering(FakeProbeClient):
        def async_stream_infer(self, *args, **kwargs) -> None:
            self.callback(result=None if error else object(), error=error)

    monkeypatch.setattr(engine_health.grpcclient, "InferenceServerClient",
                        lambda url: clients.append(Answering(url)) or clients[-1])
    assert engine_health.probe("url", "m") == answer
    assert clients[-1].stopped == [False] and clients[-1].closed.is_set()

    monkeypatch.setattr(engine_health.grpcclient, "InferenceServerClient",
                        lambda url: clients.append(FakeProbeClient(url)) or clients[-1])
    assert engine_health.probe("url", "m", timeout_s=0.01) is None  # no answer yet: busy, not dead
    late = clients[-1]
    assert late.stopped == []  # still waiting for the answer, beside
    late.callback(result=object(), error=None)
    assert late.closed.wait(30) and late.stopped == [False]

    monkeypatch.setattr(engine_health, "LATE_ANSWER_S", 0.01)
    assert engine_health.probe("url", "m", timeout_s=0.01) is None
    assert clients[-1].closed.wait(30) and clients[-1].stopped == [True]  # never answered: cancelled


def test_a_model_gone_gets_its_grace_then_a_reload_and_is_running_again_once_it_serves() -> None:
    triton = FakeChild("tritonserver", ready_timeout_s=30, unhealthy_grace_s=10)
    supervisor, clock, lines = _supervisor(5, triton)
    triton.problem = UNLOADED
    supervisor.step()
    clock.advance(9.9)
    supervisor.step()
    assert triton.repairs == [] and supervisor.phase("tritonserver") == "running"  # a rollout may clear it
    clock.advance(0.2)
    supervisor.step()
    assert triton.repairs == [UNLOADED] and supervisor.phase("tritonserver") == "repairing"
    clock.advance(5)
    supervisor.step()  # still loading: nothing more is asked of it
    assert len(triton.repairs) == 1 and triton.starts == 0
    triton.problem = None
    supervisor.step()
    assert supervisor.phase("tritonserver") == "running" and triton.starts == 0
    assert any("reloading m" in line for line in lines) and any("serves again" in line for line in lines)


def test_a_problem_that_clears_within_the_grace_costs_nothing() -> None:
    triton = FakeChild("tritonserver", unhealthy_grace_s=10)
    supervisor, clock, lines = _supervisor(5, triton)
    triton.problem = UNLOADED
    supervisor.step()
    clock.advance(5)
    triton.problem = None
    supervisor.step()
    clock.advance(20)
    supervisor.step()
    assert triton.repairs == [] and triton.starts == 0 and supervisor.phase("tritonserver") == "running"


def test_a_reload_that_does_not_help_restarts_the_process_within_its_budget() -> None:
    triton = FakeChild("tritonserver", ready_timeout_s=30, unhealthy_grace_s=10)
    supervisor, clock, lines = _supervisor(5, triton)
    triton.problem = UNLOADED
    supervisor.step()
    clock.advance(10)
    supervisor.step()
    clock.advance(30.1)
    supervisor.step()
    assert supervisor.phase("tritonserver") == "waiting" and triton.stops == 1
    assert any("still does not serve 30 s after a reload" in line for line in lines)


def test_a_dead_stub_restarts_the_process_at_once_and_counts_against_the_budget() -> None:
    triton = FakeChild("tritonserver", unhealthy_grace_s=10)
    supervisor, clock, lines = _supervisor(1, triton)
    triton.problem = DEAD_STUB
    supervisor.step()
    assert supervisor.phase("tritonserver") == "waiting" and triton.repairs == []
    assert "does not serve: the engine model 'm' no longer serves" in lines[-1]
    while supervisor.phase("tritonserver") == "waiting":
        clock.advance(0.25)
        supervisor.step()
    assert triton.starts == 1
    triton.is_ready = True
    supervisor.step()
    assert supervisor.phase("tritonserver") == "running"
    with pytest.raises(RestartBudgetExceeded, match="does not serve"):
        supervisor.step()  # still dead, and the budget of 1 a minute is spent


def test_a_model_lost_right_after_a_restart_before_any_readiness_poll_is_reloaded() -> None:
    triton = FakeChild("tritonserver", ready_timeout_s=600, unhealthy_grace_s=10)
    supervisor, clock, lines = _supervisor(5, triton)
    _restart(supervisor, clock, triton)
    assert supervisor.phase("tritonserver") == "starting"
    triton.is_ready, triton.problem = False, UNLOADED
    supervisor.step()
    clock.advance(10)
    supervisor.step()
    assert triton.repairs == [UNLOADED], "waited for the restart's ready timeout instead"


def test_a_passing_problem_seen_while_starting_does_not_restart_what_just_became_ready() -> None:
    # Checked while Triton was still starting (not answering yet), then ready: that stale answer is given the
    # grace like any passing problem, and the next check clears it. (It once restarted a fresh Triton.)
    triton = FakeChild("tritonserver", ready_timeout_s=600, unhealthy_grace_s=10)
    supervisor, clock, lines = _supervisor(5, triton)
    _restart(supervisor, clock, triton)
    triton.is_ready, triton.problem = False, NOT_ANSWERING
    supervisor.step()
    triton.is_ready = True
    supervisor.step()
    supervisor.step()  # running, the stale problem still reported
    assert supervisor.phase("tritonserver") == "running" and triton.starts == 1
    clock.advance(2)
    triton.problem = None
    supervisor.step()
    clock.advance(30)
    supervisor.step()
    assert supervisor.phase("tritonserver") == "running" and triton.starts == 1 and triton.stops == 1


def test_triton_not_answering_for_the_grace_is_restarted() -> None:
    triton = FakeChild("tritonserver", unhealthy_grace_s=10)
    supervisor, clock, lines = _supervisor(5, triton)
    triton.problem = NOT_ANSWERING
    supervisor.step()
    clock.advance(9)
    supervisor.step()
    assert supervisor.phase("tritonserver") == "running"
    clock.advance(1)
    supervisor.step()
    assert supervisor.phase("tritonserver") == "waiting" and triton.repairs == []
    assert "does not serve for 10 s: Triton's repository index is not answering" in lines[-1]



# ----- launcher.mpi across hosts (overlays/multinode) -----------------------------------------------------
def _ranks(argv: list[str]) -> list[list[str]]:
    """mpirun's MPMD argv split into its ranks' tritonserver argvs (each after `-n 1`)."""
    first = argv.index("-n")
    ranks, current = [], []
    for word in argv[first:] + [":"]:
        if word == ":":
            assert current[:2] == ["-n", "1"], current
            ranks.append(current[2:])
            current = []
        else:
            current.append(word)
    return ranks


def test_mpi_across_hosts_gives_mpirun_hosts_agent_and_environment() -> None:
    argv = launcher_mpi.tritonserver_argv(
        4, "/r", address="127.0.0.1", mpirun="/opt/hpcx/ompi/bin/mpirun", hosts=[("lead", 2), ("lead-1", 2)],
        rsh_agent="/bin/sh /scripts/kubessh.sh", export=["PATH", "LD_LIBRARY_PATH"], extra_args=["--x=1"])
    head = argv[:argv.index("-n")]
    assert head == ["/opt/hpcx/ompi/bin/mpirun", "--allow-run-as-root", "--host", "lead:2,lead-1:2",
                    "-mca", "plm_rsh_agent", "/bin/sh /scripts/kubessh.sh", "-mca", "plm_rsh_no_tree_spawn", "1",
                    "-x", "PATH", "-x", "LD_LIBRARY_PATH"]
    ranks = _ranks(argv)
    assert len(ranks) == 4 and all(r[0] == "tritonserver" and r[-1] == "--x=1" for r in ranks)
    # Rank 0 serves (on loopback); the others load the engine model only and serve no endpoint at all.
    assert not [w for w in ranks[0] if w.startswith("--allow-")]
    for rank, words in enumerate(ranks[1:], start=1):
        assert {*launcher_mpi.NO_ENDPOINTS, "--model-control-mode=explicit", "--load-model=tensorrt_llm",
                f"--backend-config=python,shm-region-prefix-name=prefix{rank}_"} <= set(words)


def test_mpi_on_one_host_is_unchanged_by_the_multi_host_options() -> None:
    """overlays/tp: no hosts, no agent, nothing exported: every rank keeps its endpoints (as before)."""
    argv = launcher_mpi.tritonserver_argv(2, "/r")
    assert argv[:3] == ["mpirun", "--allow-run-as-root", "-n"]
    assert not [w for w in argv if w.startswith(("--allow-http", "--allow-grpc", "--allow-metrics", "--host"))]
    assert "-mca" not in argv and "-x" not in argv


def test_hosts_of_a_leaderworkerset_group_and_their_syntax() -> None:
    env = {"LWS_LEADER_ADDRESS": "tritonllm-3.tritonllm.tritonllm", "LWS_GROUP_SIZE": "3"}
    hosts = launcher_mpi.lws_hosts(8, env)
    assert hosts == [("tritonllm-3", 8), ("tritonllm-3-1", 8), ("tritonllm-3-2", 8)]
    assert launcher_mpi.parse_hosts(launcher_mpi.format_hosts(hosts)) == hosts
    for bad in ("a", "a:0", "a:8,,a:8", "a:x", ""):
        with pytest.raises(ValueError):
            launcher_mpi.parse_hosts(bad)
    with pytest.raises(ValueError, match="not a LeaderWorkerSet pod"):
        launcher_mpi.lws_hosts(8, {})
    with pytest.raises(ValueError, match="LWS_GROUP_SIZE"):
        launcher_mpi.lws_hosts(8, {**env, "LWS_GROUP_SIZE": "two"})


def test_exported_names_are_the_set_ones_and_prefix_patterns() -> None:
    env = {"PATH": "/bin", "LD_LIBRARY_PATH": "/lib", "NCCL_DEBUG": "INFO", "NCCL_IB_DISABLE": "1", "OTHER": "x"}
    assert launcher_mpi.export_names("PATH LD_LIBRARY_PATH,HOME NCCL_* PATH", env) == [
        "PATH", "LD_LIBRARY_PATH", "NCCL_DEBUG", "NCCL_IB_DISABLE"]  # HOME unset: not forwarded
    assert launcher_mpi.export_names("", env) == []


def test_layout_must_fill_the_hosts_and_tp_should_stay_in_one() -> None:
    hosts = [("a", 8), ("b", 8)]
    assert launcher_mpi.check_layout(16, hosts, tp_size=8) == []
    [warning] = launcher_mpi.check_layout(16, hosts, tp_size=16)
    assert "spans hosts" in warning
    with pytest.raises(ValueError, match="16 slots"):
        launcher_mpi.check_layout(8, hosts, tp_size=8)


def test_mpi_main_reads_the_multi_host_settings_from_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    engine = {"world_size": 16, "tp_size": 8, "pp_size": 2}
    monkeypatch.setattr(launcher_mpi, "check_model_repository", lambda repo: engine)
    for name, value in {"MPIRUN": "/opt/hpcx/ompi/bin/mpirun", "MPI_LWS_GPUS_PER_POD": "8",
                        "MPI_RSH_AGENT": "/bin/sh /scripts/kubessh.sh", "MPI_EXPORT": "PATH LD_LIBRARY_PATH",
                        "LWS_LEADER_ADDRESS": "tritonllm-0.tritonllm.tritonllm", "LWS_GROUP_SIZE": "2",
                        "LD_LIBRARY_PATH": "/usr/lib", "TRITON_ADDRESS": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    assert launcher_mpi.main(["--model-repository", str(tmp_path), "--print", "--log-info=true"]) == 0
    argv = shlex.split(capsys.readouterr().out)
    assert argv[:4] == ["/opt/hpcx/ompi/bin/mpirun", "--allow-run-as-root", "--host",
                        "tritonllm-0:8,tritonllm-0-1:8"]
    assert ["-x", "PATH", "-x", "LD_LIBRARY_PATH"] == argv[argv.index("-x"):argv.index("-x") + 4]
    assert len(_ranks(argv)) == 16
    # A group whose GPUs the engine does not fill exactly is refused before mpirun starts.
    monkeypatch.setenv("LWS_GROUP_SIZE", "3")
    assert launcher_mpi.main(["--model-repository", str(tmp_path), "--print"]) == 1
    assert "16 ranks (TP x PP) but the hosts" in capsys.readouterr().err
