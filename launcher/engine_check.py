"""Refuse to serve a TensorRT-LLM engine that the installed TensorRT-LLM did not build.

A TensorRT engine only deserializes in the exact TensorRT / TensorRT-LLM version that built it; anything
else fails deep inside model load (``Serialization assertion stdVersionRead == kSERIALIZATION_VERSION``)
after minutes. ``build_engine`` records the version in ``<engine>/engine_config.json``; this module
compares it with the installed package before tritonserver starts, and says what to do about it.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
from pathlib import Path
from typing import Any

from build_engine import model_store
from launcher.tritonserver import TritonStartError

ENGINE_CONFIG_FILE = "engine_config.json"
ENGINE_MODEL = "tensorrt_llm"
TRTLLM_DISTRIBUTIONS = ("tensorrt_llm", "tensorrt-llm")
REBUILD_HINT = (
    "TensorRT engines only load in the TensorRT-LLM version that built them: rebuild the engine in this "
    "image (`make engine BACKEND=trtllm MODEL=<checkpoint>`, or `docker compose run --rm engine`)"
)

_BACKEND = re.compile(r'^\s*backend:\s*"([^"]*)"', re.MULTILINE)
_MODEL_PATH = re.compile(r'key:\s*"gpt_model_path"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', re.MULTILINE)


class EngineMismatchError(TritonStartError):
    """The engine cannot be served by the installed TensorRT-LLM; the message says why and what to do."""


def installed_trtllm_version() -> str | None:
    """The installed TensorRT-LLM version, from package metadata (importing it is slow and needs CUDA)."""
    for name in TRTLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def read_engine_config(engine_dir: Path) -> dict[str, Any]:
    path = Path(engine_dir) / ENGINE_CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise EngineMismatchError(
            f"no {ENGINE_CONFIG_FILE} in {engine_dir}: no engine was built there; run "
            "`make engine BACKEND=trtllm MODEL=<checkpoint>` first"
        ) from None
    except (OSError, ValueError) as exc:
        raise EngineMismatchError(f"cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise EngineMismatchError(f"{path} does not hold a JSON object")
    return config


def check_trtllm_engine(engine_dir: Path, installed_version: str | None = None) -> dict[str, Any]:
    """Raise :class:`EngineMismatchError` unless ``engine_dir`` holds an engine this TensorRT-LLM built.

    ``installed_version`` defaults to the installed package's; returns the engine's engine_config.json.
    """
    engine_dir = Path(engine_dir)
    config = read_engine_config(engine_dir)
    if config.get("backend") != "trtllm":
        raise EngineMismatchError(
            f"{engine_dir} holds a {config.get('backend')!r} engine, not a TensorRT-LLM one; "
            "run `make engine BACKEND=trtllm MODEL=<checkpoint>`"
        )
    installed = installed_version if installed_version is not None else installed_trtllm_version()
    if installed is None:
        raise EngineMismatchError(
            f"{engine_dir} is a TensorRT-LLM engine but TensorRT-LLM is not installed here: serve it from the "
            "image that built it (docker/Dockerfile.trtllm)"
        )
    built = config.get("tensorrt_llm_version")
    if built != installed:
        raise EngineMismatchError(
            f"the engine in {engine_dir} was built with TensorRT-LLM {built} but TensorRT-LLM {installed} is "
            f"installed here. {REBUILD_HINT}"
        )
    # trtllm-build's own record, in case the engine files were replaced behind build_engine's back.
    try:
        written = json.loads((engine_dir / "config.json").read_text()).get("version")
    except (OSError, ValueError, AttributeError):
        written = None
    if written is not None and str(written) != installed:
        raise EngineMismatchError(
            f"{engine_dir}/config.json says the engine was built with TensorRT-LLM {written} but TensorRT-LLM "
            f"{installed} is installed here. {REBUILD_HINT}"
        )
    return config


def check_model_repository(model_repository: Path, installed_version: str | None = None) -> dict[str, Any] | None:
    """Check the engine a rendered repository serves, if that is a TensorRT-LLM engine.

    Returns its engine_config.json, or None when ``tensorrt_llm`` runs another backend (the CPU engine),
    so the launcher can call this unconditionally before starting tritonserver.
    """
    config_path = Path(model_repository) / ENGINE_MODEL / "config.pbtxt"
    try:
        text = config_path.read_text()
    except OSError:
        return None  # the launcher's own checks report a missing repository
    backend = _BACKEND.search(text)
    if backend is None or backend.group(1) != "tensorrtllm":
        return None
    model_path = _MODEL_PATH.search(text)
    if model_path is None:
        raise EngineMismatchError(f"{config_path} sets no gpt_model_path: re-render it with `make engine`")
    return check_trtllm_engine(Path(model_path.group(1)), installed_version)


def serves_tensorrt_llm(model_repository: Path) -> bool:
    """Whether the repository's engine model (or any named model) runs the TensorRT-LLM backend."""
    configs = [Path(model_repository) / ENGINE_MODEL / "config.pbtxt",
               *(model.config_path for model in model_store.managed_models(Path(model_repository)))]
    for config in configs:
        try:
            backend = _BACKEND.search(config.read_text())
        except OSError:
            continue
        if backend is not None and backend.group(1) == "tensorrtllm":
            return True
    return False


def check_named_models(repository: Path, installed_version: str | None = None) -> list[str]:
    """The version check per version for a repository of named models (build_engine/model_store.py).

    A TensorRT-LLM model's live version must load here (EngineMismatchError otherwise); its other versions
    on disk only get a warning each (returned), since a rollout to one of them would fail to load.
    """
    warnings = []
    for model in model_store.managed_models(repository):
        backend = _BACKEND.search(model.config_path.read_text())
        if backend is None or backend.group(1) != "tensorrtllm":
            continue
        live = model.live_version
        check_trtllm_engine(model.engine_dir(live), installed_version)
        for version in model.versions():
            if version == live:
                continue
            try:
                check_trtllm_engine(model.engine_dir(version), installed_version)
            except EngineMismatchError as exc:
                warnings.append(f"model {model.name} version {version} cannot be rolled out here: {exc}")
    return warnings
