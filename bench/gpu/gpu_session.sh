#!/usr/bin/env bash
# The GPU benchmarks on a lent GPU machine, in back-to-back calls of the device tool (the machine keeps
# /tmp and its interpreter only while warm, 30 s after a call; see ../shared/GPU.md):
#   part N     (carry .gpuparts/pN)                   append one 60 MB part of the onnxruntime-gpu wheel
#   install    (carry .gpuparts/p4 .gpuwhl/b .gpuwhl/c) last part; onnxruntime-gpu and numpy 1.26.4 into the
#              interpreter (Triton's python stub imports its site-packages first; with numpy 2 the bundled
#              Triton's stub answers with empty outputs), tritonclient + python-rapidjson under /tmp/site
#   site       (carry .gpuwhl/a .gpuwhl/d)            nvidia-pytriton, pydantic, tomlkit, ... and cuda-python
#              (for --shared-memory cuda and the runner's device copies) under /tmp/site
#   models DIR... (carry them)                         copy prepared model folders to /tmp/models
#   validate [--load MODEL:SHM ...]                   the gpu tests, then validate_gpu.py check on /tmp/models
#   bench [bench_ort.py options]  (carry .gpumodels)   bench/gpu/bench_ort.py; results under $OUT
#   tune [tune_energy.py options] (carry .gpumodels)   bench/gpu/tune_energy.py; results under $OUT
set -u
WHEEL=/tmp/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl
SHA=05d548956197b9d01f59b625de740e0d6be3593f874e241a12dc0362650ecdf7  # of the whole wheel, checked here
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check "$@"; }
ready() {
  python3 -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())" \
    || { echo "onnxruntime-gpu is not installed: run the part and install steps first" >&2; exit 1; }
  python3 -c "import numpy, sys; sys.exit(int(numpy.__version__.split('.')[0]) >= 2)" \
    || { echo "numpy >= 2 in python3: run the install step first" >&2; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
  nvidia-smi --query-gpu=name,driver_version,power.limit,power.draw,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
  python3 -c "import onnxruntime as o, numpy; o.preload_dlls(); print('onnxruntime', o.__version__, 'numpy', numpy.__version__)" \
    | tee -a "$OUT/gpu.txt"
}
case "${1:-}" in
part)
  mkdir -p /tmp/parts && cp ".gpuparts/p$2/"* /tmp/parts/ && ls -l /tmp/parts | tail -n +2 ;;
install)
  mkdir -p /tmp/parts && cp .gpuparts/p4/* /tmp/parts/ || exit 1
  cat /tmp/parts/part.* > "$WHEEL"
  echo "$SHA  $WHEEL" | sha256sum -c - || { ls -l /tmp/parts; exit 1; }
  python3 -m pip uninstall -q -y onnxruntime
  pipi "$WHEEL" && pipi .gpuwhl/c/numpy-1.26.4-*.whl || exit 1
  pipi --upgrade --target /tmp/site .gpuwhl/b/*.whl || exit 1
  python3 -c "import numpy, onnxruntime as o; print('numpy', numpy.__version__, 'onnxruntime', o.__version__, o.get_available_providers())" ;;
site)
  pipi --upgrade --target /tmp/site .gpuwhl/a/*.whl || exit 1
  if python3 -c "from cuda.bindings import runtime" 2>/dev/null; then echo "cuda-python: the machine's own"
  else pipi --upgrade --target /tmp/site .gpuwhl/d/*.whl || exit 1; fi
  PYTHONPATH=/tmp/site python3 -c "from cuda.bindings import runtime as r; print('cuda-bindings', r.cudaRuntimeGetVersion())"
  ls /tmp/site | tr '\n' ' ' ;;
models)
  shift; mkdir -p /tmp/models && for m in "$@"; do cp -r "$m" /tmp/models/; done; ls /tmp/models ;;
validate)
  shift; ready
  timeout 120 python3 -m pytest -q -p no:cacheprovider --noconftest -m gpu tests/builder/runtimes/test_onnxruntime_cuda.py \
    2>&1 | tail -15 | tee "$OUT/pytest_gpu.txt"
  timeout "${VALIDATE_TIMEOUT_S:-360}" python3 bench/gpu/validate_gpu.py check --repository /tmp/models --out "$OUT/v" "$@" 2>&1 \
    | grep -v "Fallback mode" | tee "$OUT/validate.log" | tail -c 7000
  echo "validate rc=${PIPESTATUS[0]}"
  grep -v "Fallback mode" "$OUT/v/state/"*.log 2>/dev/null | tail -200 > "$OUT/triton_tail.log" ;;
bench)
  shift; ready
  timeout "${BENCH_TIMEOUT_S:-560}" python3 bench/gpu/bench_ort.py --models .gpumodels --out "$OUT" "$@" 2>&1 \
    | grep -v "Fallback mode" | tee "$OUT/bench.log" | grep -v "^INFO\|^DEBUG" | tail -c 9000
  echo "bench_ort rc=${PIPESTATUS[0]}"
  nvidia-smi --query-gpu=power.draw,temperature.gpu --format=csv,noheader | tee -a "$OUT/gpu.txt" ;;
tune)
  shift; ready
  timeout "${TUNE_TIMEOUT_S:-420}" python3 bench/gpu/tune_energy.py --models .gpumodels --out "$OUT" "$@" 2>&1 \
    | grep -v "Fallback mode" | tee "$OUT/run.log" | tail -c 9000
  echo "tune_energy rc=${PIPESTATUS[0]}" ;;
*)
  echo "usage: $0 part N | install | site | models DIR... | validate [--load M:SHM] | bench [...] | tune [...]" >&2
  exit 2 ;;
esac
