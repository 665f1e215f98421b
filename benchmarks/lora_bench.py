"""LoRA on the CPU engine: tokens/s of N greedy streams spread over several adapters against N base-model streams,
in the same process, rounds interleaved (the engine's scheduler and runner, no server: what batching adapters
costs, not the stack around it).

    .venv/bin/python -m benchmarks.lora_bench --preset small --streams 16 --adapters 4 --rank 16

Adapters are random, in TensorRT-LLM's lora_weights/lora_config layout (all seven Llama projections), as the
frontend sends them. Prints tokens/s per round and the median ratio (LoRA / base); the issue's bar is >= 0.8.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from build_engine.demo_checkpoint import ensure_demo_checkpoint
from cpu_engine.config import EngineConfig
from cpu_engine.lora import MODULE_IDS, LoraCache
from cpu_engine.runner import LlamaRunner
from cpu_engine.sampling import SamplingParams
from cpu_engine.scheduler import GenerationRequest, Scheduler


class Count:
    def __init__(self) -> None:
        self.tokens = 0

    def send(self, tokens, finish) -> None:
        self.tokens += len(tokens)

    def send_error(self, message: str) -> None:
        raise RuntimeError(message)


def random_adapter(runner: LlamaRunner, rank: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """lora_weights/lora_config of a random adapter on every projection of every layer."""
    rng = np.random.default_rng(seed)
    shapes = runner.lora_shapes
    rows, config = [], []
    for layer in range(shapes.num_layers):
        for name, module_id in MODULE_IDS.items():
            d_in, d_out = shapes.dims[name]
            rows.append(np.concatenate([rng.normal(0, 0.02, rank * d_in), rng.normal(0, 0.02, d_out * rank)]))
            config.append((module_id, layer, rank))
    width = max(len(row) for row in rows)
    weights = np.zeros((len(rows), width), dtype=np.float16)
    for i, row in enumerate(rows):
        weights[i, :len(row)] = row
    return weights, np.array(config, dtype=np.int32)


def run_round(scheduler: Scheduler, adapters: list, streams: int, prompt_len: int, tokens: int) -> tuple[float, float]:
    """Tokens per second of wall time and per CPU second of this process (the figure to compare on a machine
    shared with other work) of `streams` requests (request i through adapters[i % len] when there are any)."""
    sinks = [Count() for _ in range(streams)]
    for i, sink in enumerate(sinks):
        prompt = [(31 * i + 7 * j) % 1000 + 3 for j in range(prompt_len)]
        scheduler.add(GenerationRequest(f"r{i}", prompt, tokens, sink, SamplingParams(temperature=0.0),
                                        lora=adapters[i % len(adapters)] if adapters else None))
    started, cpu = time.perf_counter(), time.process_time()
    while scheduler.has_work:
        scheduler.step()
    total = sum(s.tokens for s in sinks)
    return total / (time.perf_counter() - started), total / (time.process_time() - cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per stream")
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens per stream")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--int8", action="store_true", help="the int8 weight format (built once under build/bench)")
    parser.add_argument("--threads", type=int, default=1, help="torch and numba threads (default 1)")
    args = parser.parse_args()
    import numba
    import torch
    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    out = Path("build/bench")
    checkpoint = ensure_demo_checkpoint(out, args.preset)
    int8 = None
    if args.int8:
        from build_engine.cpu_engine_builder import write_int8_weights
        int8 = write_int8_weights(checkpoint, out / f"int8-{args.preset}")
    runner = LlamaRunner(EngineConfig(checkpoint_dir=checkpoint, max_batch_size=args.streams,
                                      max_seq_len=args.prompt + args.tokens + 8, int8_weights=int8))
    cache = LoraCache(runner.lora_shapes, 1 << 32, max_rank=args.rank)
    adapters = [cache.resolve(i + 1, *random_adapter(runner, args.rank, i)) for i in range(args.adapters)]
    scheduler = Scheduler(runner, max_num_tokens=512, enable_prefix_reuse=False)
    run_round(scheduler, [], args.streams, args.prompt, 4)  # warm-up: kernels compiled or loaded
    run_round(scheduler, adapters, args.streams, args.prompt, 4)
    base, lora = [], []
    for round_ in range(args.rounds):
        base.append(run_round(scheduler, [], args.streams, args.prompt, args.tokens))
        lora.append(run_round(scheduler, adapters, args.streams, args.prompt, args.tokens))
        print(f"round {round_ + 1}: base {base[-1][0]:.1f} tok/s ({base[-1][1]:.1f} per CPU s), {args.adapters} "
              f"adapters {lora[-1][0]:.1f} tok/s ({lora[-1][1]:.1f} per CPU s)", flush=True)
    for i, what in enumerate(("wall", "CPU")):
        b, a = statistics.median(r[i] for r in base), statistics.median(r[i] for r in lora)
        print(f"{args.preset} {'int8' if args.int8 else 'float32'}, {args.streams} streams, rank {args.rank}, "
              f"{what} time: base {b:.1f} tok/s, over {args.adapters} adapters {a:.1f} tok/s: {a / b:.2f}x")

if __name__ == "__main__":
    main()
