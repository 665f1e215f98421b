"""Test-only engine models: the production CPU engine model with knobs that make it slow, late or broken
on purpose, so integration tests control its speed and faults instead of depending on the machine's.

`add_knob_model(repo, "tensorrt_llm_slow", test_step_delay_s=0.05)` (called before tritonserver starts)
copies the rendered `tensorrt_llm` model to `repo/tensorrt_llm_slow`, with the knobs as config.pbtxt
parameters and a `1/model.py` that loads this file's `TritonPythonModel`: the production model
(model_repository/tensorrt_llm/1/model.py, imported by file path) plus the knobs. Knob models run next to
the real `tensorrt_llm` in one tritonserver, each its own engine with its own `cpu_engine_*{model="<name>"}`
metrics. Knobs (all optional):

- `test_step_delay_s` (float): the engine thread sleeps this long after every step, after the step's
  responses were delivered, so a stream of N tokens takes at least (N - 1) x delay on any machine.
- `test_hold_first_response_s` (float): a request's responses reach Triton no sooner than this long after
  the engine received the request; its tokens accumulate meanwhile and then go out together, in order. A
  final (or error) response goes out when it comes, with everything held before it. The engine keeps
  stepping and polling cancellation as usual, so a client that gives up meanwhile cancels the request.
- `test_fail_seed` (int): a request whose `seed` input equals it gets the error response
  "injected failure" right after its first generated token was delivered, and leaves the engine.
- `test_crash_seed` (int): a request whose `seed` equals it makes the engine loop raise outside
  `scheduler.step()` (after the step that admitted it), which kills the engine thread: see the failure
  guard in cpu_engine/engine.py and what model.py then does with Triton's readiness.
- `test_hang_in_initialize` (int, 1 = on): initialize() loads the engine as usual, logs HANG_MESSAGE and
  then never returns, as a load that hangs: the model never becomes ready (for the launcher's stack dump).

This module is imported in two places: by the test process (add_knob_model only; no Triton there) and
inside the Python-backend stub (TritonPythonModel). The model class is therefore built on first access,
so importing the module needs neither `triton_python_backend_utils` nor the production model.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
PRODUCTION_MODEL = REPO_ROOT / "model_repository" / "tensorrt_llm" / "1" / "model.py"
SOURCE_MODEL = "tensorrt_llm"
KNOB_TYPES: dict[str, type] = {
    "test_step_delay_s": float,
    "test_hold_first_response_s": float,
    "test_fail_seed": int,
    "test_crash_seed": int,
    "test_hang_in_initialize": int,
}
INJECTED_FAILURE = "injected failure"
HANG_MESSAGE = "hanging in initialize on purpose (test_hang_in_initialize)"
_NAME_LINE = re.compile(r'^name:\s*"[^"]*"\s*$', re.MULTILINE)


# ----- the test side: adding knob models to a rendered repository ---------------------------------------
def add_knob_model(model_repository: Path, name: str, **knobs: float | int) -> None:
    """Copy `model_repository/tensorrt_llm` to `model_repository/<name>` with `knobs` (see the module
    docstring) as config parameters and a model.py that loads the knob model. Call it before tritonserver
    starts (Triton's default model-control mode loads the repository once). Raises ValueError for an
    unknown knob, a name that is not a plain model name, or a name that is already taken."""
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name) or name == SOURCE_MODEL:
        raise ValueError(f"not a usable model name for a knob model: {name!r}")
    unknown = sorted(set(knobs) - set(KNOB_TYPES))
    if unknown:
        raise ValueError(f"unknown knob(s) {unknown}; known: {sorted(KNOB_TYPES)}")
    source, target = Path(model_repository) / SOURCE_MODEL, Path(model_repository) / name
    if target.exists():
        raise ValueError(f"{target} already exists")
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    config = target / "config.pbtxt"
    config.write_text(_knob_config(config.read_text(), name, knobs))
    (target / "1" / "model.py").write_text(_loader_source(name))


def _knob_config(text: str, name: str, knobs: dict[str, float | int]) -> str:
    if len(_NAME_LINE.findall(text)) != 1:
        raise ValueError(f"expected exactly one top-level name line in the {SOURCE_MODEL} config.pbtxt")
    text = _NAME_LINE.sub(f'name: "{name}"', text)
    parameters = "".join(
        f'parameters: {{\n  key: "{key}"\n  value: {{ string_value: "{KNOB_TYPES[key](value)}" }}\n}}\n'
        for key, value in knobs.items())
    return f"{text.rstrip()}\n# Test knobs (tests/integration/engine_knobs.py).\n{parameters}"


def _loader_source(name: str) -> str:
    """The knob model's model.py: loads this file by path (tests/ is not an installed package)."""
    return (f'"""Test-only model {name!r}: the CPU engine model with test knobs (generated by '
            f'tests/integration/engine_knobs.py)."""\n'
            "import importlib.util\n"
            "import sys\n\n"
            f"_spec = importlib.util.spec_from_file_location('engine_knobs', {str(Path(__file__).resolve())!r})\n"
            "_module = importlib.util.module_from_spec(_spec)\n"
            "sys.modules['engine_knobs'] = _module\n"
            "_spec.loader.exec_module(_module)\n"
            "TritonPythonModel = _module.TritonPythonModel\n")


# ----- the Triton side: the model with knobs --------------------------------------------------------------
@dataclass(frozen=True)
class Knobs:
    step_delay_s: float = 0.0
    hold_first_response_s: float = 0.0
    fail_seed: int | None = None
    crash_seed: int | None = None
    hang_in_initialize: bool = False

    @classmethod
    def from_model_config(cls, config: dict[str, Any]) -> "Knobs":
        parameters = config.get("parameters", {})

        def knob(key: str) -> float | int | None:
            value = parameters.get(key, {}).get("string_value")
            return None if value in (None, "") else KNOB_TYPES[key](value)

        return cls(step_delay_s=knob("test_step_delay_s") or 0.0,
                   hold_first_response_s=knob("test_hold_first_response_s") or 0.0,
                   fail_seed=knob("test_fail_seed"), crash_seed=knob("test_crash_seed"),
                   hang_in_initialize=bool(knob("test_hang_in_initialize")))


def _production_module() -> ModuleType:
    """model_repository/tensorrt_llm/1/model.py, imported once by path under a name of its own."""
    name = "cpu_engine_triton_model"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, PRODUCTION_MODEL)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _build_model_class() -> type:
    production = _production_module()
    pb_utils = production.pb_utils

    class HoldingChannel(production.TritonChannel):
        """Keeps a request's responses back until its hold ends or its final response comes."""

        def __init__(self, hold_s: float):
            super().__init__()
            self._hold_s = hold_s
            self._release_at: dict[int, tuple[object, float]] = {}  # id(sender) -> (sender, monotonic time)
            self._lock = threading.Lock()  # hold()/release() come from execute(), flush() from the engine

        def hold(self, sender) -> None:
            with self._lock:
                self._release_at[id(sender)] = (sender, time.monotonic() + self._hold_s)

        def release(self, sender) -> None:
            with self._lock:
                self._release_at.pop(id(sender), None)

        def flush(self) -> None:
            now = time.monotonic()
            held = {key: item for key, item in self._queued.items() if self._held(key, item[1], now)}
            self._queued = {key: item for key, item in self._queued.items() if key not in held}
            try:
                super().flush()
            finally:
                self._queued.update(held)  # nothing was queued meanwhile: flush runs on the engine thread

        def _held(self, key: int, responses: list[tuple[object, int]], now: float) -> bool:
            with self._lock:
                entry = self._release_at.get(key)
                if entry is None:
                    return False
                if now < entry[1] and not any(flags & production.FINAL for _, flags in responses):
                    return True
                del self._release_at[key]
                return False

    class TritonPythonModel(production.TritonPythonModel):
        """The production model plus the knobs read from its config.pbtxt (see the module docstring)."""

        def initialize(self, args):
            self.knobs = Knobs.from_model_config(json.loads(args["model_config"]))
            pb_utils.Logger.log_warn(f"{args['model_name']}: TEST MODEL with knobs {self.knobs}")
            super().initialize(args)
            if self.knobs.hang_in_initialize:
                self._hang_in_initialize()

        def _hang_in_initialize(self) -> None:
            pb_utils.Logger.log_warn(HANG_MESSAGE)
            threading.Event().wait()  # until tritonserver is killed

        def _make_channel(self):
            if self.knobs.hold_first_response_s > 0:
                return HoldingChannel(self.knobs.hold_first_response_s)
            return super()._make_channel()

        def _enqueue(self, request, sender) -> None:
            holding = isinstance(self.channel, HoldingChannel)
            if holding:  # before the engine can answer: its first step may run before _enqueue returns
                self.channel.hold(sender)
            try:
                super()._enqueue(request, sender)
            except BaseException:
                if holding:
                    self.channel.release(sender)
                raise
            if holding and production._scalar(request, "stop", False):
                self.channel.release(sender)  # a stop request was answered directly, not through the channel

        def _refuse(self, sender, message: str) -> None:
            # Also after _enqueue returned: a request whose guide failed to compile (or whose compile ended
            # after finalize) is answered directly, never through the channel.
            if isinstance(self.channel, HoldingChannel):
                self.channel.release(sender)
            super()._refuse(sender, message)

        def _after_step(self) -> None:
            super()._after_step()
            self._inject_failures()
            self._crash_if_asked()
            if self.knobs.step_delay_s > 0:
                time.sleep(self.knobs.step_delay_s)  # a slow machine, on purpose

        def _inject_failures(self) -> None:
            if self.knobs.fail_seed is None:
                return
            doomed = [s.request for s in self.engine.scheduler.running
                      if s.output and s.request.sampling.seed == self.knobs.fail_seed]
            for request in doomed:
                self.engine.scheduler.abort(request, INJECTED_FAILURE)
            if doomed:
                super()._after_step()  # deliver the errors now, right after the first token

        def _crash_if_asked(self) -> None:
            seed = self.knobs.crash_seed
            if seed is not None and any(r.sampling.seed == seed for r in self.engine.scheduler.live_requests()):
                raise RuntimeError(f"injected engine-thread crash (test_crash_seed={seed})")

    return TritonPythonModel


def __getattr__(name: str) -> Any:
    """Build TritonPythonModel on first access (PEP 562): only inside the Triton stub is pb_utils there."""
    if name == "TritonPythonModel":
        model_class = _build_model_class()
        globals()[name] = model_class
        return model_class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
