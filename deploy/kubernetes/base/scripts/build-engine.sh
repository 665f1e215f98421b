#!/bin/sh
# The engine Job: build the TensorRT-LLM engine named ENGINE_KEY once, for every replica, into the
# engine-cache volume: /cache/$ENGINE_KEY/ = engine/, model_repository/ (Triton's), hf/ (the checkpoint as
# this key serves it: tokenizer, template and configs copied, weights linked; engine_key.py).
#
# The server pods serve /cache/<ENGINE_KEY of their own pod template> (the ConfigMap tritonllm-engine in
# base/kustomization.yaml), never a link that a later run could move: a key, once built, never changes under
# them, whether a Triton container restarts, a frontend restarts or a pod is added. A run for a key already
# built from the same checkpoint (SHA-256), TensorRT-LLM version (the image), TP size and PP size (PP_SIZE,
# pipeline stages: 1 unless overlays/multinode sets it) does nothing; a run for a key built from anything else
# fails. To serve another checkpoint or image: a new ENGINE_KEY, which
# rolls the Deployment (its new pods wait for this Job; the old ones serve their key meanwhile).
set -eu
case "${ENGINE_KEY:-}" in
  "" | .* | */*) echo "error: ENGINE_KEY=${ENGINE_KEY:-} is not a folder name" >&2; exit 1 ;;
esac
dir="/cache/$ENGINE_KEY"
pp=${PP_SIZE:-1}
version=$(python -c 'import tensorrt_llm; print(tensorrt_llm.__version__)')
sha=$(python -c 'import sys; from build_engine.trtllm import checkpoint_sha256; print(checkpoint_sha256(sys.argv[1]))' /models/hf)
echo "engine key $ENGINE_KEY: TensorRT-LLM $version, TP size $TP_SIZE, PP size $pp, checkpoint SHA-256 $sha"
status=0
python /scripts/engine_key.py built "$dir" "$version" "$TP_SIZE" "$sha" "$pp" || status=$?
case $status in
  0) exit 0 ;;   # built already, from the same checkpoint, image, TP and PP size
  10) ;;         # not built yet (or a run that did not finish: the build starts over)
  *) exit 1 ;;   # built from something else: refused (engine_key.py said why)
esac
rm -rf "$dir/hf"
python /scripts/engine_key.py snapshot /models/hf "$dir/hf"
# What `make engine BACKEND=trtllm MODEL=...` runs, from the snapshot (its configs then name /cache/$ENGINE_KEY/hf,
# served as model "hf" like /models/hf), with the TP (and PP) size and the key's folder. engine_config.json
# comes last. --pp-size only when there are pipeline stages, so that the single-node overlays run the same
# command as `make engine`.
if [ "$pp" = 1 ]; then
  python -m build_engine --backend trtllm --model "$dir/hf" --output-dir "$dir" --tp-size "$TP_SIZE"
else
  python -m build_engine --backend trtllm --model "$dir/hf" --output-dir "$dir" --tp-size "$TP_SIZE" --pp-size "$pp"
fi
echo "built $dir: the server pods whose ENGINE_KEY is $ENGINE_KEY serve it"
