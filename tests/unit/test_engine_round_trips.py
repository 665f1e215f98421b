"""The engine's round trips to Triton stay off its critical path (cpu_engine/engine.py, TritonChannel in
model_repository/tensorrt_llm/1/model.py): the cancellation poll runs while the step computes and is over
before the step's responses are handed over, metrics go out from a thread of their own, and a step's
responses are delivered while the next step computes, in order per request, one step in flight at most."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from cpu_engine.engine import Engine, _LatestOnly
from cpu_engine.scheduler import FinishReason, GenerationRequest
from tests.unit.test_cpu_engine import checkpoint, make_scheduler, prompt_of, request  # noqa: F401  (fixture)


def test_the_poll_runs_beside_the_step_and_is_over_before_after_step(checkpoint: Path) -> None:  # noqa: F811
    engine_threads: set[str] = set()
    poll_threads: set[str] = set()
    in_poll = threading.Event()
    overlaps: list[bool] = []
    victim = request("v", prompt_of(5), 200)

    def cancelled(requests: list[GenerationRequest]) -> list[bool]:
        in_poll.set()
        poll_threads.add(threading.current_thread().name)
        time.sleep(0.002)  # a round trip
        in_poll.clear()
        return [r is victim and len(victim.sink.tokens) >= 3 for r in requests]

    def after_step() -> None:
        engine_threads.add(threading.current_thread().name)
        overlaps.append(in_poll.is_set())

    engine = Engine(make_scheduler(checkpoint), cancelled=cancelled, cancel_poll_s=0.0, after_step=after_step)
    engine.start()
    try:
        engine.submit(victim)
        assert victim.sink.done.wait(60)
    finally:
        engine.stop()
    assert engine_threads == {"cpu-engine"} and poll_threads and "cpu-engine" not in poll_threads
    assert not any(overlaps)  # never while a step's (final) responses are handed over
    assert victim.sink.finish is FinishReason.CANCELLED and 3 <= len(victim.sink.tokens) < 200


def test_metrics_go_out_from_their_own_thread_and_never_hold_the_engine(checkpoint: Path) -> None:  # noqa: F811
    published: list[tuple[str, int]] = []
    release = threading.Event()

    def on_stats(stats) -> None:
        published.append((threading.current_thread().name, stats.generated_tokens_total))
        release.wait(60)  # a metrics round trip that lasts until the test ends it

    target = request("t", prompt_of(6), 40)
    engine = Engine(make_scheduler(checkpoint), on_stats=on_stats, stats_period_s=0.01)
    engine.start()
    try:
        engine.submit(target)
        # all 40 tokens while the metrics thread was stuck in its first round trip (or not yet in one): the
        # engine never waited for a publish (however fast or slow this machine is)
        assert target.sink.done.wait(60)
        during = len(published)
    finally:
        release.set()
        engine.stop()
    assert target.sink.finish is FinishReason.LENGTH and len(target.sink.tokens) == 40
    assert during <= 1
    assert published and {name for name, _ in published} == {"cpu-engine-stats"}
    counts = [count for _, count in published]
    assert counts == sorted(counts)  # in order, newest first: never an older snapshot after a newer one


def test_latest_only_replaces_what_waits_and_delivers_the_last_value_on_close() -> None:
    seen: list[int] = []
    gate, taken = threading.Event(), threading.Event()

    def consume(value: int) -> None:
        taken.set()
        gate.wait(60)
        seen.append(value)

    publisher = _LatestOnly(consume, 0.0)
    publisher.offer(1)
    assert taken.wait(60)  # the consumer holds 1
    for value in (2, 3, 4):
        publisher.offer(value)
    gate.set()
    publisher.close(10)
    assert seen == [1, 4]


# ----- TritonChannel (model_repository/tensorrt_llm/1/model.py, with a stand-in pb_utils) -----------------
@pytest.fixture
def glue_module(monkeypatch: pytest.MonkeyPatch):
    pb_utils = types.ModuleType("triton_python_backend_utils")
    pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    pb_utils.warnings = []
    pb_utils.Logger = types.SimpleNamespace(log_warn=pb_utils.warnings.append)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb_utils)
    path = Path(__file__).resolve().parents[2] / "model_repository" / "tensorrt_llm" / "1" / "model.py"
    spec = importlib.util.spec_from_file_location("cpu_engine_glue_channel_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class SlowSender:
    """A response sender whose sends take a while, as Triton's round trips do."""

    def __init__(self, log: list[tuple[str, object, int]], name: str, delay_s: float = 0.02):
        self.log, self.name, self.delay_s = log, name, delay_s

    def send(self, response=None, flags: int = 0) -> None:
        time.sleep(self.delay_s)
        self.log.append((self.name, response, flags))


class GatedSender(SlowSender):
    """A sender whose first send waits until the test opens the gate."""

    def __init__(self, log: list[tuple[str, object, int]], name: str, gate: threading.Event):
        super().__init__(log, name)
        self.gate = gate

    def send(self, response=None, flags: int = 0) -> None:
        assert self.gate.wait(60)
        super().send(response, flags)


def test_flush_returns_before_delivery_and_keeps_each_request_in_order(glue_module) -> None:
    log: list[tuple[str, object, int]] = []
    channel = glue_module.TritonChannel()
    gate = threading.Event()
    a, b = GatedSender(log, "a", gate), SlowSender(log, "b")
    channel.send(a, "a1")
    channel.send(b, "b1")
    flushing = threading.Thread(target=channel.flush)
    flushing.start()
    flushing.join(10)
    assert not flushing.is_alive()  # returned although a1 cannot go out yet: handed over, not waited for
    assert ("a", "a1", 0) not in log
    gate.set()
    channel.send(a, "a2")
    channel.send(a, "a3", flags=1)
    channel.flush()  # waits for step 1's responses first
    channel.close()
    assert [response for name, response, _ in log if name == "a"] == ["a1", "a2", "a3"]
    assert [response for name, response, _ in log if name == "b"] == ["b1"]
    assert log[-1] == ("a", "a3", 1)


def test_a_failed_send_is_logged_and_the_others_go_out(glue_module) -> None:
    log: list[tuple[str, object, int]] = []

    class Gone(SlowSender):
        def send(self, response=None, flags: int = 0) -> None:
            raise RuntimeError("the client went away")

    channel = glue_module.TritonChannel()
    channel.send(Gone(log, "gone"), "x")
    channel.send(SlowSender(log, "ok"), "y", flags=1)
    channel.flush()
    channel.wait()
    assert log == [("ok", "y", 1)]
    assert any("the client went away" in warning for warning in sys.modules["triton_python_backend_utils"].warnings)
    channel.close()
