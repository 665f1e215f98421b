"""The int8 engine's step of decode rows through every decoder layer in one numba call.

With our VNNI GEMM (cpu_engine.vnni_gemm) a `small` int8 product takes ~46 us, and a batch-1 step makes 49 of
them; between them the runner's layer loop spent ~15 us of Python and PyTorch dispatch per product in plain
steps, ~40 us inside the running stack (where the frontend and tritonserver share the cores and the caches):
about as long as the products themselves. Here a step's layers are one call: the norm and the qkv product,
rotary and the KV cache store, attention over the paged cache, o_proj with the residual add, the norm and the
gate/up product, SiLU with the down product and the residual add, for every layer, with no Python between.

Decode rows are the decoding sequences' tokens and, where they read little K/V, the step's prompt chunks' tokens
(runner.LlamaRunner._chunks_as_decode_rows): a new request's short prompt tail runs here beside the others.
Every piece is the function the layer-by-layer path calls (vnni_gemm.project_rows, row_kernels.rotate_and_store,
paged_attention's kernel), so a decode row gets the same bits either way: a sequence decodes the same here and in
a step that also reads another request's long prompt chunk (the runner's layer loop; tests/unit/test_int8.py
checks the two against each other and against the unfused layers).
"""

from __future__ import annotations

import numba
import numpy as np

from cpu_engine.paged_attention import decode_attention_into
from cpu_engine.row_kernels import rotate_and_store
from cpu_engine.vnni_gemm import GATED, NORMED, PLAIN, project_rows


@numba.njit(boundscheck=False, nogil=True, cache=True)
def decode_layers(gemm, hidden, layers, cos, sin_signed, places, k_pools, v_pools, tables, lengths, block_size,
                  scale, threads, shape):  # pragma: no cover
    """The residual stream after every layer, for decode rows `hidden` [B, hidden] (float32).

    `layers`: one tuple a layer, (input norm weight, its eps, qkv PackedWeight.arrays, qkv bias, o_proj arrays,
    o_proj bias, post-attention norm weight, its eps, gate_up arrays, gate_up bias, down arrays, down bias);
    biases empty where there are none. k_pools / v_pools [layers, positions, kv_heads, head_dim] (the runner's
    pools); cos / sin_signed, places, tables, lengths, threads and shape as the runner passes them to
    rotate_and_store and paged_attention."""
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
        decode_attention_into(q, k_pools[i], v_pools[i], tables, lengths, block_size, scale, threads, shape, attention)
        hidden = project_rows(gemm, attention.reshape(batch, heads * dim), PLAIN, no_row, no_eps, o_proj, o_bias,
                              hidden)
        rows = project_rows(gemm, hidden, NORMED, post_norm, post_eps, gate_up, gate_up_bias, no_rows)
        hidden = project_rows(gemm, rows, GATED, no_row, no_eps, down, down_bias, hidden)
    return hidden
