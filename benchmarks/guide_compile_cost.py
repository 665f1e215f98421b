"""What compiling a guide costs on the GPU path, as far as the frontend can measure it (audit round 3, R3).

TensorRT-LLM compiles each request's guide inside its executor loop (guidedDecoder.cpp GuidedDecoder::build),
with a `GrammarCompiler(tokenizerInfo)` at its defaults: the full-vocabulary token-mask cache is built per
schema, and every distinct compiled grammar is kept (cache_enabled, max_memory_bytes -1). The frontend's own
check (frontend/planning/guide_check.py) compiles without the tokenizer. This measures the tokenizer step the
frontend skips: per schema (the tool schemas the tests send, each as `tool_choice` named and required builds
it), the compile time and the compiled grammar's bytes, with the tokenizer info built the way TensorRT-LLM
reads it (build_engine/xgrammar_info.py: encoded vocab, vocab type, stop ids).

    .venv/bin/python -m benchmarks.guide_compile_cost [--preset small] [--repeat 5] [--vocab 128256]

xgrammar here is the CPU engine's (0.2.9); the GPU image runs 0.1.25. The demo vocabularies are small (tiny
~2k, small 4096 ids); a GPU model's is 32k-150k, and the mask cache grows with it (see README, "Guided decoding
on TensorRT-LLM"). `--vocab N` pads the demo vocabulary to N ids with synthetic merges (pairs of demo tokens,
as BPE merges are) to estimate a GPU model's vocabulary: an estimate, not that model's tokenizer.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import xgrammar as xgr

from build_engine.demo_checkpoint import ensure_demo_checkpoint
from build_engine.xgrammar_info import tokenizer_info
from frontend.api_types.request_bodies import ToolDefinition
from frontend.planning.structured import named_tool_guide, required_tools_guide


def test_tool_schemas() -> list[dict[str, Any]]:
    """The tools the integration tests send (chat and Responses)."""
    from tests.integration.test_responses_api import CHAT_WEATHER_TOOL
    from tests.integration.test_structured_output import TOOLS

    return [*TOOLS, CHAT_WEATHER_TOOL]


def guides(tools: list[dict[str, Any]]) -> dict[str, str]:
    """Each guide text the frontend sends for these tools: one per named tool, and the `required` one."""
    definitions = [ToolDefinition.model_validate(tool) for tool in tools]
    out = {f"named {i}: {d.function.name}": named_tool_guide(d).text for i, d in enumerate(definitions)}
    out["required (all tools)"] = required_tools_guide(definitions, parallel=True).text
    return out


def compiler_info(checkpoint: Path, vocab: int = 0) -> xgr.TokenizerInfo:
    """The TokenizerInfo the engine builds from the tokenizer-info JSON (TokenizerInfo::FromVocabAndMetadata),
    padded to `vocab` ids with synthetic merges when that is larger."""
    info = json.loads(json.dumps(tokenizer_info(checkpoint)))
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(info["tokenizer_str"])
    encoded = list(info["encoded_vocab"])
    words = [t for t in encoded if t and not (t.startswith("<") and t.endswith(">"))]
    rng, seen = random.Random(0), set(encoded)
    while len(encoded) < vocab:
        merged = rng.choice(words) + rng.choice(words)
        if merged not in seen:
            seen.add(merged)
            encoded.append(merged)
    return xgr.TokenizerInfo(encoded, metadata["vocab_type"], stop_token_ids=info["stop_token_ids"],
                             add_prefix_space=metadata["add_prefix_space"])


def measure(info: xgr.TokenizerInfo, text: str, repeat: int) -> tuple[float, float, int]:
    """Median and max seconds of a cold compile (a fresh compiler each time, as a distinct schema meets the
    engine's cache), and the compiled grammar's bytes."""
    times, size = [], 0
    for _ in range(repeat):
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        started = time.perf_counter()
        compiled = compiler.compile_json_schema(text)  # CompileJSONSchema(guide): TensorRT-LLM's defaults
        times.append(time.perf_counter() - started)
        size = compiled.memory_size_bytes
    return statistics.median(times), max(times), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", help="demo checkpoint preset (tiny, small, qwen-tiny)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=0, help="pad the vocabulary to this many ids (an estimate)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = ensure_demo_checkpoint(Path(scratch), args.preset)
        info = compiler_info(checkpoint, args.vocab)
        print(f"xgrammar {__import__('importlib.metadata').metadata.version('xgrammar')}, demo {args.preset}: "
              f"vocab {info.vocab_size}")
        print(f"{'guide':<28} {'no-tokenizer ms':>15} {'median ms':>10} {'max ms':>8} {'bytes':>11}")
        for name, text in guides(test_tool_schemas()).items():
            started = time.perf_counter()
            xgr.Grammar.from_json_schema(text)  # what the frontend's check compiles (guide_check.py)
            check = time.perf_counter() - started
            median, worst, size = measure(info, text, args.repeat)
            print(f"{name:<28} {check * 1e3:>15.1f} {median * 1e3:>10.1f} {worst * 1e3:>8.1f} {size:>11,}")


if __name__ == "__main__":
    main()
