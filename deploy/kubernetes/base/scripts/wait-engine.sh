#!/bin/sh
# Init step of every server pod: wait until the engine Job has built this pod's ENGINE_KEY (the pod stays
# in Init meanwhile, not a crash loop), then let Triton start. The pod serves /cache/$ENGINE_KEY for its whole
# life (build-engine.sh): a later run of the Job for another key changes nothing here.
set -eu
case "${ENGINE_KEY:-}" in
  "" | .* | */*) echo "error: ENGINE_KEY=${ENGINE_KEY:-} is not a folder name" >&2; exit 1 ;;
esac
dir="/cache/$ENGINE_KEY"
until [ -f "$dir/engine/engine_config.json" ] && [ -d "$dir/model_repository" ]; do
  echo "waiting for the engine Job to build ENGINE_KEY=$ENGINE_KEY into $dir (kubectl logs job/engine-build) ..."
  sleep 15
done
echo "engine: $dir"
