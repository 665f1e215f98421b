"""Choosing the next token for every sequence of a step at once.

Semantics follow the TensorRT-LLM backend's inputs so the frontend need not know which engine it drives:
`runtime_top_k` 0 means no top-k, `runtime_top_p` 0 means no top-p, and with neither given (or top-k 1,
or temperature 0) decoding is greedy. Penalties follow OpenAI (presence/frequency, over generated tokens)
and Hugging Face (repetition, over prompt and generated tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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


def _apply_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
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
    return logits


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) > top_p  # keeps the token that crosses top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), NEG_INF)
    return logits


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
    """Pick one token per row of `logits` [B, vocab], with its log-probability (and alternatives).

    Log-probabilities are under the model's own distribution (before penalties, temperature and
    filtering), which is what OpenAI's `logprobs` report.
    """
    logprobs = torch.log_softmax(logits, dim=-1)
    greedy_rows = [i for i, row in enumerate(rows) if row.params.greedy and not row.banned
                   and not row.params.has_penalties]
    tokens = torch.empty(len(rows), dtype=torch.long)
    if greedy_rows:
        index = torch.tensor(greedy_rows, dtype=torch.long)
        tokens[index] = torch.argmax(logits[index], dim=-1)
    greedy_set = set(greedy_rows)
    for i, row in enumerate(rows):
        if i in greedy_set:
            continue
        row_logits = _apply_penalties(logits[i].clone(), row)
        if row.banned:
            row_logits[torch.tensor(row.banned, dtype=torch.long)] = NEG_INF
        if row.params.greedy:
            tokens[i] = torch.argmax(row_logits)
            continue
        row_logits = _filter_top_k_top_p(row_logits / row.params.temperature, row.params.top_k,
                                         row.params.top_p)
        probs = torch.softmax(row_logits, dim=-1)
        tokens[i] = torch.multinomial(probs, 1, generator=row.generator)[0]
    chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
    results = []
    for i, (row, token) in enumerate(zip(rows, tokens.tolist())):
        top: list[tuple[int, float]] = []
        if row.params.top_logprobs > 0:
            values, ids = torch.topk(logprobs[i], row.params.top_logprobs)
            top = list(zip(ids.tolist(), values.tolist()))
        results.append(SampledToken(token, chosen[i], top))
    return results
