"""The zero-cost engine of `make bench-frontend` (benchmarks/frontend_bench.py): `add_null_engine` adds it
to a rendered model repository, next to the real models, before tritonserver starts.

Its config.pbtxt is the rendered `tensorrt_llm` config (so the production template's inputs, outputs,
decoupled policy and parameters: the frontend reads the same served name, context length and log-prob
settings and cannot tell the difference), with its own name, backend "python", and one more parameter,
`null_engine_token_ids`: ids of plain words under the repository's tokenizer, which the model cycles
through (benchmarks/null_engine/model.py). This package is imported by the benchmark only; Triton loads
model.py, a copy of which goes to `<name>/1/model.py`.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

NULL_MODEL = "null_engine"
SOURCE_MODEL = "tensorrt_llm"
MODEL_FILE = Path(__file__).resolve().with_name("model.py")
TOKEN_IDS_PARAMETER = "null_engine_token_ids"
_NAME_LINE = re.compile(r'^name:\s*"[^"]*"\s*$', re.MULTILINE)
_BACKEND_LINE = re.compile(r'^backend:\s*"[^"]*"\s*$', re.MULTILINE)


def plain_token_ids(tokenizer: Any, limit: int = 256) -> list[int]:
    """Ids of ordinary English words under `tokenizer` (a transformers tokenizer), none of them special or
    an end id: the null engine's output decodes to plain text."""
    from benchmarks.workload import WORDS

    special = set(tokenizer.all_special_ids)
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            special.add(value)
    ids = tokenizer.encode(" " + " ".join(WORDS), add_special_tokens=False)
    plain = [int(t) for t in ids if int(t) not in special][:limit]
    if not plain:
        raise ValueError("the tokenizer turned the word list into special tokens only")
    return plain


def add_null_engine(model_repository: Path, token_ids: list[int], name: str = NULL_MODEL,
                    end_ids: list[int] | tuple[int, ...] = ()) -> Path:
    """Add the null engine as `model_repository/<name>` (see the module docstring); returns its directory.
    `end_ids`: ids it must never send (besides what each request's `end_id` says), dropped from
    `token_ids`. Raises ValueError if `<name>` exists or the rendered config is not the expected one."""
    repository = Path(model_repository)
    source, target = repository / SOURCE_MODEL / "config.pbtxt", repository / name
    if target.exists():
        raise ValueError(f"{target} already exists")
    ids = [int(t) for t in token_ids if int(t) not in set(end_ids)]
    if not ids:
        raise ValueError("no token ids left to send")
    text = source.read_text()
    if len(_NAME_LINE.findall(text)) != 1 or len(_BACKEND_LINE.findall(text)) != 1:
        raise ValueError(f"expected exactly one top-level name and backend line in {source}")
    text = _NAME_LINE.sub(f'name: "{name}"', text)
    text = _BACKEND_LINE.sub('backend: "python"', text)
    text = (f"{text.rstrip()}\n# The null engine (benchmarks/null_engine): the tokens it cycles through.\n"
            f'parameters: {{\n  key: "{TOKEN_IDS_PARAMETER}"\n  value: {{ string_value: "{",".join(map(str, ids))}" }}\n}}\n')
    (target / "1").mkdir(parents=True)
    (target / "config.pbtxt").write_text(text)
    shutil.copyfile(MODEL_FILE, target / "1" / "model.py")
    return target
