"""One build, start to finish: checkpoint -> engine -> rendered model repository."""

from __future__ import annotations

import difflib
import json
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from build_engine import model_store, trtllm
from build_engine.checkpoint import CheckpointInfo, validate_checkpoint
from build_engine.cpu_engine_builder import (
    DTYPES,
    ENGINE_CONFIG_FILE,
    cpu_engine_config,
    write_engine_config,
    write_int8_weights,
)
from build_engine.demo_checkpoint import ensure_demo_checkpoint
from build_engine.errors import BuildError
from build_engine.limits import EngineLimits, resolve_limits
from build_engine.model_store import ManagedModel
from build_engine.render import render_repository, stale_copies
from build_engine.values import repository_values
from build_engine.xgrammar_info import XgrammarInfoError, tokenizer_info, write_tokenizer_info

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "model_repository"
DEFAULT_PRESET = "small"
BACKENDS = ("cpu", "trtllm")
# Beside the TensorRT-LLM engine: the tokenizer description its guided decoding (xgrammar) reads.
XGRAMMAR_INFO_FILE = "xgrammar_tokenizer_info.json"


@dataclass(frozen=True)
class BuildRequest:
    """What to build. ``preset`` and ``model`` are None unless given explicitly (at most one of them)."""

    output_dir: Path
    backend: str = "cpu"
    preset: str | None = None
    model: Path | None = None
    dtype: str | None = None  # None: float32 on CPU, the checkpoint's dtype for TensorRT-LLM
    weights: str | None = None  # CPU engine only: None or "float32" (the checkpoint's), "int8" (cpu_engine.int8)
    max_batch_size: int | None = None
    max_seq_len: int | None = None
    max_num_tokens: int | None = None
    kv_cache_tokens: int | None = None  # CPU engine only (TensorRT-LLM sizes its cache by memory fraction)
    # TensorRT-LLM only.
    max_input_len: int | None = None
    tp_size: int = 1
    pp_size: int = 1
    gpus_per_node: int = trtllm.DEFAULT_GPUS_PER_NODE
    weight_only: str | None = None
    kv_cache_dtype: str | None = None
    max_lora_rank: int = 0  # LoRA on TensorRT-LLM (trtllm.TrtllmOptions)
    lora_target_modules: tuple[str, ...] = trtllm.LORA_TARGET_MODULES
    trtllm_examples_dir: Path = trtllm.DEFAULT_EXAMPLES_DIR

    @property
    def source(self) -> dict[str, str]:
        """Where the checkpoint comes from, as recorded in engine_config.json."""
        if self.model is not None:
            return {"model": str(Path(self.model).resolve())}
        return {"preset": self.preset or DEFAULT_PRESET}

    @property
    def engine_dir(self) -> Path:
        return self.output_dir / "engine"

    @property
    def repository_dir(self) -> Path:
        return self.output_dir / "model_repository"


@dataclass(frozen=True)
class BuildResult:
    """Where a build put things, for the user and for callers such as the launcher."""

    engine_dir: Path
    repository_dir: Path
    served_model_name: str


def existing_build(request: BuildRequest) -> BuildResult | None:
    """The build already in the output folder, if it satisfies ``request`` (for ``--if-missing``).

    With no explicit --preset/--model any existing build will do; otherwise it must come from the same source.
    """
    config_path = request.engine_dir / ENGINE_CONFIG_FILE
    if not config_path.is_file() or not request.repository_dir.is_dir():
        return None
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError:
        return None
    explicit = request.preset is not None or request.model is not None
    if config.get("backend") != request.backend or (explicit and config.get("source") != request.source):
        return None
    if request.weights is not None and config.get("weights", "float32") != request.weights:
        return None
    # A CPU build rendered by an older checkout carries that checkout's model code, which may not match the
    # engine package it now runs with: rebuild (for the CPU engine that is a re-render, seconds).
    if request.backend == "cpu" and stale_copies(TEMPLATE_DIR, request.repository_dir):
        return None
    # A TensorRT engine only loads in the TensorRT-LLM version that built it: rebuild after an image upgrade.
    if request.backend == "trtllm":
        installed = trtllm.installed_version()
        if installed is not None and config.get("tensorrt_llm_version") != installed:
            return None
    return BuildResult(
        request.engine_dir.resolve(), request.repository_dir.resolve(), config["served_model_name"]
    )


def _checkpoint_and_limits(request: BuildRequest) -> tuple[CheckpointInfo, str, EngineLimits]:
    """Validate the backend and the checkpoint (generating the demo one if needed); resolve the limits."""
    if request.backend not in BACKENDS:
        raise BuildError(f"unknown backend {request.backend!r}; use one of {', '.join(BACKENDS)}")
    if request.model is not None and request.preset is not None:
        raise BuildError("give either --model or --preset, not both")
    if request.backend == "trtllm" and request.weights is not None:
        raise BuildError("--weights is for the CPU engine; TensorRT-LLM quantizes with --weight-only")
    if request.model is not None:
        checkpoint = validate_checkpoint(request.model)
        served_model_name = checkpoint.directory.name
    else:
        preset = request.preset or DEFAULT_PRESET
        checkpoint = validate_checkpoint(ensure_demo_checkpoint(request.output_dir, preset))
        served_model_name = f"demo-{preset}"
    gpu = request.backend == "trtllm"
    max_batch_size = request.max_batch_size
    if gpu and max_batch_size is None:
        max_batch_size = trtllm.DEFAULT_MAX_BATCH_SIZE
    max_seq_len = request.max_seq_len
    if gpu and max_seq_len is None:
        max_seq_len = min(checkpoint.max_position_embeddings, trtllm.DEFAULT_MAX_SEQ_LEN_CAP)
    max_num_tokens = request.max_num_tokens
    if gpu and max_num_tokens is None:
        max_num_tokens = trtllm.DEFAULT_MAX_NUM_TOKENS
    limits = resolve_limits(
        max_position_embeddings=checkpoint.max_position_embeddings,
        preset=None if request.model is not None else (request.preset or DEFAULT_PRESET),
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        max_num_tokens=max_num_tokens,
    )
    return checkpoint, served_model_name, limits


def _trtllm_options(request: BuildRequest) -> trtllm.TrtllmOptions:
    return trtllm.TrtllmOptions(
        dtype=request.dtype or "auto",
        tp_size=request.tp_size,
        pp_size=request.pp_size,
        gpus_per_node=request.gpus_per_node,
        weight_only=request.weight_only,
        kv_cache_dtype=request.kv_cache_dtype,
        max_input_len=request.max_input_len,
        max_lora_rank=request.max_lora_rank,
        lora_target_modules=tuple(request.lora_target_modules),
        examples_dir=Path(request.trtllm_examples_dir),
    )


def _trtllm_plan(request: BuildRequest, checkpoint: CheckpointInfo, limits: EngineLimits) -> trtllm.TrtllmPlan:
    return trtllm.plan_build(
        checkpoint, limits, _trtllm_options(request), work_dir=request.output_dir, engine_dir=request.engine_dir
    )


def _trtllm_engine_config(
    request: BuildRequest, checkpoint: CheckpointInfo, served_model_name: str, limits: EngineLimits,
    plan: trtllm.TrtllmPlan, *, version: str, checkpoint_hash: str,
) -> dict[str, Any]:
    return trtllm.trtllm_engine_config(
        checkpoint, plan, limits, _trtllm_options(request), served_model_name=served_model_name,
        source=request.source, version=version, checkpoint_hash=checkpoint_hash,
        xgrammar_tokenizer_info=_xgrammar_info_path(request, checkpoint),
    )


def _xgrammar_info_path(request: BuildRequest, checkpoint: CheckpointInfo) -> Path | None:
    """Where the build will write the tokenizer info for guided decoding, or None (with a warning) for a
    tokenizer it cannot describe: the engine still serves, without guided decoding."""
    try:
        tokenizer_info(checkpoint.directory)
    except XgrammarInfoError as exc:
        print(f"warning: guided decoding will not be available on this engine: {exc}", file=sys.stderr)
        return None
    return request.engine_dir / XGRAMMAR_INFO_FILE


def dry_run(request: BuildRequest, template_dir: Path = TEMPLATE_DIR) -> trtllm.TrtllmPlan:
    """The TensorRT-LLM commands ``build(request)`` would run, with the model repository it would serve
    rendered into ``<output_dir>/model_repository`` so that its exact configs can be read before a long
    build. Runs nothing, builds nothing, and never touches a folder that already holds a built engine."""
    if request.backend != "trtllm":
        raise BuildError("only the trtllm backend runs external commands; the cpu build has none to print")
    if (request.engine_dir / ENGINE_CONFIG_FILE).exists():
        raise BuildError(
            f"{request.output_dir} already holds a built engine, whose model repository a dry run would "
            "overwrite; give the dry run another --output-dir"
        )
    checkpoint, served_model_name, limits = _checkpoint_and_limits(request)
    plan = _trtllm_plan(request, checkpoint, limits)
    engine_config = _trtllm_engine_config(
        request, checkpoint, served_model_name, limits, plan,
        version=trtllm.installed_version() or "not installed", checkpoint_hash="not computed (dry run)",
    )
    values = repository_values(template_dir, request.backend, engine_config, request.engine_dir)
    render_repository(template_dir, values, request.repository_dir)
    return plan


def build(request: BuildRequest, template_dir: Path = TEMPLATE_DIR) -> BuildResult:
    """Build the engine and render the model repository described by ``request``."""
    checkpoint, served_model_name, limits = _checkpoint_and_limits(request)
    plan: trtllm.TrtllmPlan | None = None
    if request.backend == "trtllm":
        if request.kv_cache_tokens is not None:
            raise BuildError("--kv-cache-tokens is for the CPU engine; TensorRT-LLM sizes its KV cache with "
                             "kv_cache_free_gpu_mem_fraction (model_repository/values/trtllm.json)")
        plan = _trtllm_plan(request, checkpoint, limits)
        engine_config = _trtllm_engine_config(
            request, checkpoint, served_model_name, limits, plan,
            version=trtllm.check_toolchain(plan), checkpoint_hash=trtllm.checkpoint_sha256(checkpoint.directory),
        )
    else:
        dtype = request.dtype or "float32"
        if dtype not in DTYPES:
            raise BuildError(f"--dtype {dtype} is not supported by the CPU engine; use one of {', '.join(DTYPES)}")
        engine_config = cpu_engine_config(
            checkpoint,
            served_model_name=served_model_name,
            dtype=dtype,
            weights=request.weights or "float32",
            limits=limits,
            source=request.source,
            kv_cache_tokens=request.kv_cache_tokens,
        )
    values = repository_values(template_dir, request.backend, engine_config, request.engine_dir)
    # Rendered before the (long) TensorRT-LLM build: the values do not depend on its output.
    render_repository(template_dir, values, request.repository_dir)
    if plan is not None:
        trtllm.run_build(plan)
        built_by = trtllm.engine_version(plan.engine_dir)
        if built_by is not None and built_by != engine_config["tensorrt_llm_version"]:
            raise BuildError(
                f"trtllm-build wrote TensorRT-LLM version {built_by} into {plan.engine_dir}/config.json, "
                f"but the installed package is {engine_config['tensorrt_llm_version']}"
            )
        # What guided decoding needs (xgrammar_tokenizer_info_path); written after the build, which
        # starts by clearing the engine folder.
        if engine_config["xgrammar_tokenizer_info"]:
            write_tokenizer_info(checkpoint.directory, Path(engine_config["xgrammar_tokenizer_info"]))
    elif engine_config["weights"] == "int8":
        write_int8_weights(checkpoint.directory, request.engine_dir)
    # Written last, so a failed render or build never leaves an engine that --if-missing would accept.
    write_engine_config(request.engine_dir, engine_config)
    return BuildResult(request.engine_dir.resolve(), request.repository_dir.resolve(), served_model_name)


# ----- named models: numbered versions of one Triton model (layout and reasons: model_store.py) ---------
MODELS_SUBDIR = "models"
# Weight files a TensorRT-LLM version does not need: its engine holds the weights.
TRTLLM_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
_BUILD_FLAGS = ("dtype", "weights", "max_batch_size", "max_seq_len", "max_num_tokens", "kv_cache_tokens", "tp_size",
                "pp_size", "weight_only", "kv_cache_dtype", "max_input_len")


@dataclass(frozen=True)
class VersionResult:
    """What a named build did: the version it added, the one serving, and what pruning removed."""

    name: str
    version: int
    version_dir: Path
    live_version: int
    pruned: list[int]


def _managed_model(request: BuildRequest, name: str) -> ManagedModel:
    try:
        model_store.check_name(name)
    except model_store.ModelStoreError as exc:
        raise BuildError(str(exc)) from None
    return ManagedModel(Path(request.output_dir).resolve() / MODELS_SUBDIR / name)


def existing_version(request: BuildRequest, name: str) -> int | None:
    """The newest version of ``name`` built from the request's source and backend (for ``--if-missing``)."""
    model = _managed_model(request, name)
    if not model.directory.is_dir():
        return None
    matching = [v for v in model.versions()
                if (record := model.record(v)).get("source") == request.source
                and record.get("backend") == request.backend]
    return max(matching, default=None)


def version_config(
    template_dir: Path, request: BuildRequest, engine_config: dict[str, Any], model: ManagedModel, version: int
) -> str:
    """The model's shared config.pbtxt for this build, policy listing only ``version``.

    Its paths go through the `live` link, never a version directory, so that every version of the model
    renders the same text unless its limits or settings differ.
    """
    live = model.live_link
    values = repository_values(template_dir, request.backend, engine_config, live / model_store.ENGINE_DIR)
    info = engine_config.get("xgrammar_tokenizer_info")
    values.update(
        engine_dir=str(live / model_store.ENGINE_DIR),
        tokenizer_dir=str(live / model_store.CHECKPOINT_DIR),
        served_model_name=model.name,
        xgrammar_tokenizer_info_path=str(live / model_store.ENGINE_DIR / Path(info).name) if info else "",
    )
    with tempfile.TemporaryDirectory() as tmp:
        render_repository(template_dir, values, Path(tmp))  # wipes its target: never the model's directory
        text = (Path(tmp) / "tensorrt_llm" / model_store.CONFIG_FILE).read_text()
    text, renamed = re.subn(r'^name: "tensorrt_llm"$', f'name: "{model.name}"', text, count=1, flags=re.MULTILINE)
    if not renamed:
        raise BuildError(f'{template_dir}/tensorrt_llm/{model_store.CONFIG_FILE} has no line name: "tensorrt_llm"')
    return text.rstrip("\n") + "\n" + model_store.version_policy_line([version]) + "\n"


def _refuse_config_change(model: ManagedModel, new_text: str) -> None:
    old = model_store.without_policy(model.config_path.read_text())
    new = model_store.without_policy(new_text)
    if old == new:
        return
    diff = list(difflib.unified_diff(old.splitlines(), new.splitlines(),
                                     f"{model.config_path} (versions {model.versions()})", "this build",
                                     n=1, lineterm=""))
    shown = diff[:16] + ([f"... ({len(diff) - 16} more lines)"] if len(diff) > 16 else [])
    raise BuildError(
        f"model {model.name!r}: this build's config.pbtxt differs from the one its versions share:\n  "
        + "\n  ".join(shown)
        + "\nversions of one model share Triton's config; build with the same limits, or under another --name"
    )


def build_version(
    request: BuildRequest, name: str, keep_versions: int = model_store.DEFAULT_KEEP_VERSIONS,
    template_dir: Path = TEMPLATE_DIR,
) -> VersionResult:
    """Add version N of the named model ``name`` to ``<output_dir>/models`` (engine model only: the
    frontend tokenizes), leaving what serves untouched unless this is the model's first version.

    Everything is built in ``.staging-N`` and renamed into place last, so a failed build leaves no version
    behind; a build whose config.pbtxt would differ from the shared one is refused before the long work.
    """
    model = _managed_model(request, name)
    if keep_versions < 1:
        raise BuildError(f"--keep-versions must be at least 1, got {keep_versions}")
    source_checkpoint, _, limits = _checkpoint_and_limits(request)
    numbered = [int(child.name) for child in model.directory.glob("*") if child.name.isdigit()]
    version = 1 + max(numbered, default=0)
    staging, final = model.directory / f".staging-{version}", model.version_dir(version)
    # The record names where things will be once renamed, never the staging directory.
    checkpoint = replace(source_checkpoint, directory=final / model_store.CHECKPOINT_DIR)
    plan: trtllm.TrtllmPlan | None = None
    if request.backend == "trtllm":
        if request.kv_cache_tokens is not None:
            raise BuildError("--kv-cache-tokens is for the CPU engine; TensorRT-LLM sizes its KV cache with "
                             "kv_cache_free_gpu_mem_fraction (model_repository/values/trtllm.json)")
        # Converted from the user's checkpoint: the version's own copy holds no weights.
        plan = trtllm.plan_build(source_checkpoint, limits, _trtllm_options(request), work_dir=staging,
                                 engine_dir=staging / model_store.ENGINE_DIR)
        has_info = _xgrammar_info_path(request, source_checkpoint) is not None
        engine_config = trtllm.trtllm_engine_config(
            checkpoint, plan, limits, _trtllm_options(request), served_model_name=name, source=request.source,
            version=trtllm.check_toolchain(plan), checkpoint_hash="",
            xgrammar_tokenizer_info=model.engine_dir(version) / XGRAMMAR_INFO_FILE if has_info else None,
        )
    else:
        dtype = request.dtype or "float32"
        if dtype not in DTYPES:
            raise BuildError(f"--dtype {dtype} is not supported by the CPU engine; use one of {', '.join(DTYPES)}")
        engine_config = cpu_engine_config(checkpoint, served_model_name=name, dtype=dtype,
                                          weights=request.weights or "float32", limits=limits,
                                          source=request.source, kv_cache_tokens=request.kv_cache_tokens)
    config_text = version_config(template_dir, request, engine_config, model, version)
    first = not (model.directory / model_store.STATE_FILE).is_file()
    if not first:
        _refuse_config_change(model, config_text)

    if staging.exists():
        shutil.rmtree(staging)
    try:
        staging.mkdir(parents=True)
        ignore = shutil.ignore_patterns(*TRTLLM_WEIGHT_FILES) if plan is not None else None
        shutil.copytree(source_checkpoint.directory, staging / model_store.CHECKPOINT_DIR, ignore=ignore)
        if plan is not None:
            trtllm.run_build(plan)
            built_by = trtllm.engine_version(plan.engine_dir)
            if built_by is not None and built_by != engine_config["tensorrt_llm_version"]:
                raise BuildError(f"trtllm-build wrote TensorRT-LLM version {built_by} into {plan.engine_dir}/"
                                 f"config.json, but the installed package is {engine_config['tensorrt_llm_version']}")
            if engine_config["xgrammar_tokenizer_info"]:  # after run_build, which clears the engine folder
                write_tokenizer_info(source_checkpoint.directory, plan.engine_dir / XGRAMMAR_INFO_FILE)
        else:
            shutil.copy2(template_dir / "tensorrt_llm" / "1" / "model.py", staging / "model.py")
            if engine_config["weights"] == "int8":
                write_int8_weights(source_checkpoint.directory, staging / model_store.ENGINE_DIR)
        engine_config.update(
            name=name,
            model_version=version,
            # Of the checkpoint the engine was built from, weights included (a TensorRT-LLM version's copy has none).
            checkpoint_sha256=trtllm.checkpoint_sha256(source_checkpoint.directory),
            built_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            build_flags={f: getattr(request, f) for f in _BUILD_FLAGS if getattr(request, f) is not None},
        )
        write_engine_config(staging / model_store.ENGINE_DIR, engine_config)
        staging.rename(final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if first:
        with model.locked():  # the model's edits, never beside a rollout's (model_store.py)
            # The state file last: it is what makes the model "managed" (model_store.managed_models).
            model_store.write_atomically(model.config_path, config_text)
            model.point_live_link(version)
            model.commit(live=version, previous=None)
    # prune() takes the lock itself, and spares what a rollout in progress names.
    return VersionResult(name, version, final, model.live_version, model.prune(keep_versions))

