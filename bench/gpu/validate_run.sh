#!/usr/bin/env bash
# The validation call on a lent GPU machine (bench/gpu/validate_gpu.py): earlier calls installed
# onnxruntime-gpu into the interpreter, the small wheels under /tmp/site and copied the GPU
# repository's models under /tmp/models (MODEL FOLDERS given here are copied too). Writes to $OUT.
# Install numpy<2 into the interpreter first (numpy-1.26.4 cp312 wheel): with the machine's numpy 2 the
# bundled Triton's python stub answers with empty output tensors (bench/gpu/results/2026-11-22-h100-validate.json).
set -u
for m in "$@"; do cp -r "$m" /tmp/models/; done
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import onnxruntime as o; o.preload_dlls(); print('onnxruntime', o.__version__, o.get_available_providers())" | tee -a "$OUT/gpu.txt"
python3 -c "from cuda.bindings import runtime; print('cuda-bindings present')" 2>&1 | tail -1 | tee -a "$OUT/gpu.txt"
python3 -c "import numpy; print('numpy', numpy.__version__)" | tee -a "$OUT/gpu.txt"
timeout 330 python3 bench/gpu/validate_gpu.py check --repository /tmp/models --out "$OUT/v" \
  --load efficientnet_lite0_fp16:system --load minilm_l6_v2_fp16:system ${EXTRA_LOADS:-} 2>&1 \
  | grep -v "Fallback mode" | tee "$OUT/validate.log" | tail -c 7000
echo "validate rc=${PIPESTATUS[0]}"
timeout 100 python3 -m pytest -q -p no:cacheprovider --noconftest -m gpu tests/builder/runtimes/test_onnxruntime_cuda.py \
  2>&1 | tail -15 | tee "$OUT/pytest_gpu.txt"
grep -v "Fallback mode" "$OUT/v/state/"*.log 2>/dev/null | tail -200 > "$OUT/triton_tail.log"
