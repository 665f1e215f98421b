"""The test knobs of tests/integration/engine_knobs.py do what they say, in a real tritonserver; and, through
them, the engine's cancellation and failure handling end to end: cancellation by identity (two streams
sharing a request id), the `stop` input ending its target with an error, the cancelled-requests counter,
and an engine thread that dies taking the model out of service (readiness false).

They use the session's tritonserver (explicit model-control mode, which the self-unload of a failed
engine needs: see model_repository/tensorrt_llm/1/model.py) and its knob models (conftest.KNOB_MODELS).
The engine-thread crash is tested through the frontend in test_generation_path.py.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.integration.conftest import (FAIL_SEED, FAULTY_MODEL, HELD_MODEL, KNOB_MODELS, SLOW_MODEL, Stack,
                                        engine_settled, wait_engine)
from tests.integration.engine_knobs import INJECTED_FAILURE

pytestmark = pytest.mark.integration

SLOW, HELD, FAULTY = SLOW_MODEL, HELD_MODEL, FAULTY_MODEL
DELAY_S = KNOB_MODELS[SLOW]["test_step_delay_s"]


@dataclass(frozen=True)
class KnobServer:
    grpc_url: str
    http_url: str
    metrics_url: str


@pytest.fixture(scope="module")
def knob_server(stack: Stack) -> KnobServer:
    """The session's tritonserver, which serves the knob models next to the real one (conftest.KNOB_MODELS)."""
    return KnobServer(stack.triton_grpc_url, stack.triton_http_url, stack.triton_metrics_url)


# ----- raw Triton gRPC -------------------------------------------------------------------------------------
def _tensor(name: str, value: np.ndarray, datatype: str) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, list(value.shape), datatype)
    t.set_data_from_numpy(value)
    return t


def engine_inputs(output_len: int, seed: int | None = None, stop: bool = False) -> list[grpcclient.InferInput]:
    prompt = [3, 4, 5, 6]
    inputs = [_tensor("input_ids", np.array([prompt], dtype=np.int32), "INT32"),
              _tensor("input_lengths", np.array([[len(prompt)]], dtype=np.int32), "INT32"),
              _tensor("request_output_len", np.array([[output_len]], dtype=np.int32), "INT32"),
              _tensor("streaming", np.array([[True]], dtype=bool), "BOOL")]
    if seed is not None:
        inputs.append(_tensor("seed", np.array([[seed]], dtype=np.uint64), "UINT64"))
    if stop:
        inputs.append(_tensor("stop", np.array([[True]], dtype=bool), "BOOL"))
    return inputs


@dataclass
class Event:
    at: float  # time.monotonic() when the client got it
    tokens: int
    final: bool
    error: str | None


class Stream:
    """One request on its own gRPC stream; `next()` returns its responses as they come."""

    def __init__(self, url: str, model: str, inputs: list[grpcclient.InferInput], request_id: str = ""):
        self._events: queue.Queue[Event] = queue.Queue()
        self._closed = False
        self._client = grpcclient.InferenceServerClient(url)
        self._client.start_stream(callback=self._on_response)
        self.sent_at = time.monotonic()
        self._client.async_stream_infer(model, inputs, request_id=request_id, outputs=[
            grpcclient.InferRequestedOutput("output_ids")], enable_empty_final_response=True)

    def _on_response(self, result: grpcclient.InferResult | None, error: Exception | None) -> None:
        at = time.monotonic()
        if error is not None:
            self._events.put(Event(at, 0, True, str(error)))
            return
        ids = result.as_numpy("output_ids")
        final = result.get_response().parameters["triton_final_response"].bool_param
        self._events.put(Event(at, 0 if ids is None else ids.size, final, None))

    def next(self, timeout_s: float = 60) -> Event:
        return self._events.get(timeout=timeout_s)

    def until_end(self, timeout_s: float = 60) -> list[Event]:
        events = [self.next(timeout_s)]
        while not events[-1].final:
            events.append(self.next(timeout_s))
        return events

    def close(self, cancel: bool = False) -> None:
        """End the stream (cancel=True: cancel the request in Triton, as a client that leaves); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._client.stop_stream(cancel_requests=cancel)
        self._client.close()


def run(url: str, model: str, inputs: list[grpcclient.InferInput], request_id: str = "") -> tuple[Stream, list[Event]]:
    stream = Stream(url, model, inputs, request_id)
    try:
        return stream, stream.until_end()
    finally:
        stream.close()


def running_since(before: dict[str, float], slots: int = 1) -> Callable[[dict[str, float]], bool]:
    """`slots` requests run, and the engine generated since `before` (its settled metrics before the send):
    what only the request just sent can have caused. A slot gauge alone can still show the request before."""
    return lambda now: (now["active_slots"] == slots
                        and now["generated_tokens_total"] > before["generated_tokens_total"])


# ----- the knobs -------------------------------------------------------------------------------------------
def test_step_delay_makes_every_token_take_at_least_the_delay(knob_server: KnobServer) -> None:
    stream, events = run(knob_server.grpc_url, SLOW, engine_inputs(20))
    assert not any(e.error for e in events) and sum(e.tokens for e in events) == 20
    # The delay follows each step, after its token went out: 19 of them lie between the first token and the
    # last (20 x the delay held only while the steps themselves took a delay's worth: a fast engine got the
    # 20 tokens out 0.996 s after the send).
    assert events[-1].at - stream.sent_at >= 19 * DELAY_S


def test_hold_keeps_the_responses_back_then_sends_what_accumulated(knob_server: KnobServer) -> None:
    # 40 tokens take >= 39 x the held model's step delay, far less than its hold: the hold keeps every
    # token back until the final response, which then carries them out, one response per token, in order.
    stream, events = run(knob_server.grpc_url, HELD, engine_inputs(40))
    token_events = [e for e in events if e.tokens]
    steps_s = 39 * KNOB_MODELS[HELD]["test_step_delay_s"]  # the delays between the first token and the last
    assert events[0].at - stream.sent_at >= steps_s and events[-1].at - events[0].at < steps_s
    assert len(token_events) == 40 and all(e.tokens == 1 for e in token_events)
    assert not any(e.error for e in events) and events[-1].final


def test_a_held_request_is_still_cancelled_when_its_client_leaves(knob_server: KnobServer) -> None:
    """The hold delays delivery only: the engine runs the request and polls cancellation meanwhile.

    The request must be in the engine before the client leaves: Triton drops a request cancelled while it still
    waits in the model's scheduler queue, before execute() ever sees it (dynamic batching: Triton core's
    PriorityQueue::PolicyQueue::ApplyPolicy moves a cancelled request out of the queue and answers it
    CANCELLED), and the engine then has nothing to cancel or count. So the test waits for the engine to be
    idle, with counters that include the previous test's request (its slot gauge can still read 1 just after
    that request ended: the metrics are published from a thread of their own), and for the engine to
    generate for this request, before it leaves."""
    url = knob_server.metrics_url
    before = engine_settled(url, HELD)
    stream = Stream(knob_server.grpc_url, HELD, engine_inputs(400))  # >= 20 s of steps: cannot end by itself
    try:
        wait_engine(url, HELD, running_since(before), "the held model to run the request")
    finally:
        stream.close(cancel=True)
    wait_engine(url, HELD, lambda now: now["cancelled_requests_total"] == before["cancelled_requests_total"] + 1
                and now["active_slots"] == 0, "the held request to be cancelled")


def test_fail_seed_gets_an_error_right_after_its_first_token(knob_server: KnobServer) -> None:
    _, events = run(knob_server.grpc_url, FAULTY, engine_inputs(50, seed=FAIL_SEED))
    assert [e.tokens for e in events[:-1]] == [1]
    assert events[-1].error is not None and INJECTED_FAILURE in events[-1].error
    _, others = run(knob_server.grpc_url, FAULTY, engine_inputs(3, seed=FAIL_SEED + 1))
    assert sum(e.tokens for e in others) == 3 and not any(e.error for e in others)


# ----- cancellation end to end -----------------------------------------------------------------------------
def test_a_client_leaving_cancels_its_own_request_only_and_is_counted(knob_server: KnobServer) -> None:
    url, before = knob_server.grpc_url, engine_settled(knob_server.metrics_url, SLOW)
    leaving = Stream(url, SLOW, engine_inputs(400), request_id="shared-id")
    staying = Stream(url, SLOW, engine_inputs(30), request_id="shared-id")
    try:
        assert leaving.next().tokens == 1 and staying.next().tokens == 1
        leaving.close(cancel=True)
        rest = staying.until_end()
    finally:
        leaving.close(cancel=True)
        staying.close()
    assert not any(e.error for e in rest) and 1 + sum(e.tokens for e in rest) == 30
    wait_engine(knob_server.metrics_url, SLOW,
                lambda now: now["cancelled_requests_total"] == before["cancelled_requests_total"] + 1,
                "the cancelled-requests counter")


def test_stop_request_ends_its_target_with_an_error(knob_server: KnobServer) -> None:
    target = Stream(knob_server.grpc_url, SLOW, engine_inputs(400), request_id="stop-target")
    try:
        assert target.next().tokens == 1
        _, stop_events = run(knob_server.grpc_url, SLOW, engine_inputs(1, stop=True), request_id="stop-target")
        assert [(e.error, e.final) for e in stop_events] == [(None, True)]
        rest = target.until_end()
    finally:
        target.close()
    assert rest[-1].error is not None and "cancelled by a stop request" in rest[-1].error
    assert 1 + sum(e.tokens for e in rest) < 400
