"""What guided decoding costs the CPU engine: tokens/s at batch 16, every sequence guided by a JSON schema,
against the same batch unguided.

    python -m benchmarks.guided_bench [--preset small] [--output-dir build] [--tokens 128] [--runs 3]

Engine level (the scheduler and its sampler, no server): 16 requests with the same prompts and sampling
(temperature 1, seeded; `--greedy`: greedy) generate `--tokens` tokens each, once with a JSON schema guide
(cpu_engine.guided, xgrammar) and once without. The schema asks for an array of exactly 12 records, far
more than `--tokens`, so that guided sequences run to the same length as the unguided ones and both runs do
the same work apart from the guidance (per step: 16 matcher updates and mask fills, the masks applied to
the logits). The figure is output tokens over the wall time from the first step to the last (prefill
included, the same in both); each side is the best of `--runs` runs, alternated, since a shared machine
only ever slows a run down.

Sampling sorts each row's logits; a guided row's are mostly -inf after its mask and sort faster, which can
make the guided side the faster one (markedly on `tiny`, where the sampler costs more than the forward);
`--greedy` leaves the sort out, so what remains of the difference is the guidance's own cost. `--threads 1`
gives steadier figures on a machine shared with other work. The demo checkpoint of `--preset` is generated
under `--output-dir` if missing.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from build_engine.demo_checkpoint import ensure_demo_checkpoint
from cpu_engine.config import EngineConfig
from cpu_engine.engine import configure_threads
from cpu_engine.guided import GuideCompiler
from cpu_engine.runner import LlamaRunner
from cpu_engine.sampling import SampledToken, SamplingParams
from cpu_engine.scheduler import FinishReason, GenerationRequest, Scheduler

BATCH = 16
RECORD = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "role", "tags", "address"],
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                    "properties": {"city": {"type": "string", "maxLength": 12},
                                   "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}}},
        "active": {"type": "boolean"},
    },
}
SCHEMA = {"type": "array", "items": RECORD, "minItems": 12, "maxItems": 12}


class CountingSink:
    def __init__(self) -> None:
        self.tokens = 0
        self.finish: FinishReason | None = None
        self.error: str | None = None

    def send(self, tokens: list[SampledToken], finish: FinishReason | None) -> None:
        self.tokens += len(tokens)
        self.finish = finish or self.finish

    def send_error(self, message: str) -> None:
        self.error = message


@torch.inference_mode()
def tokens_per_s(runner: LlamaRunner, prompts: list[list[int]], tokens: int, guide, end_id: int | None,
                 greedy: bool = False) -> float:
    scheduler = Scheduler(runner, max_num_tokens=512)
    requests = [GenerationRequest(f"b{i}", prompt, tokens, CountingSink(),
                                  SamplingParams(temperature=0.0) if greedy else
                                  SamplingParams(temperature=1.0, top_p=1.0, seed=i), end_id=end_id, guide=guide)
                for i, prompt in enumerate(prompts)]
    for request in requests:
        scheduler.add(request)
    start = time.perf_counter()
    while scheduler.has_work:
        scheduler.step()
    elapsed = time.perf_counter() - start
    for request in requests:  # both sides must do the same work: every sequence runs to `tokens`
        sink = request.sink
        if sink.error or sink.finish is not FinishReason.LENGTH or sink.tokens != tokens:
            raise RuntimeError(f"request {request.request_id} ended early ({sink.finish}, {sink.tokens} tokens, "
                               f"{sink.error}): the comparison would not be like for like")
    return BATCH * tokens / elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--output-dir", type=Path, default=Path("build"), help="where the demo checkpoint lives")
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per sequence")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: every core, as the engine)")
    parser.add_argument("--greedy", action="store_true",
                        help="greedy decoding instead of sampling at temperature 1 (no sort in the sampler: the "
                             "guidance's own cost stands out)")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    threads = configure_threads(args.threads)
    checkpoint = ensure_demo_checkpoint(args.output_dir, args.preset)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    runner = LlamaRunner(EngineConfig(checkpoint_dir=checkpoint, max_batch_size=BATCH, max_seq_len=512,
                                      max_num_tokens=512))
    compiler = GuideCompiler(tokenizer, runner.vocab_size)
    started = time.perf_counter()
    guide = compiler.compile("json_schema", json.dumps(SCHEMA))
    compile_ms = (time.perf_counter() - started) * 1000
    prompts = [tokenizer.encode(f"<|im_start|>user\nrecord {i} as JSON<|im_end|>\n<|im_start|>assistant\n")
               for i in range(BATCH)]
    print(f"demo {args.preset} ({checkpoint}), batch {BATCH}, {args.tokens} tokens each, "
          f"{'greedy' if args.greedy else 'sampling at temperature 1'}, torch threads {threads}; "
          f"schema compiled in {compile_ms:.1f} ms", flush=True)

    # Unguided: ignore_eos (random weights may draw the end token at once); guided: the schema cannot end sooner.
    tokens_per_s(runner, prompts, 8, None, None)  # warm-up (and xgrammar's first masks)
    tokens_per_s(runner, prompts, 8, guide, tokenizer.eos_token_id)
    unguided_runs, guided_runs = [], []
    for run in range(args.runs):
        unguided_runs.append(tokens_per_s(runner, prompts, args.tokens, None, None, args.greedy))
        guided_runs.append(tokens_per_s(runner, prompts, args.tokens, guide, tokenizer.eos_token_id, args.greedy))
        print(f"  run {run + 1}: unguided {unguided_runs[-1]:.1f} tok/s, guided {guided_runs[-1]:.1f} tok/s",
              flush=True)
    unguided, guided = max(unguided_runs), max(guided_runs)
    print(f"unguided: {unguided:.1f} tok/s")
    print(f"guided (JSON schema, every sequence): {guided:.1f} tok/s")
    print(f"ratio guided/unguided: {guided / unguided:.3f}")


if __name__ == "__main__":
    main()
