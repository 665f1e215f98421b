"""Re-check the xgrammar version skew the frontend's guide check assumes (frontend/planning/guide_check.py).

tests/unit/test_guide_check.py lists guides the GPU image's xgrammar refuses and 0.2.9 accepts
(OLDER_XGRAMMAR_REFUSES) and guides both accept (BOTH_ACCEPT). This runs them through another xgrammar's
tokenizer-free compilation, in a Python that has that version, and says where it disagrees with the tables:
run it when the image's TensorRT-LLM (and so its xgrammar) changes.

    python3.11 -m venv /tmp/xg_old && /tmp/xg_old/bin/pip install xgrammar==0.1.25
    .venv/bin/python -m benchmarks.xgrammar_skew /tmp/xg_old/bin/python
"""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
import xgrammar as xgr
compile = {"regex": xgr.Grammar.from_regex, "json_schema": xgr.Grammar.from_json_schema,
           "ebnf_grammar": xgr.Grammar.from_ebnf}
verdicts = []
for kind, text in json.load(sys.stdin):
    try:
        compile[kind](text)
        verdicts.append(None)
    except Exception as exc:
        verdicts.append(" ".join(str(exc).split())[:160])
print(json.dumps(verdicts))
"""


def main(python: str) -> int:
    from tests.unit.test_guide_check import BOTH_ACCEPT, OLDER_XGRAMMAR_REFUSES

    cases = [(kind, text, True) for kind, text, _ in OLDER_XGRAMMAR_REFUSES] + \
            [(kind, text, False) for kind, text in BOTH_ACCEPT]
    run = subprocess.run([python, "-c", PROBE], input=json.dumps([c[:2] for c in cases]), capture_output=True,
                         text=True, check=True)
    verdicts = json.loads(run.stdout)
    wrong = 0
    for (kind, text, refused), verdict in zip(cases, verdicts):
        if (verdict is not None) != refused:
            wrong += 1
            print(f"{kind} {text!r}: expected {'a refusal' if refused else 'a compile'}, got {verdict or 'a compile'}")
    print(f"{len(cases) - wrong}/{len(cases)} cases as the tables say")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else sys.executable))
