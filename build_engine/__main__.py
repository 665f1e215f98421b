"""Command line: ``python -m build_engine [--preset tiny|small | --model DIR] [--backend cpu|trtllm] ...``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from build_engine.cpu_engine_builder import DTYPES
from build_engine.demo_checkpoint import PRESETS
from build_engine.errors import BuildError
from build_engine.pipeline import DEFAULT_PRESET, BuildRequest, build, existing_build

EXIT_USAGE = 2


def parse_args(argv: list[str] | None) -> tuple[BuildRequest, bool]:
    """Parse the command line into a request and the --if-missing flag."""
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
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="CPU engine compute dtype")
    parser.add_argument("--max-batch-size", type=int, help="concurrent sequences (default: 16 tiny, else 32)")
    parser.add_argument(
        "--max-seq-len", type=int, help="prompt + output tokens per sequence (default: min(context, 2048))"
    )
    parser.add_argument(
        "--max-num-tokens", type=int, help="tokens per engine step, prompt chunks included (default: 512)"
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
    )
    return request, args.if_missing


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2 for anything the user must fix)."""
    request, if_missing = parse_args(argv)
    try:
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
