"""Does torch.compile (Inductor, CPU) speed up the CPU engine's decode step? An experiment, not a path the
engine takes.

The engine's step (cpu_engine/runner.py) is, per layer: RMSNorm, the fused q/k/v projection, rotary, the
paged cache write, decode attention (numba, straight from the block pool), the output projection and the
residual, RMSNorm, the fused gate/up projection, SiLU x up, the down projection and the residual. Between
the projections sit ~10 small elementwise ops per layer, each a separate pass (and at batch 1 a separate
dispatch) in eager mode; Inductor fuses them into a few loops, and that is what it can win. Attention and
the cache writes stay outside the graph (the numba kernel is opaque to Dynamo; an in-place write into the
pool inside a compiled graph risks a copy of the pool), so each layer is two compiled calls around them.

Three variants of the same plain decode steps (batch 1 and 16, a 32-token prompt, the `small` preset):

- `runner`: the engine's own forward (projections on oneDNN, weights packed once at load);
- `eager`: this file's layer functions, not compiled (projections by F.linear on the fused weights);
- `compiled`: the same functions through torch.compile (dynamic batch, one graph shared by every layer:
  the weights are arguments, not constants, so a compile serves all layers and batch sizes).

It prints the compile time (the first compiled step), then wall ms per step, medians of interleaved
rounds, and the ratios. `python -m benchmarks.compile_bench --engine-dir build/bench-attn-small [--threads 1]`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from cpu_engine.config import EngineConfig
from cpu_engine.engine import configure_threads
from cpu_engine.paged_attention import paged_decode_attention
from cpu_engine.runner import Chunk, LlamaRunner, fused_projections

PROMPT = list(range(10, 42))
STEPS = 16


def pre_attention(hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float, qkv_weight: torch.Tensor,
                  cos: torch.Tensor, sin_signed: torch.Tensor, heads: int, kv_heads: int,
                  head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm, q/k/v and rotary: the runner's math (cpu_engine/runner.py), weights as arguments."""
    tokens = hidden.shape[0]
    qkv = F.linear(F.rms_norm(hidden, norm_weight.shape, norm_weight, eps), qkv_weight)
    qk_size = (heads + kv_heads) * head_dim
    qk = qkv[:, :qk_size].view(tokens, heads + kv_heads, head_dim)
    v = qkv[:, qk_size:].view(tokens, kv_heads, head_dim)
    qk = qk * cos + torch.roll(qk, head_dim // 2, dims=-1) * sin_signed
    return qk[:, :heads].contiguous(), qk[:, heads:].contiguous(), v.contiguous()


def post_attention(hidden: torch.Tensor, attn_out: torch.Tensor, o_weight: torch.Tensor,
                   norm_weight: torch.Tensor, eps: float, gate_up_weight: torch.Tensor,
                   down_weight: torch.Tensor) -> torch.Tensor:
    """Output projection, residual, RMSNorm, gated MLP, residual."""
    hidden = hidden + F.linear(attn_out, o_weight)
    gate, up = F.linear(F.rms_norm(hidden, norm_weight.shape, norm_weight, eps), gate_up_weight).chunk(2, dim=-1)
    return hidden + F.linear(F.silu(gate) * up, down_weight)


class LayerFunctions:
    """A decode step over the runner's cache and attention kernel, with the dense parts of each layer done
    by `pre` and `post` (eager, or compiled)."""

    def __init__(self, runner: LlamaRunner, checkpoint: Path, pre, post):
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        weights = fused_projections(model)
        layers = model.model.layers
        if any(bias is not None for _, bias in weights.values()) or getattr(layers[0].self_attn, "q_norm", None):
            raise SystemExit("this experiment covers Llama layers without biases or q/k norms")
        self.layers = [(layer.input_layernorm.weight.detach(), weights[f"layers.{i}.qkv"][0],
                        weights[f"layers.{i}.o_proj"][0], layer.post_attention_layernorm.weight.detach(),
                        weights[f"layers.{i}.gate_up"][0], weights[f"layers.{i}.down"][0])
                       for i, layer in enumerate(layers)]
        self.eps = float(layers[0].input_layernorm.variance_epsilon)
        self.lm_head = weights["lm_head"][0]
        self.runner, self.pre, self.post = runner, pre, post

    @torch.inference_mode()
    def step(self, token_ids: list[int], tables: list[list[int]], positions: list[int]) -> torch.Tensor:
        r = self.runner
        batch, block = len(token_ids), r.block_size
        pos = torch.tensor(positions)
        places = torch.tensor([t[p // block] * block + p % block for t, p in zip(tables, positions)])
        hidden = r.embed.index_select(0, torch.tensor(token_ids))
        cos, sin_signed = r.rotary_of(pos)
        lengths = pos + 1
        per_row = -(-int(lengths.max()) // block)
        table_t = torch.tensor([t[:per_row] for t in tables])
        for index, (norm1, qkv, o, norm2, gate_up, down) in enumerate(self.layers):
            q, k, v = self.pre(hidden, norm1, self.eps, qkv, cos, sin_signed, r.num_heads, r.num_kv_heads, r.head_dim)
            r.k_cache[index].index_copy_(0, places, k)
            r.v_cache[index].index_copy_(0, places, v)
            out = paged_decode_attention(q, r.k_cache[index], r.v_cache[index], table_t, lengths, block, r.scale)
            hidden = self.post(hidden, out.reshape(batch, -1), o, norm2, self.eps, gate_up, down)
        return F.linear(r.norm(hidden), self.lm_head)


def step_ms(step, batch: int, runner: LlamaRunner) -> float:
    """Median wall ms of STEPS decode steps of `batch` sequences after their 32-token prompt."""
    per = -(-(len(PROMPT) + STEPS + 4) // runner.block_size)
    tables = [list(range(s * per, (s + 1) * per)) for s in range(batch)]
    with torch.inference_mode():
        for table in tables:
            runner.forward(PROMPT, [], [], [Chunk(table, 0, len(PROMPT))], [len(PROMPT) - 1])
    times = []
    for position in range(len(PROMPT), len(PROMPT) + STEPS):
        start = time.perf_counter()
        step([5] * batch, tables, [position] * batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine-dir", type=Path, required=True, help="a built CPU engine (its engine/ folder's parent)")
    parser.add_argument("--threads", type=int, default=0, help="0: every core")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    threads = configure_threads(args.threads)
    config = EngineConfig.from_engine_dir(args.engine_dir / "engine")
    if config.dtype != "float32" or config.int8_weights is not None:
        raise SystemExit("this experiment compares float32 engines")
    runner = LlamaRunner(config)
    eager = LayerFunctions(runner, config.checkpoint_dir, pre_attention, post_attention)
    compiled = LayerFunctions(runner, config.checkpoint_dir, torch.compile(pre_attention, dynamic=True),
                              torch.compile(post_attention, dynamic=True))

    def runner_step(ids: list[int], tables: list[list[int]], positions: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return runner.forward(ids, tables, positions, [], list(range(len(ids))))

    # Same numbers first (the compiled graph may reorder float math: close, not bit-equal), and the compile.
    per = -(-(len(PROMPT) + 2) // runner.block_size)
    tables = [list(range(per)), list(range(per, 2 * per))]
    with torch.inference_mode():
        for table in tables:
            runner.forward(PROMPT, [], [], [Chunk(table, 0, len(PROMPT))], [len(PROMPT) - 1])
    reference = eager.step([5, 6], tables, [len(PROMPT)] * 2)
    start = time.perf_counter()
    first = compiled.step([5, 6], tables, [len(PROMPT)] * 2)
    compile_s = time.perf_counter() - start
    error = float((first - reference).abs().max() / reference.abs().max())
    print(f"{config.checkpoint_dir.name}, {threads} thread(s): compile {compile_s:.1f} s (first step, both "
          f"functions, dynamic batch); max logit error vs eager {error:.2e} (relative to the largest logit)")

    variants = {"runner": runner_step, "eager": eager.step, "compiled": compiled.step}
    results: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for batch in (1, 16):
            for name, step in variants.items():
                results.setdefault((name, batch), []).append(step_ms(step, batch, runner))
    print("\n| batch | runner ms/step | eager ms/step | compiled ms/step | compiled vs eager | compiled vs runner |")
    print("|--:|--:|--:|--:|--:|--:|")
    for batch in (1, 16):
        ms = {name: statistics.median(results[(name, batch)]) for name in variants}
        print(f"| {batch} | {ms['runner']:.2f} | {ms['eager']:.2f} | {ms['compiled']:.2f} | "
              f"{ms['eager'] / ms['compiled']:.2f}x | {ms['runner'] / ms['compiled']:.2f}x |")
    print(f"\nmedians of {args.rounds} interleaved rounds of {STEPS} steps (wall ms per step; x > 1: compiled faster)")


if __name__ == "__main__":
    main()
