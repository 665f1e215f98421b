"""Log-probabilities that mean what OpenAI's `logprob` means, or a 400 that says why not.

OpenAI's `logprob` is the token's log-probability under the model's own distribution, whatever the sampling
settings. The CPU engine reports exactly that (after a guide's mask, the distribution the token was drawn
from). TensorRT-LLM reports the distribution its sampler drew from: the logits after temperature, penalties
(prompt tokens counted) and min_tokens' end-id mask; with normalize_log_probs true (its default) also
renormalised over the top-k tokens, so that every token of a greedy request gets 0.0. The engine model's
config says which (EngineMetadata.log_probs); a request whose log-probs the engine would report otherwise
than the model's own is refused here, before it runs (tests/trtllm_contract/rules.py log_prob_rule is the
engine side of the same rule).
"""

from __future__ import annotations

from frontend.api_types.errors import invalid_request
from frontend.api_types.request_bodies import SamplingFields


def logprobs_meaning_problems(req: SamplingFields, log_probs: str) -> list[str]:
    """The settings of `req` under which an engine whose log-probs are `log_probs` (EngineMetadata.log_probs)
    would not report the model's own log-probs; empty when it would. The settings are those the engine gets
    (frontend/generation/trtllm_tensors.py build_inputs: temperature 0 is temperature 1 with top_k 1)."""
    if log_probs == "model":
        return []
    greedy = req.temperature == 0.0
    temperature, top_k = (1.0, 1) if greedy else (req.temperature, req.top_k)
    problems = []
    if temperature != 1.0:
        problems.append(f"temperature {temperature:g}")
    if req.presence_penalty != 0.0:
        problems.append(f"presence_penalty {req.presence_penalty:g}")
    if req.frequency_penalty != 0.0:
        problems.append(f"frequency_penalty {req.frequency_penalty:g}")
    if req.repetition_penalty != 1.0:
        problems.append(f"repetition_penalty {req.repetition_penalty:g}")
    if req.min_tokens > 0:
        problems.append(f"min_tokens {req.min_tokens}")
    if log_probs != "sampling" and top_k > 0:  # top_k_normalized (or unknown): the top-k path renormalises
        problems.append("temperature 0" if greedy else f"top_k {top_k}")
    return problems


def check_logprobs_meaning(req: SamplingFields, wants_logprobs: bool, log_probs: str, param: str = "logprobs") -> None:
    """Refuse (400, `param`) log-probs the engine would report under another distribution than the model's."""
    if not wants_logprobs:
        return
    problems = logprobs_meaning_problems(req, log_probs)
    if not problems:
        return
    if log_probs == "sampling":
        why = ("This engine (TensorRT-LLM) reports log-probabilities under the distribution it samples from, after "
               "temperature and penalties, not under the model's own distribution as OpenAI's logprobs are; they "
               "mean the same only at temperature 0 or 1 without presence, frequency or repetition penalties "
               "and without min_tokens")
    else:
        why = ("This engine (TensorRT-LLM with normalize_log_probs true, its default) renormalises "
               "log-probabilities over the top-k tokens (0.0 for every token at temperature 0), which are not "
               "OpenAI's logprobs; it can return them only with top_k 0, temperature 1 and no penalties or "
               "min_tokens (set normalize_log_probs to false in the engine model's config for more)")
    raise invalid_request(f"{why}. This request has {', '.join(problems)}: drop {param}, or change those.", param)
