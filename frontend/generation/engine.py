"""What the serving layer needs from an engine, and nothing about how an engine is reached.

The serving layer (frontend/generation/serving.py) talks to this protocol only; `TritonEngine` implements it over
Triton gRPC, and unit tests implement it with a fake that scripts token streams, errors and delays.
Engine conventions (which tensors exist, how `ignore_eos` is spelled, how a request is cancelled) stay
behind it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, NamedTuple, Protocol


@dataclass(frozen=True)
class Guide:
    """Constrained decoding, in TensorRT-LLM's terms (both engines run xgrammar): `type` is json (any JSON),
    json_schema, regex or ebnf_grammar; `text` the schema (JSON text), regex or grammar."""

    type: str
    text: str
    param: str = "response_format"  # the request field it comes from, for the engine's refusals (400)


@dataclass(frozen=True)
class SamplingOptions:
    """One choice's generation settings, in OpenAI's terms (the engine translates them)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    eos_token_id: int | None = None
    extra_end_ids: tuple[int, ...] = ()  # more ids that end the answer (generation_config.json), not emitted
    pad_token_id: int | None = None
    ignore_eos: bool = False  # generate until max_tokens even past the end-of-sequence token
    logprobs: bool = False  # the sampled tokens' log-probabilities
    top_logprobs: int = 0  # and this many most likely alternatives per token
    guide: Guide | None = None  # the output must follow it (response_format, tool_choice, guided_*)


@dataclass(frozen=True, eq=False)
class LoraWeights:
    """A LoRA adapter as both engines take it (TensorRT-LLM's tensors, frontend/models/lora.py converts it):
    `task_id` names it in the engine's LoRA cache; `weights` [rows, width] float32 and `config` [rows, 3] int32
    are sent only when that cache may not hold it."""

    name: str
    task_id: int
    weights: Any
    config: Any


@dataclass(frozen=True)
class EngineRequest:
    """One engine request (one choice). `request_id` is made by the server, unique per choice: it is
    what cancellation keys on, so it must never come from a client."""

    request_id: str
    prompt_ids: list[int]
    options: SamplingOptions
    lora: LoraWeights | None = None  # through this adapter; None: the base model
    buffer: "BufferBudget | None" = None  # shared by the engine requests of one HTTP request


class BufferBudget:
    """The bytes of engine output that one HTTP request's engine requests may hold between the engine and
    its client (all its choices together). A client that stops reading makes the engine's output wait in the
    frontend; each stream's queue is bounded (TritonEngine), and this bounds the request as a whole, which may
    run up to max_engine_requests streams: past it the request ends with an error instead of holding more."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0

    def take(self, size: int) -> bool:
        """Hold `size` more bytes: False (nothing taken) when that would pass the limit."""
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held -= size


class TokenChunk(NamedTuple):
    """New tokens of one request, as the engine delivers them (usually one per step). A named tuple, not a
    frozen dataclass: one is built per token, and a tuple costs a third of a frozen dataclass to build."""

    token_ids: list[int]
    logprobs: list[float] | None = None  # one per token, when asked for
    top: list[list[tuple[int, float]]] | None = None  # per token, the most likely alternatives, when asked for


@dataclass(frozen=True)
class EngineMetadata:
    """What the engine's deployment says about the model; any field may be unknown (None)."""

    served_model_name: str | None
    tokenizer_dir: Path | None
    context_length: int | None
    max_top_logprobs: int = 0  # most alternatives per token the engine returns (0: sampled tokens only)
    # Whether the engine applies guides (guided_decoding_backend "xgrammar" and, on TensorRT-LLM, an
    # xgrammar_tokenizer_info_path): off, TensorRT-LLM generates a guided request unguided without a word, so
    # the frontend refuses guided requests (frontend/planning/structured.py refuse_unguided).
    guided_decoding: bool = True
    # What the sampled tokens' log-probs are (the engine model's normalize_log_probs parameter):
    # "model": the model's own distribution (after a guide's mask), OpenAI's meaning, whatever the sampling
    #   settings (the CPU engine: normalize_log_probs "model");
    # "sampling": TensorRT-LLM with normalize_log_probs false: the distribution after temperature and penalties,
    #   the model's own only at temperature 0 or 1 without penalties or min_tokens;
    # "top_k_normalized": TensorRT-LLM's default (true; also when the parameter is absent or unparsable):
    #   renormalised over the top-k tokens, 0.0 for every token at temperature 0.
    # frontend/planning/logprob_rules.py refuses the log-probs that would not mean OpenAI's.
    log_probs: str = "model"


class LLMEngine(Protocol):
    def generate(self, request: EngineRequest) -> AsyncIterator[TokenChunk]:
        """Stream the request's new tokens until it ends (end-of-sequence or max_tokens). Closing the
        iterator early, or cancelling the task that iterates it, cancels the request in the engine.
        Raises OpenAIError (503 when the engine is unreachable, 400 when it refused the request for
        something the client sent, 500 when it failed the request)."""
        ...

    async def is_ready(self) -> bool: ...

    async def metadata(self) -> EngineMetadata:
        """Raises OpenAIError 503 while the engine cannot be asked."""
        ...

    async def close(self) -> None: ...
