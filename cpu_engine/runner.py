"""One forward pass over a mixed batch of decode tokens and prompt chunks, with a paged KV cache.

Hugging Face's generic forward wants one padded rectangle per call and a cache per batch, which cannot
express "sequence A decodes its 40th token while sequence B reads the second chunk of its prompt". Like
TensorRT-LLM and vLLM, we run the Llama-family forward ourselves over the checkpoint's own weights (the
embedding, the rotary tables and the MLP's activation are Hugging Face's modules; the norms, projections,
rotary, attention and the cache are ours, with the modules' numbers), so every step is one packed forward
for all active sequences:

- all tokens of the step go through the linear layers together, as one [T, hidden] matrix (q/k/v and
  gate/up fused into one GEMM each; on float weights (float32 on our own kernel where the CPU has AVX-512:
  cpu_engine.float32_gemm), or on the build's int8 copy: cpu_engine.int8);
- the KV cache is one pool of fixed-size blocks per layer ([blocks, block_size, kv_heads, head_dim] for K
  and for V), preallocated once; a sequence's block table (which the scheduler owns, see
  cpu_engine.kv_blocks) says which blocks hold its positions, so a sequence holds only the blocks it
  uses and sequences with the same prefix can share its blocks;
- each token's K/V is written to its place in its sequence's blocks (on float32 pools together with the
  rotary, one numba call a layer: a batch-1 step runs ~40 small ops a layer, and each costs microseconds
  of Python and dispatch before any arithmetic); decode tokens attend as one batch,
  reading the pool in place through their block tables (cpu_engine.paged_attention; a bfloat16 engine
  gathers each sequence's blocks into a [batch, kv_heads, length, head_dim] tensor instead); each prompt
  chunk attends on its own, over its blocks gathered, with a causal mask offset by what its sequence
  already has in cache;
- on our own kernels (float32, or int8 with VNNI), a step of decode tokens only runs in one numba call, from
  token ids to logits (cpu_engine.fused_step: the same functions as the layer loop, so the same bits, without
  the Python between them).
"""

from __future__ import annotations

import logging
import math
import mmap
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from cpu_engine import float32_gemm, fused_step, paged_attention
from cpu_engine.config import EngineConfig
from cpu_engine.int8 import Int8Projection, load_int8_weights
from cpu_engine.lora import LoraBatch, ModelShapes
from cpu_engine.paged_attention import paged_decode_attention, shape_of
from cpu_engine.row_kernels import NO_ROW, RMSNorm, rotate_and_store, silu_of

# Architectures whose decoder layer is Llama's: RMSNorm, rotary, GQA attention (optional q/k/v bias,
# optional per-head q/k norm), gated MLP.
LLAMA_FAMILY = {
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
}

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
HUGE_PAGE = 2 << 20


def _pool_array(pool: torch.Tensor) -> np.ndarray:
    """The pool as the numba and C kernels take it: float32 as it is, bfloat16 as its bits (uint16; numpy has no
    bfloat16)."""
    if pool.dtype == torch.bfloat16:
        return pool.view(torch.int16).numpy().view(np.uint16)
    return pool.numpy()


def kv_pool(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed KV pool on transparent huge pages where the kernel offers them (madvise mode, the usual
    default). Decode attention reads a sequence's blocks scattered over the whole pool: with 4 KiB pages
    nearly every block is a TLB miss, which held K/V reads at ~12 GB/s per thread on `small` (~14.5 with huge
    pages; benchmarks/README.md, scenario l). The pool is an anonymous mapping rounded up to whole huge pages,
    advised before first touch and then written once, so that its memory is taken at start as before (a pool
    too big for the machine fails here, not mid-request)."""
    count = math.prod(shape)
    size = -(-count * torch.empty((), dtype=dtype).element_size() // HUGE_PAGE) * HUGE_PAGE
    memory = mmap.mmap(-1, max(size, HUGE_PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    pool = torch.frombuffer(memory, dtype=dtype, count=count).view(shape)
    pool.zero_()  # fault every page in now (the mapping is already zero)
    return pool


@dataclass(frozen=True)
class Chunk:
    """`length` new tokens of a sequence whose cache already holds `start` tokens; `blocks` is the
    sequence's block table, covering at least start + length positions."""

    blocks: list[int]
    start: int
    length: int


# The rotary tables of every position are kept (LlamaRunner._rotary_tables_for_every_position) up to this size.
ROTARY_TABLES_MAX_BYTES = 64 << 20
# Fallback only (no oneDNN, or a dtype it cannot pack on this CPU): up to this many rows, `weight @ x.T`
# beats `x @ weight.T` (F.linear): MKL's small-M sgemm path is up to 3x slower than the transposed product
# on some CPUs (measured on this AMD EPYC: a 4096x768 projection of 4 rows took 3.4 ms as F.linear, 1.1 ms
# transposed). Same math, other kernel.
SMALL_BATCH_ROWS = 128
# Decode attention reading at least this much K/V per layer in a step runs on `wide_attention_threads`
# (LlamaRunner): a region long enough (~0.4 ms on one thread here) for a team to pay beside the rest of the stack.
WIDE_ATTENTION_MIN_KV_BYTES = 8 << 20
# A step whose prompt chunks, read as decode rows, keep every row's attention under this much K/V a layer runs
# them as decode rows (LlamaRunner._chunks_as_decode_rows). Measured on `small` int8, one thread, a chunk of L
# tokens after `start` cached ones as a chunk against as rows: start 64, L 4 / 16 / 32 / 64 (0.3-12.5 MiB)
# 7.5 / 22.1 / 33.6 / 63.7 ms against 5.8 / 19.4 / 26.8 / 57.5; start 512, L 16 (17 MiB) 24.9 against 24.3,
# L 32 (34 MiB) 45.8 against 50.9: per-row attention loses only where it reads tens of MiB. The same bound as
# wide attention's, so that a step that takes the rows stays on the calling thread (and in one numba call).
ROWS_AS_DECODE_MAX_KV_BYTES = WIDE_ATTENTION_MIN_KV_BYTES
# oneDNN's float32 product of fewer rows than this is padded with zero rows to this many (where our own float32
# kernel does not run: a CPU without AVX-512), for two reasons. Its kernel for one row sums inputs of 1,536 or
# more (a `small` model's down projection) in another order than its kernels for 2+ rows, so a sequence decoding
# alone got other bits than in a batch (tests/unit/test_cpu_engine.py checks every row count from 1); with 2+
# rows a row's result does not depend on the others. And 1-3 rows are slower than 4: all 48 projections of a
# `small` step, one thread, on a 2-core AMD EPYC (AVX-512), 1 / 2 / 3 / 4 rows took 23.7 / 29.8 / 22.4 / 19.4 ms.
# Not for bfloat16: its 1-row product has the same bits as in a batch, and was the fastest (14.2 against 15.1 ms
# at 4).
ONEDNN_FLOAT32_MIN_ROWS = 4


def _pack_for_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight reordered once into oneDNN's blocked layout, or None where oneDNN cannot take it."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    except RuntimeError:  # e.g. bfloat16 on a CPU without avx512bw/avx_ne_convert
        return None


class Projection:
    """`x @ weight.T + bias` with the fastest kernel this CPU has for a step's few rows.

    float32 weights where our own kernel runs (cpu_engine.float32_gemm: AVX-512 and a C compiler): packed once at
    load; at 1-4 rows it reads the weights at one core's bandwidth, oneDNN's product at about half of it, and it
    also takes the norm before a projection, the gate's SiLU and the residual add into its row kernel
    (`fused`), so that the layer loop and the decode step in one numba call compute the same bits.
    Elsewhere oneDNN on a weight packed once at load, which beats MKL's sgemm on an AMD EPYC (AVX2) wherever
    the step is not bound by reading the weights from memory: a batch-16 decode step of the `small` preset took
    77 ms against 86 ms (medians of interleaved runs), a 256-token prompt chunk 411 against 554 ms.
    Every kernel gives a row the same bits whatever the other rows are (oneDNN from 2 rows on: a single
    float32 row is padded, ONEDNN_FLOAT32_MIN_ROWS), so a greedy sequence decodes the same alone and in a full
    batch. `torch.ops.mkldnn._linear_pointwise` is the op Inductor's CPU backend emits for linears; where oneDNN
    cannot pack the weight we use MKL.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.bias = bias
        self.gemm = float32_gemm.gemm() if weight.dtype == torch.float32 else None
        # Our kernel's packed weight as the numba kernels take it (float32_gemm.packed_weight, fused_step)
        self.arrays = float32_gemm.packed_weight(weight.numpy()) if self.gemm is not None else None
        self.fusable = self.arrays is not None  # the row kernels (`fused`) run around this product
        self.fused_bias = bias.numpy() if self.fusable and bias is not None else NO_ROW
        self.packed = _pack_for_onednn(weight) if self.arrays is None else None
        self.weight = weight if self.arrays is None and self.packed is None else None  # one copy only
        self.min_rows = ONEDNN_FLOAT32_MIN_ROWS if self.packed is not None and weight.dtype == torch.float32 else 0

    @property
    def kernel(self) -> str:
        return "float32-gemm" if self.arrays is not None else "onednn" if self.packed is not None else "mkl"

    @property
    def description(self) -> str:
        """Which kernel, for the server log."""
        return {"float32-gemm": "our float32 GEMM (cpu_engine/float32_gemm.c)", "onednn": "oneDNN",
                "mkl": "MKL"}[self.kernel]

    @property
    def uses_onednn(self) -> bool:
        return self.packed is not None

    @property
    def nbytes(self) -> int:
        """What one call reads of the weights (the packed copy where there is one) and the bias."""
        weight = self.packed if self.packed is not None else self.weight
        if self.arrays is not None:
            weight = self.arrays[0]
        return weight.nbytes + (0 if self.bias is None else self.bias.nbytes)

    def fused(self, x: torch.Tensor, norm: RMSNorm | None = None, gated: bool = False,
              add_to: torch.Tensor | None = None) -> torch.Tensor:
        """add_to + this projection of norm(x), or of silu(gate) x up for rows x = [gate | up] (`gated`; the SiLU
        is row_kernels.silu), on our kernel (`fusable` only): the ops around the product in its row kernel
        instead of PyTorch ops of their own, as Int8Projection.fused."""
        return fused_step.project(self.gemm, self.arrays, self.fused_bias, x, norm, gated, add_to)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.arrays is not None:
            return self.fused(x.contiguous())
        if self.packed is not None:
            rows = x.shape[0]
            if rows < self.min_rows:
                padded = x.new_zeros(self.min_rows, x.shape[1])
                padded[:rows] = x
                return torch.ops.mkldnn._linear_pointwise(padded, self.packed, self.bias, "none", [], "")[:rows]
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if x.shape[0] > SMALL_BATCH_ROWS:
            return F.linear(x, self.weight, self.bias)
        # Back to row-major: later ops (attention's fast kernel above all) need a contiguous last dimension.
        out = torch.mm(self.weight, x.t()).t().contiguous()
        return out if self.bias is None else out + self.bias


def _fused(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several projections of the same input: one GEMM instead of several."""
    weight = torch.cat([lin.weight.detach() for lin in linears], dim=0).contiguous()
    if all(lin.bias is None for lin in linears):
        return weight, None
    bias = torch.cat([lin.bias.detach() if lin.bias is not None
                      else torch.zeros(lin.out_features, dtype=weight.dtype) for lin in linears])
    return weight, bias


def fused_projections(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Every projection the runner runs, by name ("layers.<i>.qkv", ".o_proj", ".gate_up", ".down",
    "lm_head"): (weight, bias), q/k/v and gate/up fused. The build's int8 quantization names its weights
    the same way, so the engine finds each one."""
    projections = {"lm_head": (model.lm_head.weight.detach().contiguous(), None)}
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        projections[f"layers.{i}.qkv"] = _fused([attn.q_proj, attn.k_proj, attn.v_proj])
        projections[f"layers.{i}.o_proj"] = _fused([attn.o_proj])
        projections[f"layers.{i}.gate_up"] = _fused([mlp.gate_proj, mlp.up_proj])
        projections[f"layers.{i}.down"] = _fused([mlp.down_proj])
    return projections


AnyProjection = Projection | Int8Projection


def _projections(model: torch.nn.Module, int8_weights: Path | None) -> dict[str, AnyProjection]:
    """The model's projections on float weights, or on the build's int8 weights (each checked against
    the checkpoint's shape: an engine built from another checkpoint is refused, not run)."""
    floats = fused_projections(model)
    if int8_weights is None:
        return {name: Projection(weight, bias) for name, (weight, bias) in floats.items()}
    quantized = load_int8_weights(int8_weights)
    if quantized.keys() != floats.keys():
        raise ValueError(f"{int8_weights} does not hold this checkpoint's projections: rebuild the engine")
    projections = {}
    for name, (weight, bias) in floats.items():
        q, scale = quantized[name]
        if q.shape != weight.shape:
            raise ValueError(f"{int8_weights}: {name} is {tuple(q.shape)}, the checkpoint's {tuple(weight.shape)}: "
                             "rebuild the engine")
        projections[name] = Int8Projection(q, scale, bias)
    return projections


class FusedLayer:
    """A decoder layer's norms and projections (the checkpoint's modules are dropped)."""

    def __init__(self, layer: torch.nn.Module, projections: dict[str, AnyProjection], index: int, silu: bool):
        """`silu`: the checkpoint's activation is SiLU (hidden_act "silu" or "swish"), which our row kernels
        compute themselves."""
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm = RMSNorm(layer.input_layernorm)
        self.post_norm = RMSNorm(layer.post_attention_layernorm)
        self.q_norm = RMSNorm(attn.q_norm) if getattr(attn, "q_norm", None) is not None else None  # Qwen3
        self.k_norm = RMSNorm(attn.k_norm) if getattr(attn, "k_norm", None) is not None else None
        self.qkv = projections[f"layers.{index}.qkv"]
        self.o_proj = projections[f"layers.{index}.o_proj"]
        self.gate_up = projections[f"layers.{index}.gate_up"]
        self.down = projections[f"layers.{index}.down"]
        # Our kernels (float32 or int8: VNNI or FBGEMM) with float32 norms and SiLU: the norms, the gate's activation
        # and product and the residual adds run in the projections' own row kernels (`fused`), 7 PyTorch ops fewer
        # a layer. Such an engine's SiLU is row_kernels' on every path (`act`, used when a layer is not fused), so
        # fused and unfused layers compute the same bits.
        projections = [self.qkv, self.o_proj, self.gate_up, self.down]
        self.fused = (silu and all(p.fusable for p in projections)
                      and self.input_norm.weight_array is not None and self.post_norm.weight_array is not None)
        self.act = silu_of if self.fused else mlp.act_fn

    @property
    def step_arrays(self) -> tuple | None:
        """This layer as fused_step.decode_layers takes it: fused, every projection on one of our kernels (float32
        or VNNI), without per-head q/k norms (Qwen3's, which stay PyTorch ops); else None."""
        projections = (self.qkv, self.o_proj, self.gate_up, self.down)
        if not self.fused or self.q_norm is not None or any(p.arrays is None for p in projections):
            return None
        return (self.input_norm.weight_array, self.input_norm.eps32, self.qkv.arrays, self.qkv.fused_bias,
                self.o_proj.arrays, self.o_proj.fused_bias, self.post_norm.weight_array, self.post_norm.eps32,
                self.gate_up.arrays, self.gate_up.fused_bias, self.down.arrays, self.down.fused_bias)

    def qkv_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """q, k and v of the residual stream's rows (before rotary)."""
        if self.fused:
            return self.qkv.fused(hidden, norm=self.input_norm)
        return self.qkv(self.input_norm(hidden))

    def add_attention(self, hidden: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """The residual stream after attention: hidden + o_proj(attention)."""
        if self.fused:
            return self.o_proj.fused(attention, add_to=hidden)
        return hidden + self.o_proj(attention)

    def add_mlp(self, hidden: torch.Tensor, lora: LoraBatch | None = None, index: int = 0) -> torch.Tensor:
        """The residual stream after the gated MLP: hidden + down(act(gate) x up), [gate | up] of the norm; with
        `lora`, its rows' adapters (of layer `index`) added to gate/up and to down."""
        if lora is None and self.fused:
            return self.down.fused(self.gate_up.fused(hidden, norm=self.post_norm), gated=True, add_to=hidden)
        gate_up = self.gate_up.fused(hidden, norm=self.post_norm) if self.fused else self.gate_up(self.post_norm(hidden))
        if lora is None:
            gate, up = gate_up.chunk(2, dim=-1)
            return hidden + self.down(self.act(gate) * up)
        lora.add(gate_up, hidden, index, "gate_up", self.post_norm)
        if self.fused:
            out = self.down.fused(gate_up, gated=True, add_to=hidden)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            out = hidden + self.down(self.act(gate) * up)
        lora.add_down(out, gate_up, self.act, index)
        return out


class LlamaRunner:
    """Owns the weights and the KV cache; knows nothing about requests or sampling."""

    def __init__(self, config: EngineConfig):
        hf_config = AutoConfig.from_pretrained(config.checkpoint_dir)
        architectures = getattr(hf_config, "architectures", None) or []
        if not LLAMA_FAMILY.intersection(architectures):
            raise ValueError(
                f"the CPU engine runs Llama-family checkpoints ({', '.join(sorted(LLAMA_FAMILY))}); "
                f"{config.checkpoint_dir} is {architectures or 'of unknown architecture'}"
            )
        if config.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {config.dtype!r}")
        self.dtype, self.dtype_name = DTYPES[config.dtype], config.dtype
        model = AutoModelForCausalLM.from_pretrained(config.checkpoint_dir, dtype=self.dtype).eval()
        decoder = model.model
        self.embed = decoder.embed_tokens.weight.detach()  # rows looked up by index_select (a Module call costs)
        self.norm = RMSNorm(decoder.norm)
        self.rotary = decoder.rotary_emb
        projections = _projections(model, config.int8_weights)
        self.weights = config.weights
        self.lm_head = projections["lm_head"]
        self.vocab_size = int(hf_config.vocab_size)
        attn = decoder.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.num_heads = int(hf_config.num_attention_heads)
        self.num_kv_heads = int(hf_config.num_key_value_heads)
        self.scale = float(attn.scaling)
        silu = getattr(hf_config, "hidden_act", "silu") in ("silu", "swish")
        self.layers = [FusedLayer(layer, projections, i, silu) for i, layer in enumerate(decoder.layers)]
        del model, decoder, projections  # the fused (or int8) copies replace the per-projection weights
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.max_seq_len = config.max_seq_len
        # What a LoRA adapter must fit (cpu_engine.lora).
        self.lora_shapes = ModelShapes.of(int(hf_config.hidden_size), int(hf_config.intermediate_size), self.q_size,
                                          self.kv_size, len(self.layers))
        self._rotary_tables = self._rotary_tables_for_every_position()
        self.max_batch_size = config.max_batch_size
        self.block_size = config.kv_block_size
        self.num_blocks = config.kv_cache_blocks
        cache_shape = (len(self.layers), self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_dtype = self._kv_dtype_for(config.kv_cache_dtype)
        try:
            self.k_cache = kv_pool(cache_shape, self.kv_dtype)
            self.v_cache = kv_pool(cache_shape, self.kv_dtype)
        except (RuntimeError, OSError) as exc:  # say which setting to lower, not just "out of memory"
            raise ValueError(
                f"cannot allocate a KV cache of {self.num_blocks * self.block_size} tokens "
                f"({2 * torch.tensor([], dtype=self.kv_dtype).element_size() * len(self.layers) * self.kv_size} "
                f"bytes each): lower cpu_kv_cache_tokens ({exc})") from exc

        # Decode attention reads the pool in place where the compute is float32 (the numba kernel over a float32
        # pool, paged_attention.c over a bfloat16 one); bfloat16 compute gathers (see the module docstring).
        self.in_place_decode = self.dtype == torch.float32
        # The pools (and their layers) as numpy views, made once (the pool is never reallocated), for the numba
        # kernels.
        self._pool_arrays = (_pool_array(self.k_cache), _pool_array(self.v_cache)) if self.in_place_decode else None
        # The C kernel that reads a bfloat16 pool in place (None for a float32 pool: the numba kernel's).
        self._attention_kernel = paged_attention.bfloat16_kernel() if self.kv_dtype != self.dtype else None
        self._k_arrays = list(self._pool_arrays[0]) if self.in_place_decode else []
        self._v_arrays = list(self._pool_arrays[1]) if self.in_place_decode else []
        # The embedding and the rotary tables as numpy views too, for the step in one call (fused_step.decode_step).
        self._embed_array = self.embed.numpy() if self.in_place_decode else None
        self._rotary_arrays = (tuple(table.numpy() for table in self._rotary_tables)
                               if self.in_place_decode and self._rotary_tables is not None else None)
        self.kv_bytes_per_position = 2 * self.kv_size * self.k_cache.element_size()  # K and V, one layer
        self._attention_shape = shape_of(self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim)
        self._scale32 = np.float32(self.scale)
        self.plan_fused_ops()
        # Threads for the in-place decode attention of steps that read at least WIDE_ATTENTION_MIN_KV_BYTES of
        # K/V a layer (0: the calling thread's numba setting, like every other step). The engine sets it when
        # it leaves cores to the rest of the stack: the rest of the step runs on fewer threads than the
        # machine has, since short parallel regions lose to the stack's processes at every barrier, but
        # attention over long contexts is one long memory-bound region per layer, which reads K/V faster on
        # more cores (2 cores, `small` float32, 16 streams of 1,024 tokens through the whole stack, 3
        # interleaved rounds: 369 tok/s against 315 on one thread; benchmarks/README.md, scenario `l`).
        self.wide_attention_threads = 0

    def _kv_dtype_for(self, setting: str) -> torch.dtype:
        """The KV pool's dtype for `cpu_kv_cache_dtype` = `setting`: the compute dtype's ("auto", and always for
        bfloat16 compute), or bfloat16 for a float32 engine where the C kernel that reads it in place runs here
        (paged_attention.bfloat16_kernel: AVX-512 and a compiler; head_dim a multiple of 16 up to 128); else
        float32, logged."""
        if setting == "auto" or self.dtype != torch.float32:
            return self.dtype
        group = self.num_heads // self.num_kv_heads
        if not paged_attention.bfloat16_fits(self.num_kv_heads, group, self.head_dim):
            log.warning("cpu_kv_cache_dtype bfloat16: the kernel takes head_dim %s and up to %d heads, not %d and "
                        "%d; the KV cache stays float32", paged_attention.BFLOAT16_HEAD_DIMS,
                        paged_attention.BFLOAT16_MAX_HEADS, self.head_dim, self.num_heads)
            return torch.float32
        if paged_attention.bfloat16_kernel() is None:
            log.warning("cpu_kv_cache_dtype bfloat16: its kernel cannot run here (see above); the KV cache stays "
                        "float32")
            return torch.float32
        return torch.bfloat16

    def plan_fused_ops(self) -> None:
        """Which of the runner's own ops run fused, from the projections it has now (each layer's `fused` says the
        rest): at construction, and again by whoever swaps projections (benchmarks.engine_bench runs the other
        int8 kernels side by side)."""
        # An lm_head on our kernels with float32 norms takes the final norm into its row kernel, as the layers do.
        self.fused_head = self.lm_head.fusable and self.norm.weight_array is not None
        # Steps of decode rows only (short chunks included) of an engine on our float32 or VNNI kernel, with its
        # lm_head on one of them too and the rotary tables kept: the whole step, token ids to logits, in one numba
        # call (cpu_engine.fused_step.decode_step), each layer as its step_arrays; None where it cannot (the layer
        # loop). The step's kernel is its layers' (one engine: one kind of weights).
        steps = [layer.step_arrays for layer in self.layers]
        whole = (self.in_place_decode and self.fused_head and self.lm_head.arrays is not None
                 and self._rotary_tables is not None and all(arrays is not None for arrays in steps))
        self.one_call_decode = tuple(steps) if whole else None

    def _rotary_tables_for_every_position(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos and sin' ([max_seq_len, 1, head_dim]) of every position, from the checkpoint's rotary module once:
        a position's numbers do not depend on the others (the same bits as the module computes each step; a
        test checks), and each step then takes two lookups instead of ~10 small ops. None where the tables
        change with the sequence (dynamic NTK scaling, longrope) or would take over ROTARY_TABLES_MAX_BYTES."""
        rope_type = str(getattr(self.rotary, "rope_type", "default"))
        size = 2 * self.max_seq_len * self.head_dim * self.embed.element_size()
        if "dynamic" in rope_type or rope_type == "longrope" or size > ROTARY_TABLES_MAX_BYTES:
            return None
        with torch.inference_mode():
            return self.rotary_of(torch.arange(self.max_seq_len))

    def rotary_of(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin' of `positions` from the checkpoint's module, [T, 1, head_dim] each. x cos +
        rotate_half(x) sin == x cos + roll(x, half) sin', with sin' = sin with its first half negated: the same
        numbers (negation is exact), in two ops fewer, and for q and k at once."""
        cos, sin = self.rotary(self.embed[:1], positions[None, :])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]
        half = self.head_dim // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)

    @property
    def kv_cache_bytes(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    def _block_views(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the positions in `blocks` ([rows, blocks per row] block ids), gathered into
        [rows, kv_heads, blocks per row x block_size, head_dim]."""
        rows, per_row = blocks.shape
        flat = blocks.reshape(-1)
        shape = (rows, per_row * self.block_size, self.num_kv_heads, self.head_dim)
        k_pool = self.k_cache[layer].view(self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        v_pool = self.v_cache[layer].view(self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        keys = k_pool.index_select(0, flat).view(shape).transpose(1, 2)
        values = v_pool.index_select(0, flat).view(shape).transpose(1, 2)
        if self.kv_dtype != self.dtype:  # a bfloat16 pool of a float32 engine: attention computes in float32
            keys, values = keys.to(self.dtype), values.to(self.dtype)
        return keys, values

    def _decode_attention(self, q: torch.Tensor, layer: int, tables: torch.Tensor, lengths: torch.Tensor,
                          threads: int) -> torch.Tensor:
        """Decode attention over the pool in place, on `threads` numba threads (0: as set for this thread)."""
        if self._attention_kernel is not None:  # a bfloat16 pool: the C kernel, on our kernels' threads
            return paged_attention.paged_decode_attention_bfloat16(q, self.k_cache[layer], self.v_cache[layer],
                                                                   tables, lengths, self.block_size, self.scale)
        narrow = numba.get_num_threads() if threads else 0  # no switch (two numba calls) when not wide
        if threads:
            numba.set_num_threads(threads)
        try:
            return paged_decode_attention(q, self.k_cache[layer], self.v_cache[layer], tables, lengths,
                                          self.block_size, self.scale)
        finally:
            if threads:
                numba.set_num_threads(narrow)

    def _step_in_one_call(self, token_ids: list[int], decode_blocks: list[list[int]], decode_positions: list[int],
                          logits_rows: list[int], wide: int) -> torch.Tensor:
        """The logits of a step of decode rows only, in one numba call (fused_step.decode_step); its attention
        on `wide` threads where not 0 (the rest on this thread's numba setting)."""
        per_row = -(-(max(decode_positions) + 1) // self.block_size)
        # Rows shorter than the longest are padded with block 0: never read (the kernel stops at each row's length).
        tables = np.zeros((len(decode_blocks), per_row), dtype=np.int64)
        for row, table in zip(tables, decode_blocks):
            row[:min(len(table), per_row)] = table[:per_row]
        narrow = numba.get_num_threads()  # also starts numba's threads: fused_step._team_size needs them
        threads = wide or narrow
        previous = numba.set_parallel_chunksize(1) if threads > 1 else 0  # as paged_decode_attention sets it
        head, norm = self.lm_head, self.norm
        try:
            return torch.from_numpy(fused_step.decode_step(
                self.layers[0].qkv.gemm, self._embed_array, np.array(token_ids, dtype=np.int64),
                np.array(decode_positions, dtype=np.int64), tables, *self._rotary_arrays, self.one_call_decode,
                *self._pool_arrays, self.block_size, self._scale32, threads, self._attention_shape,
                np.array(logits_rows, dtype=np.int64), head.gemm, norm.weight_array, norm.eps32, head.arrays,
                head.fused_bias, self._attention_kernel))
        finally:
            if threads > 1:
                numba.set_parallel_chunksize(previous)

    def _chunks_as_decode_rows(self, decode_blocks: list[list[int]], decode_positions: list[int],
                               chunks: list[Chunk]) -> tuple[list[list[int]], list[int], list[Chunk]]:
        """The step's prompt chunks as decode rows (one a token, at its position, with its sequence's block
        table) where every row's attention together reads under ROWS_AS_DECODE_MAX_KV_BYTES of K/V a layer; else
        the step as it is. Each layer stores every row's K/V before any row attends, and a row reads its table
        up to its own position, so a chunk's token sees exactly the tokens before it, as the causal mask gives
        them. The rows keep the packed order (decode tokens, then each chunk's in order), so token ids and
        logits rows mean the same. What it saves: the chunk attention's per-layer masks and calls, and on the
        int8 VNNI kernel the layer loop itself (the step runs in one numba call): a new request's short prompt
        tail after a prefix-cache hit beside 15 decoding sequences, 37.8 against 28.7 ms a step (`small` int8).
        The prompt's rows get the decode kernel's bits instead of the chunk kernel's, within float32 rounding
        of each other."""
        reads = sum(decode_positions) + len(decode_positions)
        for chunk in chunks:
            reads += chunk.length * chunk.start + chunk.length * (chunk.length + 1) // 2
        if reads * self.kv_bytes_per_position >= ROWS_AS_DECODE_MAX_KV_BYTES:
            return decode_blocks, decode_positions, chunks
        blocks, positions = list(decode_blocks), list(decode_positions)
        for chunk in chunks:
            blocks.extend([chunk.blocks] * chunk.length)
            positions.extend(range(chunk.start, chunk.start + chunk.length))
        return blocks, positions, []

    @torch.inference_mode()
    def forward(self, token_ids: list[int], decode_blocks: list[list[int]], decode_positions: list[int],
                chunks: list[Chunk], logits_rows: list[int], lora: LoraBatch | None = None) -> torch.Tensor:
        """Run one step and return float32 logits for the packed rows in `logits_rows`.

        The packed batch is the decode tokens (one per entry of `decode_blocks`, the sequence's block table,
        at `decode_positions`) followed by each chunk's tokens in order. `lora`: the packed rows that run through
        a LoRA adapter (such a step takes the layer loop, not the one-call decode step).
        """
        if chunks and self.in_place_decode:
            decode_blocks, decode_positions, chunks = self._chunks_as_decode_rows(decode_blocks, decode_positions,
                                                                                  chunks)
        num_decode = len(decode_blocks)
        reads = (sum(decode_positions) + num_decode) * self.kv_bytes_per_position  # a layer's decode attention's K/V
        wide = self.wide_attention_threads if self.in_place_decode and reads >= WIDE_ATTENTION_MIN_KV_BYTES else 0
        if self.one_call_decode is not None and num_decode and not chunks and logits_rows and lora is None:
            return self._step_in_one_call(token_ids, decode_blocks, decode_positions, logits_rows, wide)
        block_size = self.block_size
        positions = list(decode_positions)
        places = [table[p // block_size] * block_size + p % block_size
                  for table, p in zip(decode_blocks, decode_positions)]  # each token's row in the pool
        chunk_blocks = []
        for chunk in chunks:
            end = chunk.start + chunk.length
            chunk_pos = torch.arange(chunk.start, end)
            table = torch.tensor(chunk.blocks[:-(-end // block_size)], dtype=torch.long)
            places.extend((table[chunk_pos // block_size] * block_size + chunk_pos % block_size).tolist())
            positions.extend(range(chunk.start, end))
            chunk_blocks.append(table[None])
        ids = torch.tensor(token_ids, dtype=torch.long)
        pos = torch.tensor(positions, dtype=torch.long)
        places_t = torch.tensor(places, dtype=torch.long)
        num_tokens = ids.shape[0]

        hidden = self.embed.index_select(0, ids)
        if self._rotary_tables is not None:
            cos, sin_signed = (table.index_select(0, pos) for table in self._rotary_tables)
        else:
            cos, sin_signed = self.rotary_of(pos)
        half = self.head_dim // 2

        decode_mask = decode_tables = dec_len = None
        if num_decode:
            dec_len = pos[:num_decode] + 1
            per_row = -(-int(dec_len.max()) // block_size)
            # Rows shorter than the longest are padded with block 0: never read (the kernel stops at each
            # row's length; the gather path masks them out).
            decode_tables = torch.tensor([table[:per_row] + [0] * (per_row - len(table[:per_row]))
                                          for table in decode_blocks], dtype=torch.long)
            if not self.in_place_decode:
                decode_mask = (torch.arange(per_row * block_size)[None, :] < dec_len[:, None])[:, None, None, :]

        if self.in_place_decode:
            rotary_arrays, places_array = (cos.numpy(), sin_signed.numpy()), places_t.numpy()
        qk_size = self.q_size + self.kv_size
        for layer_idx, layer in enumerate(self.layers):
            qkv = layer.qkv_of(hidden)
            if lora is not None:
                lora.add(qkv, hidden, layer_idx, "qkv", layer.input_norm)
            qk = qkv[:, :qk_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
            if layer.q_norm is not None:
                qk = torch.cat((layer.q_norm(qk[:, :self.num_heads]), layer.k_norm(qk[:, self.num_heads:])), dim=1)
                qkv = torch.cat((qk.view(num_tokens, qk_size), qkv[:, qk_size:]), dim=1)
            if self.in_place_decode:  # float32
                q = torch.empty(num_tokens, self.num_heads, self.head_dim)
                rotate_and_store(qkv.numpy(), self.num_heads, self.num_kv_heads, rotary_arrays[0], rotary_arrays[1],
                                 places_array, self._k_arrays[layer_idx], self._v_arrays[layer_idx], q.numpy())
            else:
                qk = qk * cos + torch.roll(qk, half, dims=-1) * sin_signed
                q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
                self.k_cache[layer_idx].index_copy_(0, places_t, k)
                self.v_cache[layer_idx].index_copy_(0, places_t, v)

            outputs = []
            if num_decode and self.in_place_decode:
                out = self._decode_attention(q[:num_decode], layer_idx, decode_tables, dec_len, wide)
                outputs.append(out.reshape(num_decode, -1))
            elif num_decode:
                keys, values = self._block_views(layer_idx, decode_tables)
                out = F.scaled_dot_product_attention(
                    q[:num_decode, :, None, :], keys, values, attn_mask=decode_mask,
                    scale=self.scale, enable_gqa=True)
                outputs.append(out.reshape(num_decode, -1))
            offset = num_decode
            for chunk, table in zip(chunks, chunk_blocks):
                end = chunk.start + chunk.length
                chunk_q = q[offset:offset + chunk.length].transpose(0, 1)[None]  # [1, heads, c, hd]
                keys, values = self._block_views(layer_idx, table)
                keys, values = keys[:, :, :end], values[:, :, :end]
                if chunk.start == 0:
                    out = F.scaled_dot_product_attention(
                        chunk_q, keys, values, is_causal=True, scale=self.scale, enable_gqa=True)
                else:
                    query_pos = torch.arange(chunk.start, end)[:, None]
                    mask = torch.arange(end)[None, :] <= query_pos
                    out = F.scaled_dot_product_attention(
                        chunk_q, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True)
                outputs.append(out[0].transpose(0, 1).reshape(chunk.length, -1))
                offset += chunk.length
            attn_out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
            if lora is None:
                hidden = layer.add_mlp(layer.add_attention(hidden, attn_out))
            else:
                hidden = layer.add_attention(hidden, attn_out)
                lora.add(hidden, attn_out, layer_idx, "o_proj")
                hidden = layer.add_mlp(hidden, lora, layer_idx)

        if not logits_rows:  # a step of prompt chunks that all end mid-prompt
            return torch.empty(0, self.vocab_size)
        last = hidden[torch.tensor(logits_rows, dtype=torch.long)]
        if self.fused_head:
            return self.lm_head.fused(last, norm=self.norm)
        return self.lm_head(self.norm(last)).float()
