#!/bin/sh
# Build the model repository for the GPU this container runs on, through a cache keyed by
# GPU model and TensorRT version, then copy it to the folder Triton serves.
#   build-engines MANIFEST CACHE_DIR SERVE_DIR [trtbuild engines options...]
# A new node type or a TensorRT upgrade gets a new key, so it builds once; an unchanged key
# rebuilds nothing (trtbuild compares input hashes and tool versions with each build.json).
set -eu
manifest=$1 cache=$2 serve=$3
shift 3
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | tr -c 'A-Za-z0-9.\n-' '_' || true)
trt=$(python3 -c 'import tensorrt; print(tensorrt.__version__)' 2>/dev/null || echo none)
key="${gpu:-cpu}_trt-${trt}"
repo="$cache/$key/model_repository"
mkdir -p "$cache/$key"
echo "build-engines: cache key $key"
# One builder per key at a time; the others wait and then find the build unchanged.
flock "$cache/$key/.lock" trtbuild engines --manifest "$manifest" --repository "$repo" "$@"
mkdir -p "$serve"
# Model folders only: a dead build's .staging-*/.trash-* folder would make Triton fail to start, and
# the lock file is the builder's business.
for entry in "$repo"/*; do
  if [ -d "$entry" ] || [ "$(basename "$entry")" = build_report.json ]; then cp -a "$entry" "$serve/"; fi
done
echo "build-engines: $(ls "$serve" | wc -l) entries ready in $serve"
