"""Command line: ``python -m build_engine [--preset tiny|small | --model DIR] [--backend cpu|trtllm] ...``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from build_engine import trtllm
from build_engine.cpu_engine_builder import DTYPES
from build_engine.demo_checkpoint import PRESETS
from build_engine.errors import BuildError
from build_engine.pipeline import DEFAULT_PRESET, BuildRequest, build, dry_run, existing_build

EXIT_USAGE = 2


def parse_args(argv: list[str] | None) -> tuple[BuildRequest, bool, bool]:
    """Parse the command line into a request, the --if-missing flag and the --dry-run flag."""
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
    trt.add_argument("--weight-only", choices=trtllm.WEIGHT_ONLY, help="weight-only quantization")
    trt.add_argument("--kv-cache-dtype", choices=trtllm.KV_CACHE_DTYPES, help="quantized KV cache (Llama/Mistral)")
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
    args = parser.parse_args(argv)
    request = BuildRequest(
        output_dir=args.output_dir,
        backend=args.backend,
        preset=args.preset,
        model=args.model,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        max_seq_len=args.max_seq_len,
        max_num_tokens=args.max_num_tokens,
        kv_cache_tokens=args.kv_cache_tokens,
        max_input_len=args.max_input_len,
        tp_size=args.tp_size,
        weight_only=args.weight_only,
        kv_cache_dtype=args.kv_cache_dtype,
        trtllm_examples_dir=args.trtllm_examples_dir,
    )
    return request, args.if_missing, args.dry_run


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2 for anything the user must fix)."""
    request, if_missing, dry = parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
