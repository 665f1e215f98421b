"""A strict contract double of TensorRT-LLM's C++ Triton backend (inflight_batcher_llm), for tests.

`rules.py`: what the backend checks and how it shapes responses, as pure Python (each rule cites the
upstream file and function it was read from). `double.py`: a Triton Python-backend model that enforces
those rules around the production CPU engine model, and `add_contract_double()` to add it to a model
repository.
"""
