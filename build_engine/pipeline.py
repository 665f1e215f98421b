"""One build, start to finish: checkpoint -> engine -> rendered model repository."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from build_engine.checkpoint import validate_checkpoint
from build_engine.cpu_engine_builder import ENGINE_CONFIG_FILE, cpu_engine_config, write_engine_config
from build_engine.demo_checkpoint import ensure_demo_checkpoint
from build_engine.errors import BuildError
from build_engine.limits import resolve_limits
from build_engine.render import render_repository
from build_engine.values import repository_values

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "model_repository"
DEFAULT_PRESET = "small"
TRTLLM_NOT_IMPLEMENTED = (
    "the TensorRT-LLM backend build is not implemented yet (tracked separately); use --backend cpu"
)


@dataclass(frozen=True)
class BuildRequest:
    """What to build. ``preset`` and ``model`` are None unless given explicitly (at most one of them)."""

    output_dir: Path
    backend: str = "cpu"
    preset: str | None = None
    model: Path | None = None
    dtype: str = "float32"
    max_batch_size: int | None = None
    max_seq_len: int | None = None
    max_num_tokens: int | None = None

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
    return BuildResult(
        request.engine_dir.resolve(), request.repository_dir.resolve(), config["served_model_name"]
    )


def build(request: BuildRequest, template_dir: Path = TEMPLATE_DIR) -> BuildResult:
    """Build the engine and render the model repository described by ``request``."""
    if request.backend == "trtllm":
        raise BuildError(TRTLLM_NOT_IMPLEMENTED)
    if request.backend != "cpu":
        raise BuildError(f"unknown backend {request.backend!r}; use --backend cpu")
    if request.model is not None and request.preset is not None:
        raise BuildError("give either --model or --preset, not both")

    if request.model is not None:
        checkpoint = validate_checkpoint(request.model)
        served_model_name = checkpoint.directory.name
    else:
        preset = request.preset or DEFAULT_PRESET
        checkpoint = validate_checkpoint(ensure_demo_checkpoint(request.output_dir, preset))
        served_model_name = f"demo-{preset}"
    limits = resolve_limits(
        max_position_embeddings=checkpoint.max_position_embeddings,
        preset=None if request.model is not None else (request.preset or DEFAULT_PRESET),
        max_batch_size=request.max_batch_size,
        max_seq_len=request.max_seq_len,
        max_num_tokens=request.max_num_tokens,
    )
    engine_config = cpu_engine_config(
        checkpoint,
        served_model_name=served_model_name,
        dtype=request.dtype,
        limits=limits,
        source=request.source,
    )
    values = repository_values(template_dir, request.backend, engine_config, request.engine_dir)
    render_repository(template_dir, values, request.repository_dir)
    # Written last, so a failed render never leaves an engine that --if-missing would accept.
    write_engine_config(request.engine_dir, engine_config)
    return BuildResult(request.engine_dir.resolve(), request.repository_dir.resolve(), served_model_name)
