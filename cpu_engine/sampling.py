"""Choosing the next token for every sequence of a step at once.

Semantics follow the TensorRT-LLM backend's inputs so the frontend need not know which engine it drives:
`runtime_top_k` 0 means no top-k, `runtime_top_p` 0 means no top-p, and with neither given (or top-k 1,
or temperature 0) decoding is greedy. Penalties follow OpenAI (presence/frequency, over generated tokens)
and Hugging Face (repetition, over prompt and generated tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cpu_engine.guided import GuidedRows

NEG_INF = float("-inf")


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    bad_words: list[list[int]] = field(default_factory=list)
    top_logprobs: int = 0  # how many most likely alternatives to report with each token

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1 or (self.top_k == 0 and self.top_p <= 0.0)

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


@dataclass(frozen=True)
class SampledToken:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely (token, logprob) pairs, if asked for


@dataclass
class SamplingRow:
    """What the sampler needs to know about one sequence for one step."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt: list[int]
    output: list[int]
    banned: list[int]  # token ids forbidden this step (end_id before min_tokens, bad words)


def _apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
    """In place, on one row's logits."""
    params = row.params
    vocab = logits.shape[-1]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt) | set(row.output)), dtype=torch.long)
        if seen.numel():
            picked = logits[seen]
            logits[seen] = torch.where(picked > 0, picked / params.repetition_penalty,
                                       picked * params.repetition_penalty)
    if row.output and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(row.output, dtype=torch.long), minlength=vocab).float()
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()


def sample(logits: torch.Tensor, rows: list[SamplingRow], guided: GuidedRows | None = None) -> list[SampledToken]:
    """Pick one token per row of `logits` [B, vocab], with its log-probability (and alternatives).

    `guided` (guided decoding, cpu_engine.guided) holds the token bitmasks of the guided rows: before
    anything else the logits of the tokens their grammars do not allow are set to -inf, in place (xgrammar's
    CPU kernel, on those rows only; None for a batch without guided rows, which then costs nothing).

    The whole batch is processed at once: penalties and bans touch only the rows that have them, then
    one argmax serves the greedy rows and one sort/softmax/cumsum the sampled rows (top-k and top-p as
    per-row masks over the sorted logits); each sampled row draws with its own generator through the
    exponential race (argmax p / E, E ~ Exp(1)), which samples exactly from p and keeps seeded requests
    reproducible whatever else is in the batch. Log-probabilities are under the model's own
    distribution (before penalties, temperature and filtering), which is what OpenAI's `logprobs` report;
    for a guided row that is the distribution after its grammar mask, the one the token was actually drawn
    from: the model's probabilities renormalised over the tokens the grammar allows (a forbidden token never
    appears among the top alternatives).
    """
    if guided is not None:
        guided.apply(logits)
    logprobs = torch.log_softmax(logits, dim=-1)
    adjusted = [i for i, row in enumerate(rows) if row.banned or row.params.has_penalties]
    if adjusted:
        logits = logits.clone()
        for i in adjusted:
            _apply_penalties(logits[i], rows[i])
            if rows[i].banned:
                logits[i, torch.tensor(rows[i].banned, dtype=torch.long)] = NEG_INF
    tokens = torch.argmax(logits, dim=-1)
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    if sampled:
        tokens[torch.tensor(sampled)] = _sample_rows(logits[torch.tensor(sampled)], [rows[i] for i in sampled])
    chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
    results = []
    for i, (row, token) in enumerate(zip(rows, tokens.tolist())):
        top: list[tuple[int, float]] = []
        if row.params.top_logprobs > 0:
            values, ids = torch.topk(logprobs[i], row.params.top_logprobs)
            top = [(t, v) for t, v in zip(ids.tolist(), values.tolist()) if v != NEG_INF]  # masked: fewer
        results.append(SampledToken(token, chosen[i], top))
    return results


def _sample_rows(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    vocab = logits.shape[-1]
    temperature = torch.tensor([row.params.temperature for row in rows], dtype=logits.dtype)
    top_k = torch.tensor([row.params.top_k if 0 < row.params.top_k < vocab else vocab for row in rows])
    top_p = torch.tensor([row.params.top_p if 0.0 < row.params.top_p < 1.0 else 1.0 for row in rows],
                         dtype=logits.dtype)
    sorted_logits, order = torch.sort(logits / temperature[:, None], dim=-1, descending=True)
    keep = torch.arange(vocab)[None, :] < top_k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(~keep, NEG_INF), dim=-1)
    keep &= (torch.cumsum(probs, dim=-1) - probs) < top_p[:, None]  # the smallest set reaching top_p
    probs = torch.softmax(sorted_logits.masked_fill(~keep, NEG_INF), dim=-1)
    noise = torch.stack([torch.empty(vocab).exponential_(generator=row.generator) for row in rows])
    picked = torch.argmax(probs / noise, dim=-1)
    return order.gather(1, picked[:, None])[:, 0]
