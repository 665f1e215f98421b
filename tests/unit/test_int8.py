"""Int8 weights (`build_engine --weights int8`): the quantization, its file, and the engine's logits
on it against float32 within fixed bounds."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from benchmarks.engine_bench import int8_on
from benchmarks.engine_scenarios import compare_logits, logits_over, quality_tokens
from build_engine.__main__ import main as build_main
from cpu_engine.config import INT8_WEIGHTS_FILE, EngineConfig, resolve_dtype
from cpu_engine import vnni_gemm
from cpu_engine.int8 import (HAS_FBGEMM, KERNELS, NARROW_STEPS, RESIDUAL_GAIN, WIDE_STEPS, Int8Projection,
                             default_kernel, load_int8_weights, quantize_per_channel, save_int8_weights,
                             wide_activations)
from cpu_engine.row_kernels import RMSNorm, silu_of
from cpu_engine.runner import Chunk, LlamaRunner, fused_projections
from tests.unit.test_cpu_engine import VOCAB, checkpoint, int8_weights  # noqa: F401

# The int8 engine against float32 on the test model, over every position of a fixed 150-token prompt (the
# test model's logits are close together, so fewer positions make top-1 agreement a coin toss: at 48, one
# flip is 2%). Measured on AVX-512 VNNI: top-1 agreement 0.987 with 8-bit activation rows (0.980 with the
# 7-bit row + residual used without VNNI), max logit error ~1% of the largest logit; the bounds leave room,
# not slack for a broken kernel (a wrong scale or a transposed weight gives errors of the logits' own size).
QUALITY_POSITIONS = 150
MIN_TOP1_AGREEMENT = 0.95
MAX_RELATIVE_LOGIT_ERROR = 0.05


def test_per_channel_quantization_is_within_half_a_step_of_each_weight() -> None:
    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    weight[3] *= 100  # one loud channel must not cost the others their precision
    q, scale = quantize_per_channel(weight)
    assert q.dtype == torch.int8 and scale.shape == (64,) and int(q.abs().max()) <= 127
    error = (q.float() * scale.float()[:, None] - weight).abs()
    assert bool((error <= scale.float()[:, None] * 0.5 + 1e-6).all())
    assert float(scale[0]) < float(scale[3]) / 20


def _why_not(kernel: str) -> str | None:
    """Why `kernel` cannot run on this machine (None: it can)."""
    if kernel == "vnni" and vnni_gemm.gemm() is None:
        return "our VNNI GEMM needs AVX-512 VNNI and a C compiler"
    if kernel.startswith("fbgemm") and not HAS_FBGEMM:
        return "no FBGEMM in this PyTorch (ARM)"
    if kernel == "fbgemm" and not wide_activations():
        return "FBGEMM on this CPU adds pairs of products in int16 (no VNNI): 8-bit rows would saturate"
    return None


def each_kernel(*kernels: str) -> list:
    """The kernels as parameters, each skipped (with why) where it cannot run here."""
    return [pytest.param(kernel, id=kernel, marks=pytest.mark.skipif(_why_not(kernel) is not None,
                                                                      reason=str(_why_not(kernel))))
            for kernel in kernels]


def activations_as_the_kernel_sees_them(x: torch.Tensor, kernel: str) -> torch.Tensor:
    """The activation scheme cpu_engine.int8 documents: each row over its largest |value| on the grid 1/127
    (our VNNI GEMM, FBGEMM with VNNI), or on the grid 1/64 plus what that misses on a grid 128 times finer,
    scaled back (FBGEMM without VNNI); the weight-only kernel's bfloat16."""
    if kernel == "weight-only":
        return x.to(torch.bfloat16).float()
    row_max = x.abs().amax(dim=1, keepdim=True)
    unit = x / row_max
    if kernel != "fbgemm-residual":
        return torch.round(unit * WIDE_STEPS) / WIDE_STEPS * row_max
    high = torch.round(unit * NARROW_STEPS) / NARROW_STEPS
    low = torch.round((unit - high) * RESIDUAL_GAIN * NARROW_STEPS) / NARROW_STEPS / RESIDUAL_GAIN
    return (high + low) * row_max


@pytest.mark.parametrize("kernel", each_kernel(*KERNELS))
def test_int8_projection_computes_its_documented_scheme_in_any_batch(kernel: str) -> None:
    generator = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(96, 64, generator=generator), torch.randn(96, generator=generator)
    q, scale = quantize_per_channel(weight)
    projection = Int8Projection(q, scale, bias, kernel=kernel)
    x = torch.randn(40, 64, generator=generator)
    dequantized = q.float() * scale.float()[:, None]
    out = projection(x)
    assert out.dtype == torch.float32
    # The kernel does exactly the scheme (int8 weights, activations quantized per row)...
    expected = torch.nn.functional.linear(activations_as_the_kernel_sees_them(x, kernel), dequantized, bias)
    tolerance = 1e-1 if kernel == "weight-only" else 1e-3  # its products come back as bfloat16 (~8 here: ulp 1/16)
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=1e-3)
    # ... which stays near the float product: a wrong scale or zero point is off by the outputs' own size.
    exact = torch.nn.functional.linear(x, weight, bias)
    assert float((out - exact).norm() / exact.norm()) < 0.01
    alone = projection(x[:1])
    for rows in (2, 5, 16, 40):  # a row gets the same bits in any batch: greedy alone == greedy batched
        assert torch.equal(projection(x[:rows])[:1], alone), rows
    assert torch.equal(projection(torch.zeros(2, 64)), bias.expand(2, -1))  # an all-zero row: no 0 / 0


def test_the_int8_file_round_trips_and_names_every_projection(checkpoint: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    floats = fused_projections(AutoModelForCausalLM.from_pretrained(checkpoint))
    path = tmp_path / INT8_WEIGHTS_FILE
    save_int8_weights(path, {name: weight for name, (weight, _) in floats.items()})
    loaded = load_int8_weights(path)
    assert loaded.keys() == floats.keys() and "layers.1.gate_up" in loaded and "lm_head" in loaded
    for name, (weight, _) in floats.items():
        expected_q, expected_scale = quantize_per_channel(weight)
        assert torch.equal(loaded[name][0], expected_q) and torch.equal(loaded[name][1], expected_scale)
    assert not list(tmp_path.glob(".*.tmp"))  # written through a staging file, renamed into place


def test_an_int8_file_of_another_model_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    save_int8_weights(tmp_path / INT8_WEIGHTS_FILE, {"lm_head": torch.randn(VOCAB, 64)})
    with pytest.raises(ValueError, match="rebuild the engine"):
        LlamaRunner(EngineConfig(checkpoint_dir=checkpoint, max_batch_size=1, max_seq_len=64,
                                 int8_weights=tmp_path / INT8_WEIGHTS_FILE))


@pytest.mark.parametrize("kernel", each_kernel("vnni", "fbgemm", "fbgemm-residual"))  # the fusable ones
def test_the_fused_projection_is_the_same_bits_as_its_ops_one_by_one(kernel: str) -> None:
    """Int8Projection.fused (the norm, the gate's product, the bias and the residual add inside the row kernels)
    against the same steps as separate PyTorch ops: equal, bit for bit, so a fused step decodes what an
    unfused one would."""
    generator = torch.Generator().manual_seed(3)
    q, scale = quantize_per_channel(torch.randn(96, 64, generator=generator))
    bias = torch.randn(96, generator=generator)
    projection = Int8Projection(q, scale, bias, kernel=kernel)
    plain = Int8Projection(q, scale, kernel=kernel)
    x, hidden = torch.randn(5, 64, generator=generator), torch.randn(5, 96, generator=generator)
    norm = RMSNorm(torch.nn.RMSNorm(64, eps=1e-5))
    torch.nn.init.normal_(norm.weight, generator=generator)
    assert torch.equal(projection.fused(x, norm=norm, add_to=hidden), hidden + projection(norm(x)))
    gate_up = torch.randn(5, 128, generator=generator)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(plain.fused(gate_up, gated=True), plain(silu_of(gate) * up))
    assert torch.equal(plain.fused(x), plain(x)) and not torch.equal(projection(x), plain(x))  # the bias counts


@pytest.mark.parametrize("kernel", each_kernel(*KERNELS))
def test_a_runner_swapped_onto_another_kernel_plans_its_fused_ops_again(checkpoint: Path, int8_weights: Path,
                                                                         kernel: str) -> None:
    """engine_bench runs the int8 kernels side by side by swapping a runner's projections: the runner's fused
    ops (the one-call decode step, the lm_head with the final norm) must follow the kernel it now has, or a
    step would run the old kernel's arrays (or none) under the new kernel's name."""
    config = EngineConfig(checkpoint_dir=checkpoint, max_batch_size=1, max_seq_len=32, kv_block_size=4,
                          int8_weights=int8_weights)
    runner = int8_on(kernel, LlamaRunner(config), int8_weights)
    assert (runner.one_call_decode is not None) == (kernel == "vnni")
    assert runner.fused_head == (kernel != "weight-only")
    runner.forward([3, 4, 5], [], [], [Chunk([0, 1], 0, 3)], [2])
    assert runner.forward([6], [[0, 1]], [3], [], [0]).shape == (1, VOCAB)


def test_the_int8_engines_silu_is_within_a_few_ulps_of_pytorchs() -> None:
    """row_kernels.silu (the int8 engine's, inside its numba kernels) against PyTorch's, over the range where
    it is not 0 or x: the engine's numbers move by no more than the last bits (measured: 6% of the values
    differ, by at most 1.98 x eps x |value|)."""
    x = torch.linspace(-90, 30, 200_001)
    ours, theirs = silu_of(x[None, :])[0], torch.nn.functional.silu(x)
    ulp = torch.finfo(torch.float32).eps * theirs.abs().clamp(min=torch.finfo(torch.float32).tiny)
    assert ((ours - theirs).abs() <= 4 * ulp).all()


def test_the_int8_engine_stays_within_bounds_of_float32(checkpoint: Path, int8_weights: Path) -> None:
    config = EngineConfig(checkpoint_dir=checkpoint, max_batch_size=1, max_seq_len=QUALITY_POSITIONS + 10,
                          kv_block_size=4)
    reference = LlamaRunner(config)
    quantized = LlamaRunner(dataclasses.replace(config, int8_weights=int8_weights))
    assert (reference.weights, quantized.weights) == ("float32", "int8")
    tokens = quality_tokens(VOCAB, QUALITY_POSITIONS)
    quality = compare_logits(logits_over(reference, tokens), logits_over(quantized, tokens))
    assert quality["top1_agreement"] >= MIN_TOP1_AGREEMENT, quality
    assert 0 < quality["relative_max_error"] < MAX_RELATIVE_LOGIT_ERROR, quality  # > 0: int8 really ran
    bytes_read = sum(p.nbytes for layer in quantized.layers for p in (layer.qkv, layer.o_proj, layer.gate_up,
                                                                       layer.down))
    float_bytes = sum(p.nbytes for layer in reference.layers for p in (layer.qkv, layer.o_proj, layer.gate_up,
                                                                        layer.down))
    assert bytes_read < float_bytes * 0.3  # a quarter of the bytes, plus the scales


def test_weights_int8_is_for_the_cpu_engine_only(checkpoint: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert build_main(["--model", str(checkpoint), "--output-dir", str(tmp_path), "--backend", "trtllm",
                       "--weights", "int8"]) == 2
    assert "--weight-only" in capsys.readouterr().err


@pytest.mark.parametrize("setting, amx, expected", [
    ("engine", True, "float32"), ("auto", True, "bfloat16"), ("auto", False, "float32"),
    ("float32", True, "float32"), ("bfloat16", False, "bfloat16")])
def test_cpu_dtype_is_chosen_at_start_up_by_the_documented_rule(setting: str, amx: bool, expected: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert resolve_dtype(setting, built="float32") == expected
    with pytest.raises(ValueError, match="cpu_dtype must be one of"):
        resolve_dtype("fp16", built="float32")


def test_the_activation_grid_never_saturates_the_kernel() -> None:
    # The largest codes against the largest weights, both signs: where the kernel adds pairs of products in
    # int16 (no VNNI) codes above 128 would saturate, so the scheme chosen for this CPU must come back exact.
    inputs = 512
    q = torch.full((32, inputs), 127, dtype=torch.int8)
    q[1::2] = -127
    exact = torch.nn.functional.linear(torch.ones(1, inputs), q.float())
    chosen = Int8Projection(q, torch.ones(32))
    assert chosen.kernel == default_kernel() and (chosen.kernel != "fbgemm-residual" or not wide_activations())
    assert chosen.description == KERNELS[chosen.kernel]  # what the server log says
    runnable = [kernel for kernel in KERNELS if _why_not(kernel) is None]
    for projection in [chosen] + [Int8Projection(q, torch.ones(32), kernel=kernel) for kernel in runnable]:
        for rows in (1, 16, 74):
            torch.testing.assert_close(projection(torch.ones(rows, inputs)), exact.expand(rows, -1), rtol=1e-5, atol=0)
