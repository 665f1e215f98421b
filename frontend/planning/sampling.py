"""Sampling settings the engine gets, decided once for both engines, so that no combination a client may send
takes down a TensorRT-LLM batch (audit round 3: B1, R1, R4; tests/trtllm_contract/rules.py encodes the
executor's side of each).

- `ignore_eos` with a guide: the guide keeps the end id. Once the document is complete xgrammar allows only its
  stop token; with end_id -1 the sampler picks it, the request does not end, and the next step's
  `FillNextTokenBitmask` throws, which `forwardAsync` turns into an error for EVERY active request. A guided
  answer ends where its document ends (the CPU engine always did so), so `ignore_eos` has nothing to add there.
- `ignore_eos` with `min_tokens`: min_tokens masks the end id, and with end_id -1 TensorRT-LLM's
  `batchApplyPenalty` writes the logit just before the request's row. With the end id ignored, min_tokens
  has nothing to hold back: it is sent as 0.
- `top_k` above TensorRT-LLM's TOP_K_MAX (1024) is clipped there with a log line only: a 400 on that engine
  (the CPU engine honours any value).
"""

from __future__ import annotations

from frontend.generation.engine import Guide
from frontend.api_types.errors import invalid_request
from frontend.api_types.request_bodies import SamplingFields

# cpp/tensorrt_llm/kernels/samplingTopKKernels.h TOP_K_MAX; clamped by clampTopK() with a warning
# (layers/topKSamplingLayer.cpp setup(), @03961722).
TRTLLM_TOP_K_MAX = 1024


def is_trtllm(log_probs: str) -> bool:
    """Whether the engine is TensorRT-LLM's (EngineMetadata.log_probs: only the CPU engine says "model")."""
    return log_probs != "model"


def check_top_k(top_k: int, log_probs: str) -> None:
    """A 400 naming `top_k` where the engine would silently sample from fewer tokens than asked."""
    if is_trtllm(log_probs) and top_k > TRTLLM_TOP_K_MAX:
        raise invalid_request(f"top_k {top_k} is above {TRTLLM_TOP_K_MAX}, the most this engine (TensorRT-LLM) "
                              "samples from; use a value up to that, or 0 for no top-k limit", "top_k")


def engine_sampling(req: SamplingFields, guide: Guide | None) -> SamplingFields:
    """`req` as the engine must get it: ignore_eos dropped under a guide, min_tokens dropped with ignore_eos
    (module docstring). Returns `req` itself when nothing changes."""
    ignore_eos = req.ignore_eos and guide is None
    min_tokens = 0 if ignore_eos else req.min_tokens
    if (ignore_eos, min_tokens) == (req.ignore_eos, req.min_tokens):
        return req
    return req.model_copy(update={"ignore_eos": ignore_eos, "min_tokens": min_tokens})
