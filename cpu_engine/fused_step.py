"""A step of decode rows through every decoder layer in one numba call, on our own kernels.

With our kernels (cpu_engine.vnni_gemm for int8 weights, cpu_engine.float32_gemm for float32 ones) a `small`
int8 product takes ~46 us, and a batch-1 step makes 49 of them; between them the runner's layer loop spent ~15 us
of Python and PyTorch dispatch per product in plain steps, ~40 us inside the running stack (where the frontend
and tritonserver share the cores and the caches): about as long as the products themselves. Here a step's layers
are one call: the norm and the qkv product, rotary and the KV cache store, attention over the paged cache, o_proj
with the residual add, the norm and the gate/up product, SiLU with the down product and the residual add, for
every layer, with no Python between.

decode_step takes the step from token ids to logits: the embedding rows, the rotary rows and each token's place in
the pool before the layers, the final norm and the lm_head after them. Those ran as ~15 PyTorch ops and Python
between numba calls before: a batch-1 step of `small` int8 took 0.33-0.36 ms longer (4.8 against 4.4 ms, 7%),
float32 0.37-0.48 ms (interleaved in one process).

Decode rows are the decoding sequences' tokens and, where they read little K/V, the step's prompt chunks' tokens
(runner.LlamaRunner._chunks_as_decode_rows): a new request's short prompt tail runs here beside the others.
Every piece is the function the layer-by-layer path calls (`project`, row_kernels.rotate_and_store,
paged_attention's kernel), so a decode row gets the same bits either way: a sequence decodes the same here and in
a step that also reads another request's long prompt chunk (the runner's layer loop; tests/unit/test_int8.py and
tests/unit/test_float32_gemm.py check the two against each other).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from cpu_engine import float32_gemm, vnni_gemm
from cpu_engine.paged_attention import attend_into
from cpu_engine.row_kernels import GATED, NO_ROW, NO_ROWS, NORMED, PLAIN, rotate_and_store


def project_rows(gemm, x, mode, norm_weight, eps, packed, bias, addend):  # pragma: no cover
    """The row kernel of the packed weight's kernel: vnni_gemm.project_rows for int8 weights,
    float32_gemm.project_rows for float32 ones (chosen where numba compiles the caller, by the weights' type)."""
    raise NotImplementedError("called from numba only")


@overload(project_rows)
def _row_kernel_for(gemm, x, mode, norm_weight, eps, packed, bias, addend):  # pragma: no cover
    kernel = vnni_gemm.project_rows if packed.types[0].dtype == types.int8 else float32_gemm.project_rows
    return lambda gemm, x, mode, norm_weight, eps, packed, bias, addend: kernel(
        gemm, x, mode, norm_weight, eps, packed, bias, addend)


@intrinsic
def _team_size(typingctx, threads):  # pragma: no cover (compiled)
    """Sets this thread's numba team to `threads` (<= NUMBA_NUM_THREADS) and returns the size it had: numba's
    own set_num_threads and get_num_threads, called by the symbols its threading layer registers (what numba's
    parallel loops call) instead of through the ctypes pointers that `numba.set_num_threads` uses in compiled
    code, which numba cannot cache (each process would compile the step again, ~10 s). The caller has started
    numba's threads (any numba.get_num_threads() call does)."""
    int32 = ir.IntType(32)

    def codegen(context, builder, signature, args):
        module = builder.module
        get = cgutils.get_or_insert_function(module, ir.FunctionType(int32, []), "get_num_threads")
        set_ = cgutils.get_or_insert_function(module, ir.FunctionType(ir.VoidType(), [int32]), "set_num_threads")
        before = builder.call(get, [])
        builder.call(set_, [builder.trunc(args[0], int32)])
        return builder.sext(before, ir.IntType(64))

    return types.int64(threads), codegen


@numba.njit(boundscheck=False, nogil=True, cache=True)
def _project(gemm, x, mode, norm_weight, eps, packed, bias, addend):  # pragma: no cover
    return project_rows(gemm, x, mode, norm_weight, eps, packed, bias, addend)


def project(gemm, packed: tuple, bias: np.ndarray, x: torch.Tensor, norm=None, gated: bool = False,
            add_to: torch.Tensor | None = None) -> torch.Tensor:
    """add_to + the projection of norm(x), or of silu(gate) x up for rows x = [gate | up] (`gated`), on our
    kernel `gemm` with its packed weight: float32 rows (contiguous), `norm` a row_kernels.RMSNorm with float32
    weights, `bias` a float32 array (NO_ROW: none). What Int8Projection.fused and Projection.fused run."""
    mode = NORMED if norm is not None else GATED if gated else PLAIN
    return torch.from_numpy(_project(
        gemm, x.numpy(), mode, NO_ROW if norm is None else norm.weight_array,
        np.float32(0) if norm is None else norm.eps32, packed, bias, NO_ROWS if add_to is None else add_to.numpy()))


@numba.njit(boundscheck=False, nogil=True, cache=True)
def decode_layers(gemm, hidden, layers, cos, sin_signed, places, k_pools, v_pools, tables, lengths, block_size,
                  scale, threads, shape, attention_kernel):  # pragma: no cover
    """The residual stream after every layer, for decode rows `hidden` [B, hidden] (float32).

    `layers`: one tuple a layer, (input norm weight, its eps, qkv packed weight, qkv bias, o_proj packed weight,
    o_proj bias, post-attention norm weight, its eps, gate_up packed weight, gate_up bias, down packed weight, down
    bias): every weight packed for `gemm`'s kernel, biases empty where there are none. k_pools / v_pools [layers,
    positions, kv_heads, head_dim] (the runner's pools); cos / sin_signed, places, tables, lengths and shape as the
    runner passes them to rotate_and_store and paged_attention; `threads`: the team attention runs on, numba's
    setting put back after it (the runner's wide_attention_threads: a long context's step stays one call, its
    attention on every core and the rest on the caller's setting); `attention_kernel`: paged_attention's
    bfloat16_kernel for bfloat16 pools (uint16 arrays), None for float32 ones (paged_attention.attend_into)."""
    batch = hidden.shape[0]
    kv_heads, dim = len(shape[0]), len(shape[2])
    heads = kv_heads * len(shape[1])
    no_row, no_rows, no_eps = np.empty(0, np.float32), np.empty((0, 0), np.float32), np.float32(0)
    q = np.empty((batch, heads, dim), np.float32)
    attention = np.empty((batch, heads, dim), np.float32)
    for i in range(len(layers)):
        input_norm, input_eps, qkv, qkv_bias, o_proj, o_bias, post_norm, post_eps, gate_up, gate_up_bias, down, \
            down_bias = layers[i]
        rows = project_rows(gemm, hidden, NORMED, input_norm, input_eps, qkv, qkv_bias, no_rows)
        rotate_and_store(rows, heads, kv_heads, cos, sin_signed, places, k_pools[i], v_pools[i], q)
        narrow = _team_size(threads) if threads > 1 else 1  # a long-context step's attention on the wide team
        attend_into(attention_kernel, q, k_pools[i], v_pools[i], tables, lengths, block_size, scale, threads, shape,
                    attention)
        if threads > 1:
            _team_size(narrow)
        hidden = project_rows(gemm, attention.reshape(batch, heads * dim), PLAIN, no_row, no_eps, o_proj, o_bias,
                              hidden)
        rows = project_rows(gemm, hidden, NORMED, post_norm, post_eps, gate_up, gate_up_bias, no_rows)
        hidden = project_rows(gemm, rows, GATED, no_row, no_eps, down, down_bias, hidden)
    return hidden


@numba.njit(boundscheck=False, nogil=True, cache=True)
def decode_step(gemm, embed, token_ids, positions, tables, cos_table, sin_table, layers, k_pools, v_pools,
                block_size, scale, threads, shape, logits_rows, head_gemm, norm_weight, norm_eps, head,
                head_bias, attention_kernel):  # pragma: no cover
    """The logits [len(logits_rows), vocab] of a step of decode rows: token `token_ids[i]` at `positions[i]` of the
    sequence whose block table is `tables[i]` (padded with any block id past its length), through decode_layers,
    the final norm (norm_weight, norm_eps) and the lm_head (`head` packed for `head_gemm`, its bias `head_bias`).
    embed [vocab, hidden]; cos_table / sin_table [positions, 1, head_dim], the runner's rotary tables. The token
    ids and positions are the scheduler's, checked at admission (no bounds are checked here)."""
    batch = token_ids.shape[0]
    hidden = np.empty((batch, embed.shape[1]), np.float32)
    cos = np.empty((batch, 1, cos_table.shape[2]), np.float32)
    sin_signed = np.empty((batch, 1, sin_table.shape[2]), np.float32)
    places = np.empty(batch, np.int64)
    lengths = np.empty(batch, np.int64)
    for i in range(batch):
        position = positions[i]
        hidden[i] = embed[token_ids[i]]
        cos[i] = cos_table[position]
        sin_signed[i] = sin_table[position]
        places[i] = tables[i, position // block_size] * block_size + position % block_size
        lengths[i] = position + 1
    hidden = decode_layers(gemm, hidden, layers, cos, sin_signed, places, k_pools, v_pools, tables, lengths,
                           block_size, scale, threads, shape, attention_kernel)
    last = np.empty((logits_rows.shape[0], hidden.shape[1]), np.float32)
    for i in range(logits_rows.shape[0]):
        last[i] = hidden[logits_rows[i]]
    no_rows = np.empty((0, 0), np.float32)
    return project_rows(head_gemm, last, NORMED, norm_weight, norm_eps, head, head_bias, no_rows)
