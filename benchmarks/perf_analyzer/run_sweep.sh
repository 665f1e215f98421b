#!/usr/bin/env bash
# perf_analyzer streaming gRPC concurrency sweep (both `tensorrt_llm` and `ensemble`) over the workload in
# benchmarks/workload.py. Installs perf_analyzer into build/perf_analyzer if needed, starts Triton from
# build/bench/model_repository unless --grpc-url is given. Arguments go to `python -m benchmarks.pa_sweep`
# (--quick, --models, --concurrency, --grpc-url, --results-dir ...).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
bash "$ROOT/benchmarks/perf_analyzer/install.sh" "$PY" "${PA_DIR:-$ROOT/build/perf_analyzer}"
cd "$ROOT"
exec "$PY" -m benchmarks.pa_sweep --pa-dir "${PA_DIR:-$ROOT/build/perf_analyzer}" "$@"
