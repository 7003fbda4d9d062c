#!/bin/sh
# Build the model repository for the GPU this container runs on, through a cache keyed by
# GPU model and TensorRT version, then copy it to the folder Triton serves.
#   build-engines MANIFEST CACHE_DIR SERVE_DIR [trtbuild engines options...]
# SERVE_GPU_COUNT=N (the multi-GPU overlay sets it to the pod's nvidia.com/gpu): the GPU variants in
# SERVE_DIR are then served on GPUs 0..N-1, each instance group's count on every one of them, as
# `trtbuild serve --gpus 0,..,N-1` would place them; the cache keeps the builder's configs as written.
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
if [ -n "${SERVE_GPU_COUNT:-}" ]; then
  case $SERVE_GPU_COUNT in
    ''|*[!0-9]*|0) echo "build-engines: SERVE_GPU_COUNT=$SERVE_GPU_COUNT: expected a count of GPUs (1, 2, ...)" >&2; exit 2 ;;
  esac
  # The pod's GPUs are 0..N-1 inside it; a count that differs from what this container sees would leave
  # Triton configs naming GPUs that are not there.
  seen=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  if [ "$seen" != "$SERVE_GPU_COUNT" ]; then
    echo "build-engines: SERVE_GPU_COUNT=$SERVE_GPU_COUNT but this container sees ${seen:-0} GPUs (nvidia-smi -L)" >&2
    exit 1
  fi
  gpus=$(seq -s, 0 $((SERVE_GPU_COUNT - 1)))
  python3 - "$serve" "$gpus" <<'PY'
import os
import sys
from pathlib import Path

from builder.errors import BuilderError
from builder.repository.gpus import check_present, parse_gpu_list, place_on_gpus, visible_gpus
from builder.serving.triton_server import gpu_ids

try:
    serve, gpus = Path(sys.argv[1]), parse_gpu_list(sys.argv[2], "SERVE_GPU_COUNT")
    check_present(gpus, visible_gpus(gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES")), "SERVE_GPU_COUNT")
    for path in place_on_gpus(serve, gpus):
        print(f"build-engines: {path.parent.name}: instances on GPUs {sys.argv[2]}")
except BuilderError as exc:
    sys.exit(f"build-engines: {exc}")
PY
  rm -f "$serve/.trtbuild.lock"
fi
echo "build-engines: $(ls "$serve" | wc -l) entries ready in $serve"
