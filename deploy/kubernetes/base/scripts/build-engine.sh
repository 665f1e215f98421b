#!/bin/sh
# The engine Job: build a TensorRT-LLM engine once, for every replica, into the engine-cache volume.
#
# The cache key is what an engine depends on: the TensorRT-LLM version (an engine only loads in the version
# that built it, i.e. the image), the tensor-parallel size and a SHA-256 of the checkpoint (the same hash
# build_engine records in engine_config.json). A key already built is reused (build_engine --if-missing);
# `current` then points at it, atomically, and the pods serve whatever `current` names when they start.
set -eu
cache=/cache
version=$(python -c 'import tensorrt_llm; print(tensorrt_llm.__version__)')
sha=$(python -c 'import sys; from build_engine.trtllm import checkpoint_sha256; print(checkpoint_sha256(sys.argv[1]))' /models/hf)
key="trtllm${version}-tp${TP_SIZE}-$(printf %.16s "$sha")"
echo "engine cache key: $key"
# What `make engine BACKEND=trtllm MODEL=/models/hf` runs, with the TP size and the cache folder.
python -m build_engine --backend trtllm --model /models/hf --output-dir "$cache/$key" \
  --tp-size "$TP_SIZE" --if-missing
ln -sfn "$key" "$cache/.current.tmp"
mv -T "$cache/.current.tmp" "$cache/current"
echo "serving $cache/current -> $key"
