#!/usr/bin/env bash
# bench/gpu/tune_energy.py on a lent GPU machine, in back-to-back calls of the device tool (the
# machine keeps /tmp and its interpreter only while warm, 30 s after a call):
#   part N   (carry .gpuparts/pN)                     append one 60 MB part of the onnxruntime-gpu wheel
#   install  (carry .gpuparts/p4 .gpuwhl/b .gpuwhl/c) last part; onnxruntime-gpu and numpy 1.26.4 into the
#            interpreter (Triton's python stub imports its site-packages first; with numpy 2 the bundled
#            Triton's stub answers with empty outputs), tritonclient + python-rapidjson under /tmp/site
#   site     (carry .gpuwhl/a)                        nvidia-pytriton, pydantic, tomlkit, ... under /tmp/site
#   measure  (carry .gpumodels) [tune_energy.py options]   the tuning run; results under $OUT
set -u
WHEEL=/tmp/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl
SHA=05d548956197b9d01f59b625de740e0d6be3593f874e241a12dc0362650ecdf7  # of the whole wheel, checked here
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check "$@"; }
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
  ls /tmp/site | tr '\n' ' ' ;;
measure)
  shift
  python3 -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())" \
    || { echo "onnxruntime-gpu is not installed: run the part and install steps first" >&2; exit 1; }
  python3 -c "import numpy, sys; sys.exit(int(numpy.__version__.split('.')[0]) >= 2)" \
    || { echo "numpy >= 2 in python3: run the install step first" >&2; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
  nvidia-smi --query-gpu=name,driver_version,power.limit,power.draw,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
  timeout "${TUNE_TIMEOUT_S:-420}" python3 bench/gpu/tune_energy.py --models .gpumodels --out "$OUT" "$@" 2>&1 \
    | grep -v "Fallback mode" | tee "$OUT/run.log" | tail -c 9000
  echo "tune_energy rc=${PIPESTATUS[0]}"
  nvidia-smi --query-gpu=power.draw,temperature.gpu --format=csv,noheader | tee -a "$OUT/gpu.txt" ;;
*)
  echo "usage: $0 part N | install | site | measure [tune_energy.py options]" >&2; exit 2 ;;
esac
