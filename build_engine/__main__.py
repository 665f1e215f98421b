"""Command line: ``python -m build_engine [--preset tiny|small | --model DIR] [--backend cpu|trtllm] ...``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from build_engine import trtllm
from build_engine.cpu_engine_builder import DTYPES, WEIGHT_FORMATS
from build_engine.demo_checkpoint import PRESETS
from build_engine.errors import BuildError
from build_engine.model_store import DEFAULT_KEEP_VERSIONS, ModelStoreError
from build_engine.pipeline import (
    DEFAULT_PRESET,
    BuildRequest,
    VersionResult,
    build,
    build_version,
    dry_run,
    existing_build,
    existing_version,
)

EXIT_USAGE = 2
# The multinode overlay's GPUs per pod (deploy/kubernetes/overlays/multinode: the leader's launcher.mpi reads it,
# and the engine Job gets the same value), the engine's --gpus_per_node.
GPUS_PER_POD_ENV = "MPI_LWS_GPUS_PER_POD"


def gpus_per_pod() -> int:
    """The default --gpus-per-node: $MPI_LWS_GPUS_PER_POD when set, else trtllm-build's own default."""
    value = os.environ.get(GPUS_PER_POD_ENV, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else trtllm.DEFAULT_GPUS_PER_NODE


def parse_args(argv: list[str] | None) -> tuple[BuildRequest, bool, bool, argparse.Namespace]:
    """Parse the command line into a request, the --if-missing flag, the --dry-run flag and the rest
    (--name, --keep-versions)."""
    parser = argparse.ArgumentParser(
        prog="python -m build_engine",
        description="Turn a checkpoint into an engine and a rendered Triton model repository.",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--preset", choices=sorted(PRESETS), help=f"generate a demo checkpoint (default: {DEFAULT_PRESET})"
    )
    source.add_argument("--model", type=Path, help="a local Hugging Face causal-LM checkpoint directory")
    parser.add_argument("--backend", choices=("cpu", "trtllm"), default="cpu")
    parser.add_argument("--output-dir", type=Path, default=Path("build"), help="build folder (default: build)")
    parser.add_argument(
        "--dtype",
        choices=sorted({*DTYPES, *trtllm.TRTLLM_DTYPES}),
        help="compute dtype (cpu: float32 (default) or bfloat16; trtllm: auto (the checkpoint's, default), "
        "float16 or bfloat16)",
    )
    parser.add_argument(
        "--weights",
        choices=WEIGHT_FORMATS,
        help="cpu: the projections' weights: float32 (the checkpoint's, default) or int8 (weight-only, one scale "
        "per output channel, quantized at build time into the engine directory)",
    )
    parser.add_argument(
        "--max-batch-size", type=int, help="concurrent sequences (default: cpu 16 tiny, else 32; trtllm 64)"
    )
    parser.add_argument(
        "--max-seq-len",
        type=int,
        help="prompt + output tokens per sequence (default: min(context, 2048); trtllm min(context, 8192))",
    )
    parser.add_argument(
        "--max-num-tokens",
        type=int,
        help="tokens per engine step, prompt chunks included (default: cpu 512, trtllm 8192)",
    )
    parser.add_argument(
        "--kv-cache-tokens",
        type=int,
        help="cpu: tokens the paged KV cache holds, shared by all sequences (default: max-batch-size x "
        "max-seq-len)",
    )
    trt = parser.add_argument_group("TensorRT-LLM (--backend trtllm)")
    trt.add_argument("--max-input-len", type=int, help="longest prompt (default: max-seq-len - 1)")
    trt.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size = GPUs per engine (default: 1)")
    trt.add_argument("--pp-size", type=int, default=1,
                     help="pipeline-parallel stages (default: 1); the engine's world size is TP x PP")
    trt.add_argument("--gpus-per-node", type=int, default=gpus_per_pod(),
                     help="GPUs per node the engine runs on (rank r uses GPU r %% this); default: "
                          f"${GPUS_PER_POD_ENV} (the multinode overlay's GPUs per pod), else "
                          f"{trtllm.DEFAULT_GPUS_PER_NODE}")
    trt.add_argument("--weight-only", choices=trtllm.WEIGHT_ONLY, help="weight-only quantization")
    trt.add_argument("--kv-cache-dtype", choices=trtllm.KV_CACHE_DTYPES, help="quantized KV cache (Llama/Mistral)")
    trt.add_argument("--max-lora-rank", type=int, default=0,
                     help="build with the LoRA plugin for adapters up to this rank (default: 0, no LoRA)")
    trt.add_argument("--lora-target-modules", nargs="+", default=list(trtllm.LORA_TARGET_MODULES),
                     help=f"TensorRT-LLM modules adapters may target (default: {' '.join(trtllm.LORA_TARGET_MODULES)})")
    trt.add_argument(
        "--trtllm-examples-dir",
        type=Path,
        default=trtllm.DEFAULT_EXAMPLES_DIR,
        help="TensorRT-LLM's examples folder (default: $TRTLLM_EXAMPLES_DIR or /app/examples, as in the NGC image)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="trtllm: print the commands the build would run, shell-quoted, and render the model repository "
        "it would serve into OUTPUT_DIR/model_repository; builds nothing",
    )
    parser.add_argument(
        "--if-missing", action="store_true", help="do nothing if a matching engine is already built"
    )
    parser.add_argument(
        "--name",
        help="build the next numbered version of the named model OUTPUT_DIR/models/NAME (engine model only; "
        "it goes live only on the model's first build, later ones by a rollout)",
    )
    parser.add_argument(
        "--keep-versions",
        type=int,
        help=f"with --name: versions of the model kept on disk; older ones are deleted, never the live one "
        f"nor its rollback target (default: {DEFAULT_KEEP_VERSIONS})",
    )
    args = parser.parse_args(argv)
    if args.keep_versions is not None and args.name is None:
        parser.error("--keep-versions needs --name")
    request = BuildRequest(
        output_dir=args.output_dir,
        backend=args.backend,
        preset=args.preset,
        model=args.model,
        dtype=args.dtype,
        weights=args.weights,
        max_batch_size=args.max_batch_size,
        max_seq_len=args.max_seq_len,
        max_num_tokens=args.max_num_tokens,
        kv_cache_tokens=args.kv_cache_tokens,
        max_input_len=args.max_input_len,
        tp_size=args.tp_size,
        pp_size=args.pp_size,
        gpus_per_node=args.gpus_per_node,
        weight_only=args.weight_only,
        kv_cache_dtype=args.kv_cache_dtype,
        max_lora_rank=args.max_lora_rank,
        lora_target_modules=tuple(args.lora_target_modules),
        trtllm_examples_dir=args.trtllm_examples_dir,
    )
    return request, args.if_missing, args.dry_run, args


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2 for anything the user must fix)."""
    request, if_missing, dry, args = parse_args(argv)
    if args.name is not None:
        return _main_named(request, if_missing, dry, args.name, args.keep_versions)
    try:
        if dry:
            sys.stdout.write(trtllm.format_commands(dry_run(request).commands))
            print(f"model repository (rendered, not servable until built): {request.repository_dir}",
                  file=sys.stderr)
            return 0
        if if_missing:
            existing = existing_build(request)
            if existing is not None:
                print(f"engine already built at {existing.engine_dir} (model {existing.served_model_name!r})")
                return 0
        result = build(request)
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"engine:           {result.engine_dir}")
    print(f"model repository: {result.repository_dir}")
    print(f"served model:     {result.served_model_name}")
    return 0


def _main_named(request: BuildRequest, if_missing: bool, dry: bool, name: str, keep_versions: int | None) -> int:
    try:
        if dry:
            raise BuildError("--dry-run does not take --name: run the dry run without --name (and with another "
                             "--output-dir) to see the commands and the config a version would be built with")
        if if_missing:
            version = existing_version(request, name)
            if version is not None:
                print(f"model {name!r} version {version} already built from {request.source}")
                return 0
        result = build_version(request, name, DEFAULT_KEEP_VERSIONS if keep_versions is None else keep_versions)
    except (BuildError, ModelStoreError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    _print_version(result)
    return 0


def _print_version(result: VersionResult) -> None:
    if result.version == result.live_version:
        state = (f"(live: `make serve` serves it; a server already running takes it in with "
                 f"`make rollout NAME={result.name}`)")
    else:
        state = (f"(on disk; live: {result.live_version}) — roll it out with "
                 f"`make rollout NAME={result.name} VERSION={result.version}`")
    print(f"model:            {result.name}")
    print(f"version:          {result.version} {state}")
    print(f"version dir:      {result.version_dir}")
    if result.pruned:
        print(f"pruned versions:  {', '.join(str(v) for v in result.pruned)}")


if __name__ == "__main__":
    sys.exit(main())
