"""Is the engine serving? What the launcher's supervisor (and Kubernetes' liveness probe) ask of Triton.

A live tritonserver process is not a serving engine. Measured on tritonserver 2.51 (the nvidia-pytriton
wheel) with the CPU engine model:
- The engine thread dies: the model unloads itself (model_repository/tensorrt_llm/1/model.py). Triton stays
  up and `/v2/health/ready` turns 200 again; only the model's own readiness says it is gone.
- The model's Python-backend stub is killed (`kill -9`, the kernel's OOM killer): the model and the server
  stay READY, open streams get nothing more, ever, and every new request waits ~1 s and then fails with
  "Stub process '<model>_0_0' is not healthy.". Triton does not restart the stub, and unloading the model
  never finishes (its in-flight requests never complete), so only a tritonserver restart brings it back.

So `check()` reads Triton's repository index (which models are loaded) and sends each loaded engine model a
probe: a TensorRT-LLM `stop` request for an id nobody uses, which both engines answer at once without
running anything; only a dead stub answers "not healthy". A probe that gets no answer in time is not taken
as a death (a busy engine may be slow to take it); a missing model and a dead stub are.

The launcher is the one party that repairs (frontend workers only report): a named model whose live version
(rollout.json) Triton has not ready, with nothing loading or unloading, is missing too, and `reload()` makes
its files agree with rollout.json (model_store settle()) before it asks Triton to load it, so that an
interrupted rollout's two-version policy is never loaded as it stands.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from build_engine import model_store
from launcher.tritonserver import grpc_control_headers

PROBE_TIMEOUT_S = 5.0
LATE_ANSWER_S = 120.0  # how long a probe answered late is waited for before its stream is cancelled
STUB_DEAD = "is not healthy"  # the Python backend's answer once a model's stub process is gone


@dataclass(frozen=True)
class Problem:
    """Why the engine is not serving. `missing`: loaded models that are no longer loaded, which loading them
    again may fix. `definitive`: only a restart can fix it, and waiting will not (a dead stub); anything
    else may be passing (Triton busy or starting) and is given time first."""

    reason: str
    missing: tuple[str, ...] = ()
    definitive: bool = False

    @property
    def reloadable(self) -> bool:
        return bool(self.missing)


def probe_inputs() -> list[grpcclient.InferInput]:
    """A `stop` request (TensorRT-LLM semantics: cancel the requests with this id) with the inputs Triton
    requires of every request to the engine model, so that it reaches the model."""
    inputs = []
    for name, value, datatype in (("input_ids", np.array([[0]], dtype=np.int32), "INT32"),
                                  ("input_lengths", np.array([[1]], dtype=np.int32), "INT32"),
                                  ("request_output_len", np.array([[1]], dtype=np.int32), "INT32"),
                                  ("streaming", np.array([[True]]), "BOOL"),
                                  ("stop", np.array([[True]]), "BOOL")):
        tensor = grpcclient.InferInput(name, list(value.shape), datatype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


def probe(grpc_url: str, model: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """The engine model's answer to a probe: None when it answered (whatever it said, its process is there),
    the error text when it is a dead stub's. No answer within `timeout_s` counts as an answer: busy, not dead.

    The probe's stream is closed, never cancelled, once answered: tritonserver 2.51 can leak a stream's state
    when the client cancels right after the final response (server PR #8078, "Fix gRPC cancellation race
    condition", 2025, after this release), and a leaked request holds its model: the model never unloads
    (a swap rollout waits forever) and Triton's exit waits out its timeout on it. A probe cancelled every
    2 s, just after its answer, is that timing exactly. An answer that comes late is waited for beside."""
    answers: queue.Queue[str | None] = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        client.start_stream(callback=lambda result, error: answers.put(None if error is None else str(error)))
        client.async_stream_infer(model, probe_inputs(), request_id=f"health-probe-{uuid.uuid4().hex}",
                                  enable_empty_final_response=True)
    except BaseException:
        _close(client, answered=False)
        raise
    try:
        error = answers.get(timeout=timeout_s)
    except queue.Empty:
        threading.Thread(target=_close_when_answered, args=(client, answers), name="late-probe",
                         daemon=True).start()
        return None
    _close(client, answered=True)
    return error if error is not None and STUB_DEAD in error else None


def _close_when_answered(client: grpcclient.InferenceServerClient, answers: queue.Queue[str | None]) -> None:
    """A probe answered late: its stream closes once the answer comes, cancelled only after LATE_ANSWER_S."""
    try:
        answers.get(timeout=LATE_ANSWER_S)
    except queue.Empty:
        _close(client, answered=False)
    else:
        _close(client, answered=True)


def _close(client: grpcclient.InferenceServerClient, answered: bool) -> None:
    """End a probe's stream: once the engine answered, by closing our side (Triton then ends the stream);
    otherwise by cancelling it."""
    try:
        client.stop_stream(cancel_requests=not answered)
    finally:
        client.close()


class EngineHealth:
    """What one tritonserver run serves, and whether it still does.

    Every model Triton has reported READY during this run is expected to stay loaded (a rollout swaps
    versions of a model; it never unloads the model itself). `engine_models()` names the models with the
    TensorRT-LLM interface, the ones a probe can reach.
    """

    def __init__(self, grpc_url: str, control_key: str, engine_models: Callable[[], Iterable[str]],
                 probe: Callable[[str, str], str | None] = probe, repository: Path | None = None) -> None:
        self._repository = repository  # where named models live (their rollout.json), if any
        self._grpc_url = grpc_url
        self._headers = grpc_control_headers(control_key)
        self._engine_models = engine_models
        self._probe = probe
        self._seen: set[str] = set()

    def _index(self) -> dict[str, list[dict[str, str]]]:
        """Model name -> its versions' index entries (state READY, UNAVAILABLE, LOADING, UNLOADING...)."""
        client = grpcclient.InferenceServerClient(self._grpc_url)
        try:
            index = client.get_model_repository_index(headers=self._headers, as_json=True, client_timeout=10)
        finally:
            client.close()
        models: dict[str, list[dict[str, str]]] = {}
        for entry in index.get("models", []):
            models.setdefault(entry["name"], []).append(entry)
        return models

    def check(self) -> Problem | None:
        try:
            index = self._index()
        except Exception as exc:  # Triton not answering at all: the supervisor sees the process itself
            return Problem(f"Triton's repository index is not answering ({exc})")
        states = {name: {e.get("state", "") for e in entries} for name, entries in index.items()}
        ready = {name for name, found in states.items() if "READY" in found}
        # A version LOADING or UNLOADING is a transition someone asked for (a swap rollout unloads the old
        # version before it loads the new one, which takes a while on a busy machine); a crash leaves versions
        # UNAVAILABLE. Reloading during an unload loaded a version beside the one still unloading, and that
        # one never finished (its stub hung in teardown): the swap rollout then waited forever.
        in_transition = {name for name, found in states.items() if found & {"LOADING", "UNLOADING"}}
        # Expected: what was ready during this run, and the engine models Triton has tried to load (a model
        # built while serving has no state until a rollout loads it).
        self._seen |= ready | {name for name in self._engine_models() if states.get(name, {""}) - {""}}
        missing = sorted(self._seen - ready - in_transition)
        for model, live in self._named_live_versions():
            found = {e.get("version"): e.get("state") for e in index.get(model, [])}
            if model in ready and model not in in_transition and found.get(live) != "READY":
                missing.append(model)  # e.g. a rollout committed its version while Triton was down
        if missing:
            states = "; ".join(f"{name}: " + ", ".join(f"{e.get('state') or 'not loaded'} {e.get('reason', '')}".strip()
                                                      for e in index.get(name, [{}])) for name in missing)
            return Problem(f"model(s) no longer loaded ({states})", tuple(missing))
        for model in sorted(ready & set(self._engine_models())):
            dead = self._probe(self._grpc_url, model)
            if dead is not None:
                return Problem(f"the engine model {model!r} no longer serves: {dead}", definitive=True)
        return None

    def _named_live_versions(self) -> list[tuple[str, str]]:
        """Each named model and its live version as rollout.json records it (unreadable ones left out: Triton
        reports their load failure)."""
        found = []
        for model in model_store.managed_models(self._repository) if self._repository is not None else []:
            try:
                found.append((model.name, str(model.live_version)))
            except model_store.ModelStoreError:
                continue
        return found

    def reload(self, models: Iterable[str]) -> None:
        """Ask Triton to load `models` again (blocks for the load); engine models first, since composing
        models such as the ensemble need them. A named model's files are settled first (model_store
        settle(): the policy and the `live` link back to rollout.json's version)."""
        engines = set(self._engine_models())
        named = {m.name: m for m in model_store.managed_models(self._repository)} if self._repository else {}
        client = grpcclient.InferenceServerClient(self._grpc_url)
        try:
            for model in sorted(models, key=lambda name: (name not in engines, name)):
                if model in named:
                    repaired = named[model].settle()
                    if repaired:
                        print(f"launcher: model {model}: an interrupted rollout was undone ({repaired})",
                              file=sys.stderr, flush=True)
                client.load_model(model, headers=self._headers)
        finally:
            client.close()


def main(argv: list[str] | None = None) -> int:
    """Kubernetes' liveness probe of the Triton container: exit 1 when the engine model is not ready or its
    stub is dead (a probe that gets no answer in time passes: busy is alive)."""
    parser = argparse.ArgumentParser(prog="python -m launcher.engine_health", description=main.__doc__)
    parser.add_argument("--grpc-url", default=f"127.0.0.1:{os.environ.get('TRITON_GRPC_PORT') or 8001}",
                        help="Triton's gRPC endpoint (default: 127.0.0.1:$TRITON_GRPC_PORT, else :8001)")
    parser.add_argument("--model", action="append",
                        help="an engine model, repeatable (default: $ENGINE_MODEL, else tensorrt_llm)")
    args = parser.parse_args(argv)
    args.model = args.model or [os.environ.get("ENGINE_MODEL") or "tensorrt_llm"]
    client = grpcclient.InferenceServerClient(args.grpc_url)
    try:
        for model in args.model:
            if not client.is_model_ready(model, client_timeout=10):
                print(f"{model} is not ready", file=sys.stderr)
                return 1
    except Exception as exc:
        print(f"Triton is not answering: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    for model in args.model:
        dead = probe(args.grpc_url, model)
        if dead is not None:
            print(f"{model}: {dead}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
