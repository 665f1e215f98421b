"""cpu_engine/guide_pool.py: guides compiled off Triton's execute() thread, with a stand-in compiler whose
compiles block until the test lets them go (no xgrammar, no model)."""

from __future__ import annotations

import threading
import time

import pytest

from cpu_engine.guide_pool import SHUT_DOWN, GuidePool
from cpu_engine.scheduler import RequestError

WAIT_S = 10.0


class BlockingCompiler:
    """Compiles (type, guide) into the tuple ("compiled", type, guide); a guide listed in `gates` waits for
    its event first; a guide starting with "bad" fails as xgrammar's would."""

    def __init__(self) -> None:
        self.cache: dict[tuple, tuple] = {}
        self.gates: dict[str | None, threading.Event] = {}
        self.started: dict[str | None, threading.Event] = {}
        self.compiles: list[tuple] = []
        self.threads: list[str] = []

    def gate(self, guide: str) -> threading.Event:
        self.started[guide] = threading.Event()
        self.gates[guide] = threading.Event()
        return self.gates[guide]

    def cached(self, guide_type, guide):
        if guide_type is None:
            raise RequestError("guided_decoding_guide was given without guided_decoding_guide_type")
        return self.cache.get((guide_type, guide))

    def compile(self, guide_type, guide):
        self.compiles.append((guide_type, guide))
        self.threads.append(threading.current_thread().name)
        if guide in self.gates:
            self.started[guide].set()
            assert self.gates[guide].wait(WAIT_S), "the test never let the compile go"
        if guide.startswith("bad"):
            raise RequestError(f"invalid guided_decoding_guide for guided_decoding_guide_type {guide_type!r}: no")
        compiled = self.cache[(guide_type, guide)] = ("compiled", guide_type, guide)
        return compiled


class Answers:
    """Collects each request's then(compiled, error); `wait(n)` until n answers came."""

    def __init__(self) -> None:
        self.got: dict[str, tuple] = {}
        self.threads: dict[str, str] = {}
        self._changed = threading.Condition()

    def then(self, name: str):
        def answer(compiled, error):
            with self._changed:
                assert name not in self.got, f"{name} answered twice"
                self.got[name] = (compiled, error)
                self.threads[name] = threading.current_thread().name
                self._changed.notify_all()
        return answer

    def wait(self, count: int) -> dict[str, tuple]:
        with self._changed:
            assert self._changed.wait_for(lambda: len(self.got) >= count, WAIT_S), self.got
            return dict(self.got)


@pytest.fixture
def compiler() -> BlockingCompiler:
    return BlockingCompiler()


@pytest.fixture
def pool(compiler):
    pool = GuidePool(compiler, threads=2, max_compiles=3, max_waiting=5)
    yield pool
    for gate in compiler.gates.values():
        gate.set()
    pool.close()


def test_an_uncached_guide_compiles_on_a_pool_thread_and_a_cached_one_comes_back_at_once(pool, compiler):
    answers = Answers()
    release = compiler.gate("{a}")
    assert pool.guide("json_schema", "{a}", "r1", answers.then("r1")) is None  # returns while the compile waits
    assert compiler.started["{a}"].wait(WAIT_S) and pool.compiling == 1 and pool.waiting == 1
    assert answers.got == {}
    release.set()
    assert answers.wait(1) == {"r1": (("compiled", "json_schema", "{a}"), None)}
    assert answers.threads["r1"].startswith("guide-compile") and compiler.threads == ["guide-compile_0"]
    assert pool.guide("json_schema", "{a}", "r2", answers.then("r2")) == ("compiled", "json_schema", "{a}")
    assert compiler.compiles == [("json_schema", "{a}")] and "r2" not in answers.got
    assert (pool.compiling, pool.waiting) == (0, 0)


def test_requests_for_a_guide_already_compiling_join_that_compile(pool, compiler):
    answers = Answers()
    release = compiler.gate("[0-9]+")
    for name in ("r1", "r2", "r3"):
        assert pool.guide("regex", "[0-9]+", name, answers.then(name)) is None
    assert (pool.compiling, pool.waiting) == (1, 3)
    release.set()
    compiled = ("compiled", "regex", "[0-9]+")
    assert answers.wait(3) == {name: (compiled, None) for name in ("r1", "r2", "r3")}
    assert compiler.compiles == [("regex", "[0-9]+")]


def test_a_guide_that_does_not_compile_answers_its_requests_with_the_compilers_error(pool, compiler):
    answers = Answers()
    pool.guide("regex", "bad((", "r1", answers.then("r1"))
    compiled, error = answers.wait(1)["r1"]
    assert compiled is None and error.startswith("invalid guided_decoding_guide for guided_decoding_guide_type")
    assert (pool.compiling, pool.waiting) == (0, 0)


def test_inputs_that_name_no_guide_are_refused_at_once(pool, compiler):
    with pytest.raises(RequestError, match="without guided_decoding_guide_type"):
        pool.guide(None, "[a-z]", "r1", Answers().then("r1"))
    assert compiler.compiles == []


def test_the_compile_queue_is_bounded_and_says_queue_is_full(pool, compiler):
    """max_compiles=3 distinct guides; max_waiting=5 requests. Past either: refused at once, in words the
    frontend answers with 429 (frontend/generation/triton_errors.py QUEUE_FULL); a cached guide is never refused."""
    answers = Answers()
    compiler.cache[("regex", "cached")] = ("compiled", "regex", "cached")
    gates = [compiler.gate(f"g{i}") for i in range(3)]
    for i in range(3):
        pool.guide("regex", f"g{i}", f"r{i}", answers.then(f"r{i}"))
    with pytest.raises(RequestError, match=r"^the guide compile queue is full \(3 guides compiling"):
        pool.guide("regex", "g3", "r3", answers.then("r3"))
    pool.guide("regex", "g0", "r4", answers.then("r4"))  # joins g0's compile
    pool.guide("regex", "g1", "r5", answers.then("r5"))
    with pytest.raises(RequestError, match=r"^the guide compile queue is full \(5 requests waiting"):
        pool.guide("regex", "g0", "r6", answers.then("r6"))
    assert pool.guide("regex", "cached", "r7", answers.then("r7")) == ("compiled", "regex", "cached")
    for gate in gates:
        gate.set()
    assert sorted(answers.wait(5)) == ["r0", "r1", "r2", "r4", "r5"]
    assert (pool.compiling, pool.waiting) == (0, 0)
    assert pool.guide("regex", "g3", "r8", answers.then("r8")) is None  # room again
    assert answers.wait(6)["r8"] == (("compiled", "regex", "g3"), None)


def test_stop_answers_the_requests_with_that_id_at_once_and_drops_a_compile_nobody_waits_for(compiler):
    pool = GuidePool(compiler, threads=1)
    answers = Answers()
    first = compiler.gate("g1")
    pool.guide("regex", "g1", "other", answers.then("other"))
    assert compiler.started["g1"].wait(WAIT_S)  # the one thread is busy: g2 waits to start
    pool.guide("regex", "g2", "same", answers.then("same-g2"))
    pool.guide("regex", "g1", "same", answers.then("same-g1"))
    assert pool.stop("same", "the request was cancelled by a stop request") == 2
    stopped = (None, "the request was cancelled by a stop request")
    assert answers.got == {"same-g2": stopped, "same-g1": stopped}
    assert pool.compiling == 1  # g2 never starts; g1 runs on for "other"
    first.set()
    assert answers.wait(3)["other"] == (("compiled", "regex", "g1"), None)
    pool.close()
    assert compiler.compiles == [("regex", "g1")]


def test_close_answers_every_waiting_request_and_a_running_compile_never_delivers_its_guide(compiler):
    pool = GuidePool(compiler, threads=1)
    answers = Answers()
    running = compiler.gate("g1")
    pool.guide("regex", "g1", "r1", answers.then("r1"))
    assert compiler.started["g1"].wait(WAIT_S)
    pool.guide("regex", "g2", "r2", answers.then("r2"))  # queued behind g1
    pool.close()
    assert answers.got == {"r2": (None, SHUT_DOWN)}  # at once
    with pytest.raises(RequestError, match="being unloaded"):
        pool.guide("regex", "g3", "r3", answers.then("r3"))
    running.set()  # g1's compile ends after close: its request gets the error, not the guide
    assert answers.wait(2)["r1"] == (None, SHUT_DOWN)
    assert compiler.compiles == [("regex", "g1")]


def test_a_broken_answer_does_not_keep_the_other_requests_from_theirs(pool, compiler):
    answers = Answers()
    release = compiler.gate("g")

    def broken(compiled, error):
        raise RuntimeError("the client's sender broke")

    pool.guide("regex", "g", "broken", broken)
    pool.guide("regex", "g", "fine", answers.then("fine"))
    release.set()
    assert answers.wait(1)["fine"] == (("compiled", "regex", "g"), None)
    deadline = time.monotonic() + WAIT_S
    while pool.waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (pool.compiling, pool.waiting) == (0, 0)
