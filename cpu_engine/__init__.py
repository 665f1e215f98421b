"""The CPU engine: in-flight batching over a paged KV cache, behind the TensorRT-LLM backend's tensor interface.

Its numba kernels are cached on disk under a stamp of all of the package's numba code (cpu_engine.numba_cache),
set up here, before any kernel is defined.
"""

from pathlib import Path

from cpu_engine import numba_cache

numba_cache.install(Path(__file__).parent)
