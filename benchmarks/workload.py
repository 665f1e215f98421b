"""The one workload definition every driver uses: our load generator (raw Triton gRPC, the OpenAI
frontend, the naive baseline) and perf_analyzer's input files.

A workload is a seeded prompt set (each prompt exactly `input_tokens` tokens of user text under the
checkpoint's tokenizer), a fixed output length (`output_tokens`, enforced with min_tokens/ignore_eos so
every request generates exactly that many tokens), the concurrencies of the sweep and how many requests
each level sends. `python -m benchmarks.workload --show` prints it; `--json FILE` loads an override.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

# Plain words to draw prompts from: deterministic under the seed, tokenizer-independent text.
WORDS = (
    "the model reads a prompt and writes an answer one token at a time while the server batches many "
    "requests together so that each step of the engine serves every active sequence at once a cache "
    "keeps keys and values for the tokens already seen and a scheduler decides which request joins the "
    "batch next when a slot is free the client measures the time to the first token the time between "
    "tokens and the time to the last token under load from several users who send their questions "
    "about ships rivers mountains cities gardens music numbers stars weather bread coffee libraries "
    "trains bridges lighthouses clocks maps forests oceans islands deserts winter summer autumn spring "
    "history science language mathematics physics chemistry biology geography painting poetry theatre"
).split()

INSTRUCTIONS = (
    "Summarise the following notes.",
    "Continue this story.",
    "Answer the question hidden in this text.",
    "Rewrite the following in plain language.",
)


@dataclass(frozen=True)
class Workload:
    name: str = "default"
    seed: int = 1234
    num_prompts: int = 64  # distinct prompts; requests cycle through them
    input_tokens: int = 96  # user text per prompt, in the checkpoint's tokens (chat template not counted)
    output_tokens: int = 24  # every request generates exactly this many (min_tokens = max_tokens)
    concurrencies: tuple[int, ...] = (1, 4, 16, 32)
    rounds: int = 2  # requests per level = max(min_requests, rounds * concurrency)
    min_requests: int = 8
    warmup_requests: int = 2  # per target, before its first level, not measured
    # Cap for the naive baseline (one request at a time): requests per level there.
    naive_max_requests: int = 16
    overhead_pairs: int = 16  # frontend overhead, paired: requests through each path, one at a time
    extra: dict[str, Any] = field(default_factory=dict)

    def requests_at(self, concurrency: int, naive: bool = False) -> int:
        n = max(self.min_requests, self.rounds * concurrency)
        return min(n, max(self.naive_max_requests, concurrency)) if naive else n

    def prompts(self, tokenizer: Any | None = None) -> list[str]:
        """`num_prompts` texts from the seed. With a tokenizer (a `transformers` tokenizer), each is cut
        to exactly `input_tokens` tokens; without, to `input_tokens` words (an approximation)."""
        rng = random.Random(self.seed)
        prompts = []
        for i in range(self.num_prompts):
            words = [rng.choice(WORDS) for _ in range(self.input_tokens * 2)]
            text = f"{INSTRUCTIONS[i % len(INSTRUCTIONS)]} " + " ".join(words)
            if tokenizer is None:
                prompts.append(" ".join(text.split()[: self.input_tokens]))
                continue
            ids = tokenizer.encode(text, add_special_tokens=False)[: self.input_tokens]
            prompts.append(tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))
        return prompts

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["concurrencies"] = list(self.concurrencies)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Workload":
        data = dict(data)
        if "concurrencies" in data:
            data["concurrencies"] = tuple(int(c) for c in data["concurrencies"])
        return cls(**data)


DEFAULT = Workload()
# QUICK=1: short prompts and outputs, one round, concurrency up to 16: under two minutes on two cores.
QUICK = replace(DEFAULT, name="quick", num_prompts=16, input_tokens=32, output_tokens=8,
                concurrencies=(1, 4, 16), rounds=1, min_requests=4, warmup_requests=1, naive_max_requests=4,
                overhead_pairs=4)


def load_workload(quick: bool = False, path: str | Path | None = None) -> Workload:
    base = QUICK if quick else DEFAULT
    if not path:
        return base
    overrides = json.loads(Path(path).read_text())
    if "concurrencies" in overrides:
        overrides["concurrencies"] = tuple(int(c) for c in overrides["concurrencies"])
    return replace(base, **overrides)


def load_tokenizer(checkpoint_dir: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint_dir))


def chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    """The engine's input ids for one chat prompt: what the frontend sends for the same messages."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


# ----- perf_analyzer input-data files ---------------------------------------------------------------------
# end_id -1 is outside every vocabulary: the engine never stops early (the TensorRT-LLM benchmarks' trick);
# min_tokens = request_output_len says the same to engines that honour min_tokens. Either fixes the length.
NEVER_END_ID = -1


def pa_engine_inputs(workload: Workload, tokenizer: Any) -> dict[str, Any]:
    """perf_analyzer --input-data for `tensorrt_llm`: token ids (chat template applied), streaming."""
    data = []
    for prompt in workload.prompts(tokenizer):
        ids = chat_ids(tokenizer, prompt)
        data.append({
            "input_ids": {"content": ids, "shape": [len(ids)]},
            "input_lengths": [len(ids)],
            "request_output_len": [workload.output_tokens],
            "min_tokens": [workload.output_tokens],
            "end_id": [NEVER_END_ID],
            "streaming": [True],
            "exclude_input_in_output": [True],
        })
    return {"data": data}


def pa_ensemble_inputs(workload: Workload, tokenizer: Any) -> dict[str, Any]:
    """perf_analyzer --input-data for `ensemble`: text in, text out (its preprocessing tokenizes the raw
    text, no chat template), streaming."""
    return {"data": [{"text_input": [prompt], "max_tokens": [workload.output_tokens],
                      "min_tokens": [workload.output_tokens], "end_id": [NEVER_END_ID], "stream": [True]}
                     for prompt in workload.prompts(tokenizer)]}


def write_pa_inputs(workload: Workload, tokenizer: Any, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"tensorrt_llm": out_dir / "tensorrt_llm.json", "ensemble": out_dir / "ensemble.json"}
    paths["tensorrt_llm"].write_text(json.dumps(pa_engine_inputs(workload, tokenizer)) + "\n")
    paths["ensemble"].write_text(json.dumps(pa_ensemble_inputs(workload, tokenizer), indent=1) + "\n")
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", help="a JSON file of Workload fields overriding the preset")
    parser.add_argument("--show", action="store_true", help="print the workload as JSON")
    parser.add_argument("--tokenizer", help="checkpoint dir; with --write-pa-inputs")
    parser.add_argument("--write-pa-inputs", metavar="DIR", help="write perf_analyzer input-data JSON here")
    args = parser.parse_args(argv)
    workload = load_workload(args.quick, args.json)
    if args.show or not args.write_pa_inputs:
        print(json.dumps(workload.to_dict(), indent=2))
    if args.write_pa_inputs:
        if not args.tokenizer:
            parser.error("--write-pa-inputs needs --tokenizer")
        for name, path in write_pa_inputs(workload, load_tokenizer(args.tokenizer), Path(args.write_pa_inputs)).items():
            print(f"{name}: {path}")


if __name__ == "__main__":
    main()
