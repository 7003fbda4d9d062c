#!/usr/bin/env bash
# The measuring call on a lent GPU machine (see README "ONNX Runtime CUDA on a GPU"): the wheels were
# installed by earlier calls under /tmp/ortsite (onnxruntime-gpu) and /tmp/site (nvidia-pytriton,
# tritonclient, python-rapidjson, pydantic, tomlkit); MODELS holds the trtbuild variants. Writes to $OUT.
set -u
MODELS=${1:-.gpumodels}
# Triton's python stubs import the interpreter's own site-packages before PYTHONPATH: swap its CPU
# onnxruntime for the GPU wheel there, as `make install-gpu` does in the project's venv.
if ! python3 -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())"; then
  python3 -m pip uninstall -q -y onnxruntime
  python3 -m pip install -q --no-index --no-deps --no-compile /tmp/onnxruntime_gpu-1.31.1-*.whl
fi
# The bundled Triton 2.51 python stub answers with empty output tensors under numpy 2 (the machine's):
# refuse to measure unless numpy < 2 was installed into the interpreter by an earlier call.
if ! python3 -c "import numpy, sys; sys.exit(int(numpy.__version__.split('.')[0]) >= 2)"; then
  echo "numpy >= 2 in python3: install a numpy 1.26 wheel first (see bench/gpu/validate_run.sh)" >&2; exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import onnxruntime as o; o.preload_dlls(); print('onnxruntime', o.__version__, o.get_available_providers())"
# --noconftest: the suite's conftest builds the tiny repository (ModelOpt, absent here); these tests need none of it.
timeout 60 python3 -m pytest -q -p no:cacheprovider --noconftest -m gpu tests/builder/runtimes/test_onnxruntime_cuda.py \
  2>&1 | tail -8 | tee "$OUT/pytest_gpu.txt"
timeout 540 python3 bench/gpu/bench_ort.py --models "$MODELS" --out "$OUT" ${BENCH_ARGS:-} 2>&1 \
  | tee "$OUT/bench.log" | grep -v "^INFO\|^DEBUG"
