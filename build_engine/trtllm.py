"""TensorRT-LLM engine build: HF checkpoint -> TRT-LLM checkpoint (convert_checkpoint.py) -> engine (trtllm-build).

The build is planned as plain argv lists first (:func:`plan_build`); ``--dry-run`` prints them shell-quoted
and a real build runs the very same lists with ``subprocess`` (:func:`run_build`). Planning needs neither
TensorRT-LLM nor a GPU, which is what lets CPU CI check the exact commands.

Pinned to the TensorRT-LLM 1.1 engine flow (the ``nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3``
image, see docker/Dockerfile.trtllm): later releases removed ``trtllm-build`` and ``convert_checkpoint.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from build_engine.checkpoint import CheckpointInfo
from build_engine.errors import BuildError
from build_engine.limits import EngineLimits
from launcher.engine_check import installed_trtllm_version as installed_version

# Where the NGC tritonserver trtllm image keeps TensorRT-LLM's examples; override for other layouts.
DEFAULT_EXAMPLES_DIR = Path(os.environ.get("TRTLLM_EXAMPLES_DIR", "/app/examples"))
TRTLLM_BUILD = "trtllm-build"

# Hugging Face architecture -> the directory under examples/models/core/ whose convert_checkpoint.py
# handles it (TensorRT-LLM maps MistralForCausalLM onto its LLaMA model).
FAMILIES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen",
}
# Families whose convert_checkpoint.py has --fp8_kv_cache (qwen's only has --int8_kv_cache).
FP8_KV_CACHE_FAMILIES = frozenset({"llama"})

TRTLLM_DTYPES = ("auto", "float16", "bfloat16")
WEIGHT_ONLY = ("int8", "int4")
KV_CACHE_DTYPES = ("fp8",)
# LoRA (--max-lora-rank): TensorRT-LLM's names of the Llama projections PEFT adapters target (q/k/v/o, gate, down,
# up; frontend/models/lora.py TRTLLM_MODULES), all by default.
LORA_TARGET_MODULES = ("attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_4h_to_h", "mlp_gate")

# Defaults sized for a GPU (the shared CPU defaults are smaller); all are overridable on the command line.
DEFAULT_MAX_BATCH_SIZE = 64
DEFAULT_MAX_SEQ_LEN_CAP = 8192
DEFAULT_MAX_NUM_TOKENS = 8192

CHECKPOINT_SUBDIR = "trtllm_checkpoint"
DEFAULT_GPUS_PER_NODE = 8  # trtllm-build's own default (--gpus_per_node)


@dataclass(frozen=True)
class TrtllmOptions:
    """TensorRT-LLM specific build settings (the limits are shared with the CPU engine)."""

    dtype: str = "auto"
    tp_size: int = 1
    pp_size: int = 1  # pipeline stages (world size = TP x PP): TP within a node, PP across nodes
    # The engine's gpus_per_node: at run time rank r uses GPU r % gpus_per_node of its node (WorldConfig::mpi),
    # so it must be the GPUs per pod of a multi-node deployment (MPI_LWS_GPUS_PER_POD, __main__.py).
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    weight_only: str | None = None
    kv_cache_dtype: str | None = None
    max_input_len: int | None = None
    examples_dir: Path = DEFAULT_EXAMPLES_DIR
    max_lora_rank: int = 0  # > 0: the engine takes LoRA adapters up to this rank (the LoRA plugin)
    lora_target_modules: tuple[str, ...] = LORA_TARGET_MODULES


@dataclass(frozen=True)
class TrtllmPlan:
    """Everything a build does, decided before anything runs."""

    family: str
    dtype: str
    max_input_len: int
    checkpoint_dir: Path  # the intermediate TRT-LLM checkpoint
    engine_dir: Path
    commands: list[list[str]] = field(default_factory=list)

    def shell_lines(self) -> list[str]:
        return [shlex.join(command) for command in self.commands]


def model_family(checkpoint: CheckpointInfo) -> str:
    """The convert_checkpoint.py family for the checkpoint's architecture; refuses unknown ones."""
    family = FAMILIES.get(checkpoint.architecture)
    if family is None:
        supported = ", ".join(sorted(FAMILIES))
        raise BuildError(
            f"{checkpoint.directory}: architecture {checkpoint.architecture} is not supported by the "
            f"TensorRT-LLM build (supported: {supported}); use --backend cpu to serve it on the CPU engine"
        )
    return family


def checkpoint_dtype(directory: Path) -> str:
    """The model dtype TensorRT-LLM will build in: the checkpoint's, with float32 mapped to float16.

    This is what convert_checkpoint.py's ``--dtype auto`` does; resolving it here lets the gemm and
    attention plugins be given the same dtype explicitly.
    """
    config = json.loads((Path(directory) / "config.json").read_text())
    declared = config.get("torch_dtype") or config.get("dtype") or "float16"
    return {"bfloat16": "bfloat16", "float16": "float16", "half": "float16"}.get(str(declared), "float16")


def plan_build(
    checkpoint: CheckpointInfo,
    limits: EngineLimits,
    options: TrtllmOptions,
    *,
    work_dir: Path,
    engine_dir: Path,
    python: str | None = None,
) -> TrtllmPlan:
    """The convert + build commands for ``checkpoint``; pure: nothing is run or written."""
    family = model_family(checkpoint)
    if options.dtype not in TRTLLM_DTYPES:
        raise BuildError(f"--dtype {options.dtype} is not valid for TensorRT-LLM; use one of {TRTLLM_DTYPES}")
    dtype = checkpoint_dtype(checkpoint.directory) if options.dtype == "auto" else options.dtype
    if options.tp_size < 1:
        raise BuildError(f"--tp-size must be at least 1, got {options.tp_size}")
    if options.pp_size < 1:
        raise BuildError(f"--pp-size must be at least 1, got {options.pp_size}")
    if options.gpus_per_node < 1:
        raise BuildError(f"--gpus-per-node must be at least 1, got {options.gpus_per_node}")
    if options.weight_only is not None and options.weight_only not in WEIGHT_ONLY:
        raise BuildError(f"--weight-only must be one of {WEIGHT_ONLY}, got {options.weight_only!r}")
    if options.kv_cache_dtype is not None:
        if options.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise BuildError(f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES}, got {options.kv_cache_dtype!r}")
        if family not in FP8_KV_CACHE_FAMILIES:
            raise BuildError(
                f"--kv-cache-dtype fp8 is not supported for {checkpoint.architecture}: its convert_checkpoint.py "
                "has no --fp8_kv_cache (quantize with TensorRT-LLM's examples/quantization/quantize.py instead)"
            )
    max_input_len = options.max_input_len if options.max_input_len is not None else limits.max_seq_len - 1
    if not 1 <= max_input_len < limits.max_seq_len:
        raise BuildError(
            f"--max-input-len must be between 1 and --max-seq-len - 1 ({limits.max_seq_len - 1}), got {max_input_len}"
        )

    work_dir = Path(work_dir).resolve()
    engine_dir = Path(engine_dir).resolve()
    trt_checkpoint = work_dir / CHECKPOINT_SUBDIR
    script = Path(options.examples_dir) / "models" / "core" / family / "convert_checkpoint.py"
    convert = [
        python or sys.executable,
        str(script),
        "--model_dir", str(checkpoint.directory),
        "--output_dir", str(trt_checkpoint),
        "--dtype", dtype,
        "--tp_size", str(options.tp_size),
        "--pp_size", str(options.pp_size),
    ]
    if options.weight_only is not None:
        convert += ["--use_weight_only", "--weight_only_precision", options.weight_only]
    if options.kv_cache_dtype == "fp8":
        convert += ["--fp8_kv_cache"]
    build = [
        TRTLLM_BUILD,
        "--checkpoint_dir", str(trt_checkpoint),
        "--output_dir", str(engine_dir),
        # In-flight batching needs a paged KV cache and packed (unpadded) inputs; paged context FMHA is
        # what KV-cache reuse and chunked context (both enabled in values/trtllm.json) run on.
        "--kv_cache_type", "paged",
        "--remove_input_padding", "enable",
        "--context_fmha", "enable",
        "--use_paged_context_fmha", "enable",
        "--gpt_attention_plugin", dtype,
        "--gemm_plugin", dtype,
        "--max_batch_size", str(limits.max_batch_size),
        "--max_input_len", str(max_input_len),
        "--max_seq_len", str(limits.max_seq_len),
        "--max_num_tokens", str(limits.max_num_tokens),
        "--max_beam_width", "1",
        # trtllm-build puts rank r's build on GPU r % workers: one worker per GPU of one node (the Job's TP_SIZE
        # GPUs), whatever the number of pipeline stages.
        "--workers", str(options.tp_size),
        "--gpus_per_node", str(options.gpus_per_node),
    ]
    if options.max_lora_rank:
        unknown = sorted(set(options.lora_target_modules) - set(LORA_TARGET_MODULES))
        if unknown or not options.lora_target_modules:
            raise BuildError(f"--lora-target-modules must be among {' '.join(LORA_TARGET_MODULES)}; got "
                             f"{' '.join(options.lora_target_modules) or 'none'}")
        build += ["--lora_plugin", dtype, "--max_lora_rank", str(options.max_lora_rank),
                  "--lora_target_modules", *options.lora_target_modules]
    return TrtllmPlan(family, dtype, max_input_len, trt_checkpoint, engine_dir, [convert, build])


# ----- real runs ----------------------------------------------------------------------------------------
def check_toolchain(plan: TrtllmPlan) -> str:
    """Fail before any work unless TensorRT-LLM, trtllm-build and the convert script are all here."""
    version = installed_version()
    problems = []
    if version is None:
        problems.append("the tensorrt_llm Python package is not installed")
    if shutil.which(TRTLLM_BUILD) is None:
        problems.append(f"{TRTLLM_BUILD} is not on PATH")
    script = Path(plan.commands[0][1])
    if not script.is_file():
        problems.append(f"{script} does not exist (set TRTLLM_EXAMPLES_DIR to TensorRT-LLM's examples folder)")
    if problems:
        raise BuildError(
            "cannot build a TensorRT-LLM engine here: " + "; ".join(problems) + ". Run it inside the pinned "
            "image (docker/Dockerfile.trtllm), or use --dry-run to print the commands"
        )
    return version  # type: ignore[return-value]


def checkpoint_sha256(directory: Path) -> str:
    """One hash over every file of the checkpoint (relative path + content), so any change shows."""
    digest = hashlib.sha256()
    root = Path(directory)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        relative = path.relative_to(root).as_posix()
        if relative.startswith(".") or "/." in relative:
            continue
        digest.update(relative.encode() + b"\0")
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()


def run_build(plan: TrtllmPlan) -> None:
    """Run the planned commands (output streams to the console); a failing step stops the build."""
    if plan.engine_dir.exists():
        shutil.rmtree(plan.engine_dir)
    if plan.checkpoint_dir.exists():
        shutil.rmtree(plan.checkpoint_dir)
    for command in plan.commands:
        print(f"+ {shlex.join(command)}", flush=True)
        result = subprocess.run(command, check=False)
        if result.returncode != 0:
            raise BuildError(f"{Path(command[0]).name} step failed with exit code {result.returncode}: "
                             f"{shlex.join(command)}")
    # The intermediate checkpoint is a full copy of the weights; the engine is all that is served.
    shutil.rmtree(plan.checkpoint_dir, ignore_errors=True)


def engine_version(engine_dir: Path) -> str | None:
    """The version trtllm-build wrote into the engine's own config.json, if it did."""
    try:
        value = json.loads((Path(engine_dir) / "config.json").read_text()).get("version")
    except (OSError, ValueError, AttributeError):
        return None
    return str(value) if value else None


def trtllm_engine_config(
    checkpoint: CheckpointInfo,
    plan: TrtllmPlan,
    limits: EngineLimits,
    options: TrtllmOptions,
    *,
    served_model_name: str,
    source: Mapping[str, str],
    version: str,
    checkpoint_hash: str,
    xgrammar_tokenizer_info: Path | None,
) -> dict[str, Any]:
    """The content of ``engine_config.json`` for a TensorRT-LLM engine (read by the launcher's check)."""
    return {
        "backend": "trtllm",
        "checkpoint_dir": str(checkpoint.directory),
        "checkpoint_sha256": checkpoint_hash,
        "served_model_name": served_model_name,
        "architecture": checkpoint.architecture,
        "family": plan.family,
        "dtype": plan.dtype,
        "max_batch_size": limits.max_batch_size,
        "max_input_len": plan.max_input_len,
        "max_seq_len": limits.max_seq_len,
        "max_num_tokens": limits.max_num_tokens,
        "tp_size": options.tp_size,
        "pp_size": options.pp_size,
        "world_size": options.tp_size * options.pp_size,  # launcher.mpi runs one rank per GPU
        "weight_only": options.weight_only,
        "kv_cache_dtype": options.kv_cache_dtype,
        "max_lora_rank": options.max_lora_rank or None,
        "lora_target_modules": list(options.lora_target_modules) if options.max_lora_rank else None,
        "source": dict(source),
        "tensorrt_llm_version": version,
        "commands": [list(command) for command in plan.commands],
        # The guided-decoding tokenizer description (build_engine/xgrammar_info.py); None: not available.
        "xgrammar_tokenizer_info": str(Path(xgrammar_tokenizer_info).resolve()) if xgrammar_tokenizer_info else None,
    }


def format_commands(commands: Sequence[Sequence[str]]) -> str:
    """The dry-run output: one shell-quoted command per line."""
    return "".join(shlex.join(list(command)) + "\n" for command in commands)
