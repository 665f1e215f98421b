#!/bin/sh
# Init step of every server pod: wait until the engine Job has published an engine (the pod shows
# Init:0/1 meanwhile, not a crash loop), then let Triton start.
set -eu
repo=/cache/current/model_repository
until [ -f /cache/current/engine/engine_config.json ] && [ -d "$repo" ]; do
  echo "waiting for the engine Job to publish /cache/current ..."
  sleep 15
done
echo "engine: $(readlink /cache/current)"
