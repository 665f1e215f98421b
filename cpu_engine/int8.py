"""Int8 weights: the per-channel quantization done at build time, its file, and its projection.

Decode is bound by reading the weights from memory, so an int8 copy of every projection (a quarter of
float32's bytes, with one scale per output channel) makes a small-batch step faster. The build quantizes
(`python -m build_engine --weights int8`) and stores the result in the engine directory
(`cpu_engine.config.INT8_WEIGHTS_FILE`), so every start loads the same numbers without quantizing again.

The matmul (`default_kernel` picks it per CPU): with AVX-512 VNNI, our own int8 x int8 GEMM
(cpu_engine.vnni_gemm: 1.34x FBGEMM's plain batch-1 decode step, 1.13x at batch 16, on the scheme below with
8-bit rows). Elsewhere, where PyTorch has FBGEMM (x86): an int8 x int8 GEMM with int32 sums (FBGEMM's
`linear_with_input_q_dq_qweight_dq_output_fp32`), as llama.cpp's q8_0 multiplies int8 activations with
int8 weights. Its activations are quantized with one fixed scale and zero point for the whole input, so
that a row's result cannot depend on the other rows, each row is first divided by its largest |value|
(then u in [-1, 1]) and quantized on a fixed grid; the product is scaled back by that maximum. Which grid
depends on how this CPU's FBGEMM kernel adds the uint8 x int8 products (`wide_activations`, probed once):
- **VNNI** (AVX-512 VNNI, AVX-VNNI: each product straight into int32): the grid 1/127 with zero point 128,
  codes 1..255, one row of 8 bits per activation row, as q8_0 has (its scale is per 32 values, ours per
  row).
- **Without VNNI** (AVX2, AVX-512 F): the kernels add pairs of products in int16 first, so codes stay in
  0..128 (grid 1/64, zero point 64: 128 x 127 x 2 fits in int16, 255 x 127 x 2 would not). That picture
  alone lost accuracy (top-1 agreement 0.92 against 1.0 on the test model), so each row also goes in a
  second time as what the rounding missed, times 128 (again in [-1, 1]); the two results are summed:
  ~13 bits of the row's range, at twice the GEMM's compute where it is compute-bound (16+ rows).
Measured on the 2-core AMD EPYC with AVX-512 VNNI, `small`, one thread, plain decode steps, medians of 3
interleaved rounds (`python -m benchmarks.engine_bench --only w` reports the quality): the 8-bit row
against the 7-bit row + residual, batch 16 8.8 against 14.0 ms, batch 1 4.7 against 5.1; top-1 agreement
with float32 over 512 tokens 0.971 against 0.979, max logit error 4.7% against 4.0% of the largest logit
(the weight-only kernel with bfloat16 activations: 0.979, 4.2%).
The integer sums are exact and the rest is per element, so a row's result does not depend on the batch:
a greedy sequence decodes the same alone and batched. The row scaling is two small numba loops (the seven
PyTorch ops they replace took ~5x their time), and in a decoder layer they also do the ops around each
projection (`Int8Projection.fused`: the RMSNorm before it, the gate's SiLU and product before `down`, the bias
and the residual add after), seven PyTorch ops fewer a layer. The int8 engine's SiLU is row_kernels.silu
(numba's, which PyTorch's vectorised one can differ from in the last bit), on every path, fused or not.
Measured on a 2-core AMD EPYC (AVX2 only), `small`, 2 threads, wall ms per plain decode step, medians of
interleaved rounds (`python -m benchmarks.engine_bench --only w`, which runs both kernels): 20.2 at batch 1
against 23.5 for `torch._weight_int8pack_mm` with bfloat16 activations, 56.9 against 80.8 at batch 16
(float32: 50.6, 85.5). `torch.ops.onednn.qlinear_pointwise` (oneDNN's int8 linear, the same activation
scheme) took 3-7x FBGEMM's time here. Cost: PyTorch 2.13 warns that the quantized tensor types FBGEMM's
packing takes will go in a later release; torch is pinned.

Elsewhere (no FBGEMM: ARM), `torch._weight_int8pack_mm`: weight-only, bfloat16 activations (with float32
activations it took 5x-25x the CPU time on an AMD EPYC with AVX-512), also batch-independent.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import numba
import numpy as np
import torch

from cpu_engine import fused_step, vnni_gemm
from cpu_engine.row_kernels import NO_ROW, NO_ROWS, RMSNorm, rms_norm_row, silu

# Scales are bfloat16 (the weight-only kernel's own dtype; FBGEMM takes them exactly as float64);
# quantizing with the rounded scale makes q x scale the weight's closest int8 picture for the scale the
# kernel will actually use.
SCALE_DTYPE = torch.bfloat16
_QUANT_MAX = 127  # symmetric: -127..127, so that negation is exact
_FORMAT = {"format": "int8 weight-only, symmetric, one bfloat16 scale per output channel", "version": "1"}

HAS_FBGEMM = "fbgemm" in torch.backends.quantized.supported_engines
# An activation row x / max|x| = u in [-1, 1] becomes, with VNNI, round(127 u) + 128 in 1..255; without it
# round(64 u) + 64 in 0..128, and what that rounding misses (at most 1/128), times 128, is again in [-1, 1]
# for a second int8 row (see the module docstring).
WIDE_STEPS, WIDE_ZERO_POINT = 127, 128
NARROW_STEPS, NARROW_ZERO_POINT = 64, 64  # a power of two: u x 64 is exact, so our rounding and the kernel's agree
RESIDUAL_GAIN = 2 * NARROW_STEPS
_TINY = vnni_gemm.TINY
# The op's one overload, resolved once, and its C++ entry point (`_op`): through the overload packet each call
# first searches its arguments for script objects (the packed weight is one), ~4 us a call, and the overload's
# Python __call__ then checks them for torch.compile's fake script objects, ~1.1 us more (8.6 against 9.8 us
# for a 1 x 64 x 64 product); a batch-1 step makes 49 calls.
_INT8_GEMM = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32.default._op if HAS_FBGEMM else None


@numba.njit(boundscheck=False, nogil=True, cache=True)
def _split_row(x, residual, pictures, i, n):  # pragma: no cover
    """Row i of pictures = u = x / max |x| (which the kernel rounds to its grid) and, with `residual`, row
    n + i = (u - its rounding to the grid 1/64) x 128; returns max |x|."""
    k = x.shape[0]
    top = _TINY
    for j in range(k):
        top = max(top, abs(x[j]))
    if not residual:
        inverse = np.float32(1.0) / top
        for j in range(k):
            pictures[i, j] = x[j] * inverse
        return top
    gain = np.float32(NARROW_STEPS) / top
    for j in range(k):
        scaled = x[j] * gain
        pictures[i, j] = scaled / np.float32(NARROW_STEPS)
        pictures[n + i, j] = (scaled - np.rint(scaled)) * np.float32(RESIDUAL_GAIN / NARROW_STEPS)
    return top


@numba.njit(boundscheck=False, nogil=True, cache=True)
def _split_rows(x, residual):  # pragma: no cover
    """(pictures, row_max) for x ([n, k] float32): _split_row for each row. One call in place of seven
    PyTorch ops (~10 us against ~50 for a row of 768)."""
    n, k = x.shape
    pictures = np.empty(((2 if residual else 1) * n, k), dtype=np.float32)
    row_max = np.empty((n, 1), dtype=np.float32)
    for i in range(n):
        row_max[i, 0] = _split_row(x[i], residual, pictures, i, n)
    return pictures, row_max


@numba.njit(boundscheck=False, nogil=True, cache=True)
def _norm_split_rows(x, weight, eps, residual):  # pragma: no cover
    """_split_rows of RMSNorm(x) (row_kernels.rms_norm_row): the norm before a projection, in the same call."""
    n, k = x.shape
    pictures = np.empty(((2 if residual else 1) * n, k), dtype=np.float32)
    row_max = np.empty((n, 1), dtype=np.float32)
    normed = np.empty(k, dtype=np.float32)
    for i in range(n):
        rms_norm_row(x[i], weight, eps, normed)
        row_max[i, 0] = _split_row(normed, residual, pictures, i, n)
    return pictures, row_max


@numba.njit(boundscheck=False, nogil=True, cache=True)
def _gated_split_rows(gate_up, residual):  # pragma: no cover
    """_split_rows of silu(gate) x up for the rows gate_up = [gate | up]: the gated MLP's input to its down
    projection, the activation and the product in the same call."""
    n, k = gate_up.shape[0], gate_up.shape[1] // 2
    pictures = np.empty(((2 if residual else 1) * n, k), dtype=np.float32)
    row_max = np.empty((n, 1), dtype=np.float32)
    gated = np.empty(k, dtype=np.float32)
    for i in range(n):
        for j in range(k):
            gated[j] = silu(gate_up[i, j]) * gate_up[i, k + j]
        row_max[i, 0] = _split_row(gated, residual, pictures, i, n)
    return pictures, row_max


@numba.njit(boundscheck=False, nogil=True, cache=True)
def _join_rows(products, row_max, residual, bias, addend):  # pragma: no cover
    """out[i] = addend[i] + (products[i] x row_max[i] + bias), with `residual` (products[i] + products[n + i]
    / 128) x row_max[i]: the row's int8 picture(s) summed and scaled back. An empty bias or addend (0
    elements) is left out: the residual stream's add after a projection, in the same call."""
    n, k = row_max.shape[0], products.shape[1]
    out = np.empty((n, k), dtype=np.float32)
    for i in range(n):
        for j in range(k):
            value = products[i, j]
            if residual:
                value = value + products[n + i, j] * np.float32(1.0 / RESIDUAL_GAIN)
            value = value * row_max[i, 0]
            if bias.shape[0]:
                value = value + bias[j]
            out[i, j] = addend[i, j] + value if addend.shape[0] else value
    return out


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([out, in] int8, [out] bfloat16 scales) with weight ~= q * scale[:, None], row by row."""
    weight = weight.detach().float()
    amax = weight.abs().amax(dim=1).clamp(min=float(_TINY))
    scale = (amax / _QUANT_MAX).to(SCALE_DTYPE)
    q = torch.round(weight / scale.float()[:, None]).clamp(-_QUANT_MAX, _QUANT_MAX).to(torch.int8)
    return q.contiguous(), scale


def _fbgemm_pack(q: torch.Tensor, scale: torch.Tensor) -> torch.ScriptObject:
    """The int8 weight in FBGEMM's packed layout, with its per-channel scales (exact in float64)."""
    with warnings.catch_warnings():  # the quantized tensor FBGEMM's packing takes: deprecated, still there
        warnings.simplefilter("ignore", UserWarning)
        weight = torch._make_per_channel_quantized_tensor(
            q, scale.double(), torch.zeros(q.shape[0], dtype=torch.long), 0)
    return torch.ops.quantized.linear_prepack(weight, None)


@functools.cache
def wide_activations() -> bool:
    """Whether this CPU's FBGEMM kernel adds every uint8 x int8 product straight into int32 (VNNI), so that
    activations may use the codes 0..255 (see the module docstring). Probed rather than read from the CPU
    flags: the worst case (every code 255 against weights of +-127, at the row counts decode and prefill
    use) must come back exact; a kernel that adds pairs in int16 first saturates it by half."""
    if not HAS_FBGEMM:
        return False
    inputs = 256
    weight = torch.full((64, inputs), 127, dtype=torch.int8)
    weight[1::2] = -127
    packed = _fbgemm_pack(weight, torch.ones(64, dtype=SCALE_DTYPE))
    exact = weight[:, 0].double() * inputs * (255 - WIDE_ZERO_POINT) / WIDE_STEPS
    for rows in (1, 2, 16, 64):
        products = _INT8_GEMM(torch.ones(rows, inputs), 1.0 / WIDE_STEPS, WIDE_ZERO_POINT, packed)
        if not torch.allclose(products.double(), exact.expand(rows, -1), rtol=1e-5, atol=0):
            return False
    return True


# The kernels an Int8Projection can run on (`default_kernel` picks one for this CPU), for the server log.
KERNELS = {
    "vnni": "our VNNI GEMM (cpu_engine/int8_gemm.c), 8-bit activation rows",
    "fbgemm": "FBGEMM, 8-bit activation rows (VNNI)",
    "fbgemm-residual": "FBGEMM, 7-bit activation rows + residual (no VNNI)",
    "weight-only": "weight-only int8 kernel, bfloat16 activations",
}


def default_kernel() -> str:
    """Our VNNI GEMM where it runs (AVX-512 VNNI and a C compiler), else FBGEMM's product with the activation
    grid its kernel allows, else (no FBGEMM: ARM) the weight-only kernel."""
    if vnni_gemm.gemm() is not None:
        return "vnni"
    if HAS_FBGEMM:
        return "fbgemm" if wide_activations() else "fbgemm-residual"
    return "weight-only"


class Int8Projection:
    """`x @ dequant(q).T + bias` on int8 weights; returns x's dtype."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 kernel: str | None = None):
        """`kernel`: one of KERNELS (None: `default_kernel()`); each holds only its own copy of the weights."""
        if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
            raise ValueError(f"int8 weight [out, in] and [out] scales expected, got {q.dtype} {tuple(q.shape)} "
                             f"and {tuple(scale.shape)}")
        self.kernel = default_kernel() if kernel is None else kernel
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {sorted(KERNELS)}, not {kernel!r}")
        self.bias = bias
        self.scale = scale.to(SCALE_DTYPE).clone()
        self._weight_bytes = q.nbytes
        self.fusable = self.kernel != "weight-only"  # the row kernels (`fused`) run around this product
        self.gemm = vnni_gemm.gemm() if self.kernel == "vnni" else None
        if (self.kernel == "vnni" and self.gemm is None) or (self.kernel.startswith("fbgemm") and not HAS_FBGEMM):
            raise ValueError(f"the {self.kernel} int8 kernel cannot run on this machine")
        # The VNNI kernel's packed weight as the numba kernels take it (PackedWeight.arrays, fused_step), built
        # once rather than at every call; None on the other kernels
        self.arrays = vnni_gemm.PackedWeight(q.numpy(), self.scale.float().numpy()).arrays if self.gemm else None
        self.packed = _fbgemm_pack(q, self.scale) if self.kernel.startswith("fbgemm") else None
        self.wide = self.kernel != "fbgemm-residual"  # 8-bit activation rows (the FBGEMM kernels: see above)
        # The row kernels add a float32 bias (`fused_bias`, an empty array: none); any other is added as a tensor.
        bias_in_join = self.fusable and bias is not None and bias.dtype == torch.float32
        self.fused_bias = bias.numpy() if bias_in_join else NO_ROW
        self._bias_after = None if bias_in_join else bias
        self.steps, self.zero_point = ((WIDE_STEPS, WIDE_ZERO_POINT) if self.wide
                                       else (NARROW_STEPS, NARROW_ZERO_POINT))
        # The weight-only kernel's copy in memory of our own: a tensor read from a safetensors file may sit at
        # an address its aligned vector loads crash on (seen: a segfault on a test model's qkv).
        self.q = q.clone(memory_format=torch.contiguous_format) if self.kernel == "weight-only" else None

    @property
    def description(self) -> str:
        """Which kernel and activations, for the server log."""
        return KERNELS[self.kernel]

    @property
    def nbytes(self) -> int:
        """What one call reads of the weights, scales and bias."""
        return self._weight_bytes + self.scale.nbytes + (0 if self.bias is None else self.bias.nbytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fusable:
            out = torch._weight_int8pack_mm(x.to(SCALE_DTYPE), self.q, self.scale).to(x.dtype)
        else:
            out = self.fused(x.float().contiguous())
            out = out if x.dtype == torch.float32 else out.to(x.dtype)
        return out if self._bias_after is None else out + self._bias_after

    def fused(self, x: torch.Tensor, norm: RMSNorm | None = None, gated: bool = False,
              add_to: torch.Tensor | None = None) -> torch.Tensor:
        """add_to + this projection of norm(x), or of silu(gate) x up for rows x = [gate | up] (`gated`; the
        SiLU is row_kernels.silu), in float32. The norm, the gate's activation and product, the bias and the add
        run inside the row kernels around the int8 product instead of as PyTorch ops of their own: at batch 1
        each op costs microseconds of Python and dispatch, more than its arithmetic. Not on the weight-only
        kernel; x and add_to float32 rows, `norm` with float32 weights."""
        if self.arrays is not None:
            return fused_step.project(self.gemm, self.arrays, self.fused_bias, x, norm, gated, add_to)
        rows = x.numpy()
        addend = NO_ROWS if add_to is None else add_to.numpy()
        residual = not self.wide
        if norm is not None:
            pictures, row_max = _norm_split_rows(rows, norm.weight_array, norm.eps32, residual)
        elif gated:
            pictures, row_max = _gated_split_rows(rows, residual)
        else:
            pictures, row_max = _split_rows(rows, residual)
        products = _INT8_GEMM(torch.from_numpy(pictures), 1.0 / self.steps, self.zero_point, self.packed)
        return torch.from_numpy(_join_rows(products.numpy(), row_max, residual, self.fused_bias, addend))


def save_int8_weights(path: Path, weights: dict[str, torch.Tensor]) -> None:
    """Quantize each named float weight and store them all in one safetensors file, atomically: a
    half-written file never sits where the engine would load it."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, weight in weights.items():
        tensors[f"{name}.q"], tensors[f"{name}.scale"] = quantize_per_channel(weight)
    staging = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(staging), metadata=_FORMAT)
    staging.replace(path)


def load_int8_weights(path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (int8 weight, scales), as `save_int8_weights` stored them."""
    from safetensors import safe_open

    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: rebuild the engine with --weights int8")
    with safe_open(str(path), framework="pt") as handle:
        if handle.metadata() != _FORMAT:
            raise ValueError(f"{path} holds {handle.metadata()}, not {_FORMAT}: rebuild the engine")
        names = {key.rsplit(".", 1)[0] for key in handle.keys()}
        return {name: (handle.get_tensor(f"{name}.q"), handle.get_tensor(f"{name}.scale")) for name in names}
