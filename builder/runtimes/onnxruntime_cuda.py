"""ONNX Runtime's CUDA execution provider (the onnxruntime-gpu wheel): the GPU runtime where TensorRT
is absent. The variant ONNX is the artifact; Triton serves it on a GPU instance group, either through
our python-backend runner (one session per batch bucket, IO binding, CUDA graphs) or through the NGC
image's native onnxruntime backend (CUDA provider, optionally handing subgraphs to TensorRT in FP16)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from numpy.typing import NDArray

from builder.errors import RuntimeUnavailableError
from builder.repository import python_model
from builder.repository.onnx_files import copy_model
from builder.repository.triton_config import BackendConfig, InstanceKind, TritonBackend
from builder.runtimes.base import CompileTarget, Outputs
from builder.runtimes.onnxruntime import run_session
from builder.spec.enums import ServingBackend
from common.choices import Choice

_RUNNER: Any = python_model  # untyped: the file Triton's python backend imports, which imports nothing of ours

log = logging.getLogger(__name__)

CUDA_PROVIDER = "CUDAExecutionProvider"


class CudnnSearch(Choice):
    """ONNX Runtime's cudnn_conv_algo_search. Measured on an H100 with the bucket runner (one shape per
    session, so any search runs once, at load): HEURISTIC ran as fast as EXHAUSTIVE (within 5 %) and
    loaded 1.5-3x sooner, so it is the default."""

    EXHAUSTIVE = "EXHAUSTIVE"
    HEURISTIC = "HEURISTIC"
    DEFAULT = "DEFAULT"

    @property
    def triton_code(self) -> str:
        # The native onnxruntime backend takes the search mode as a number (0 = EXHAUSTIVE).
        return str(list(CudnnSearch).index(self))


class CudaLayout(Choice):
    """The CUDA provider's tensor layout for convolutions (its `prefer_nhwc` option). Measured on an H200,
    EfficientNet-Lite0 at batch 64 with IO binding: NHWC ran FP16 1.20x and FP32 with TF32 1.26x as fast as
    NCHW at 15 % less energy per inference; FP32 without TF32 (FP32 math, `--cuda-tf32 auto`'s choice for
    FP32 graphs) 0.95x at 9 % more energy (8539 vs 8950 img/s, bench/gpu/results/2026-11-22-h200-inprocess-
    tf32.json), the INT8 Q/DQ graph 0.52x. `auto` takes NHWC where convolutions run on tensor cores (FP16
    graphs, FP32 graphs with TF32 on, each with a Conv) and NCHW for the rest: on a graph with no convolution
    (MiniLM FP16, H200) NHWC added 50 host-device copies and served 0.25x NCHW's rate."""

    AUTO = "auto"
    NHWC = "nhwc"
    NCHW = "nchw"


class CudaTF32(Choice):
    """TF32 tensor-core math for FP32 convolutions and matmuls (the provider's `use_tf32`, on by default in
    ONNX Runtime). TF32 keeps 10 mantissa bits: the FP32 EfficientNet-Lite0 on an H200 differed from the
    CPU's FP32 by up to 0.0093 in its logits, past the FP32 gate (max_rel 1e-4). `auto` turns it off for
    FP32 graphs (no FP16 tensors, no Q/DQ: their users asked for FP32 math) and leaves it on for the rest."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


def graph_kind(path: Path) -> str:
    """'qdq' (INT8: any Q/DQ node), 'fp16' (any FP16 tensor: weight, Constant, input, output, value_info, or a
    Cast or dtype to FP16) or 'fp32', looking into subgraphs and local functions; the weights are not loaded.
    The python runner's own code decides, so the build and the runner cannot disagree; the build hands its
    answer to the runner as the config parameter `graph_kind`. One analysis per file: the accuracy run, the
    config and build.json all ask about the same artifact (a graph with 200 MB of weights inside took 0.28 s to
    parse on a 2-core CPU; the weights of a model over 2 GB live outside it and are not read)."""
    return _facts(path)[0]


def graph_convolutions(path: Path) -> bool:
    """Whether the graph has a convolution (Conv, ConvTranspose, FusedConv; subgraphs and local functions too):
    NHWC pays only there (see CudaLayout). From the same one analysis as graph_kind; the build hands the answer
    on as the config parameter `graph_convolutions`."""
    return _facts(path)[1]


def _facts(path: Path) -> tuple[str, bool]:
    stat = path.stat()
    return _facts_of(str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _facts_of(path: str, inode: int, size: int, mtime_ns: int) -> tuple[str, bool]:
    """The runner's graph analysis for one version of one file (a rewritten file is another key)."""
    kind, convolutions = _RUNNER._graph_facts(path)
    return str(kind), bool(convolutions)


@dataclass(frozen=True)
class CudaOptions:
    device_id: int = 0
    cudnn_conv_algo_search: CudnnSearch = CudnnSearch.HEURISTIC
    cuda_graphs: bool = True  # python runner: one CUDA graph per bucket where every node is on the GPU
    tensorrt_fp16: bool = False  # native onnxruntime backend: gpu_execution_accelerator tensorrt, FP16
    layout: CudaLayout = CudaLayout.AUTO
    tf32: CudaTF32 = CudaTF32.AUTO

    def __post_init__(self) -> None:
        object.__setattr__(self, "cudnn_conv_algo_search", CudnnSearch.parse(
            self.cudnn_conv_algo_search, "--cudnn-conv-algo-search", error=RuntimeUnavailableError))
        object.__setattr__(self, "layout", CudaLayout.parse(self.layout, "--cuda-layout",
                                                            error=RuntimeUnavailableError))
        object.__setattr__(self, "tf32", CudaTF32.parse(self.tf32, "--cuda-tf32", error=RuntimeUnavailableError))
        if self.device_id < 0:
            raise RuntimeUnavailableError(f"CUDA device id {self.device_id}: expected 0 or more")

    def provider_options(self, artifact: Path | None = None) -> dict[str, str]:
        """The CUDA provider's options; with `artifact`, the layout `auto` resolved for that graph."""
        options = {"device_id": str(self.device_id), "cudnn_conv_algo_search": self.cudnn_conv_algo_search.value}
        kind = graph_kind(artifact) if artifact is not None else None
        tf32_off = self.tf32 is CudaTF32.OFF or (self.tf32 is CudaTF32.AUTO and kind == "fp32")
        # NHWC pays where convolutions run on tensor cores: FP16, or FP32 with TF32 (see CudaLayout).
        tensor_cores = kind == "fp16" or (kind == "fp32" and not tf32_off)
        auto_nhwc = tensor_cores and artifact is not None and graph_convolutions(artifact)
        if self.layout is CudaLayout.NHWC or (self.layout is CudaLayout.AUTO and auto_nhwc):
            options["prefer_nhwc"] = "1"
        if tf32_off:
            options["use_tf32"] = "0"
        return options

    def runner_layout(self) -> str:
        """The python runner's `prefer_nhwc` parameter: 1, 0 or auto (resolved where the model loads)."""
        return {CudaLayout.NHWC: "1", CudaLayout.NCHW: "0"}.get(self.layout, "auto")

    def runner_tf32(self) -> str:
        """The python runner's `use_tf32` parameter: 1, 0 or auto (resolved where the model loads)."""
        return {CudaTF32.ON: "1", CudaTF32.OFF: "0"}.get(self.tf32, "auto")

    def record(self) -> dict[str, str]:
        """What build.json keeps: the provider and each option that changes how the artifact runs."""
        return {"provider": CUDA_PROVIDER, **self.provider_options(), "layout": self.layout.value,
                "tf32": self.tf32.value,
                "cuda_graphs": str(self.cuda_graphs).lower(), "tensorrt_fp16": str(self.tensorrt_fp16).lower()}


def _gpu_count() -> tuple[int, str | None]:
    """NVIDIA GPUs NVML sees, and why none where it sees none."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount()), None
        finally:
            pynvml.nvmlShutdown()
    except ImportError:
        return 0, "nvidia-ml-py is not installed"
    except Exception as exc:  # noqa: BLE001 - pynvml raises its own NVMLError family
        return 0, f"NVML: {exc}"


def cuda_unavailable_reason() -> str | None:
    """None where ONNX Runtime's CUDA provider can run here; otherwise why not, in a few words."""
    if CUDA_PROVIDER not in ort.get_available_providers():
        return (f"onnxruntime {ort.__version__} here has no CUDA provider (the CPU wheel is installed; "
                "`make install GPU=1` replaces it with onnxruntime-gpu)")
    count, why = _gpu_count()
    if count == 0:
        return f"no NVIDIA GPU answers ({why or 'NVML counts none'})"
    return None


def cuda_available() -> bool:
    return cuda_unavailable_reason() is None


def cuda_session(path: Path, options: CudaOptions, *, log_file: Path | None) -> ort.InferenceSession:
    """An ONNX Runtime session on the CUDA provider; where the provider does not start, the error names
    `log_file` (the build log, where ONNX Runtime writes why), else points at ONNX Runtime's lines above."""
    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()  # CUDA and cuDNN from the nvidia-* pip packages, where installed
    session_options = ort.SessionOptions()
    session_options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session_options.log_severity_level = 3

    # The runner's session maker: ONNX Runtime 1.31's plugin-EP warnings off while it is made (six such lines amid
    # make demo's verify table on an H200, 2026-11-29), and a provider that did not start made again with them on.
    session = _RUNNER._cuda_session(str(path), session_options, options.provider_options(path))
    if _RUNNER._no_cuda(path, session) is not None:
        # ONNX Runtime writes why to file descriptor 2, which a build sends to its build log.
        where = f"see {log_file}" if log_file is not None else "see ONNX Runtime's lines above"
        raise RuntimeUnavailableError(f"{path}: ONNX Runtime did not start its CUDA provider (CUDA or cuDNN "
                                      f"libraries missing?); {where}")
    return session


def run_padded(session: ort.InferenceSession, samples: Mapping[str, NDArray[Any]], batch_size: int) -> Outputs:
    """Every sample in batches of exactly batch_size (the last one padded, its padding dropped): a CUDA
    session whose input shape changes rebuilds its cuDNN state, seconds per change in FP16."""
    count = len(next(iter(samples.values())))
    names = [o.name for o in session.get_outputs()]
    chunks: dict[str, list[NDArray[Any]]] = {n: [] for n in names}
    for start in range(0, count, batch_size):
        rows = min(batch_size, count - start)
        feed = {}
        for k, v in samples.items():
            part = v[start : start + rows]
            if rows < batch_size and count >= batch_size:
                part = np.concatenate([part, v[: batch_size - rows]])
            feed[k] = np.ascontiguousarray(part)
        for name, value in zip(names, session.run(names, feed), strict=True):
            chunks[name].append(np.asarray(value)[:rows])
    return {n: np.concatenate(parts) for n, parts in chunks.items()}


class OnnxRuntimeCUDA:
    """The variant ONNX is the artifact; it runs (accuracy check, serving) on ONNX Runtime's CUDA provider."""

    name = "onnxruntime-cuda"
    artifact = "model.onnx"

    def __init__(self, serving_backend: ServingBackend = ServingBackend.PYTHON,
                 options: CudaOptions | None = None, *, log_file: Path | None = None) -> None:
        reason = cuda_unavailable_reason()
        if reason is not None:
            raise RuntimeUnavailableError(f"--runtime {self.name}: {reason}")
        self.serving_backend = serving_backend
        self.options = options or CudaOptions()
        self.log_file = log_file  # the build log, where ONNX Runtime writes why its CUDA provider did not start
        if serving_backend is ServingBackend.ONNXRUNTIME:
            # The native backend's config has no layout parameter here: the accuracy run must use the layout
            # it will serve with, NCHW.
            if self.options.layout is CudaLayout.NHWC:
                raise RuntimeUnavailableError("--cuda-layout nhwc: the native onnxruntime backend "
                                              "(--serving-backend onnxruntime) is configured without it; "
                                              "use auto or nchw, or the python runner")
            # Nor a use_tf32 parameter: it serves with ONNX Runtime's default, TF32 on, for FP32 graphs too, so
            # the accuracy run does the same (with auto it turned TF32 off and gated math the server never ran).
            if self.options.tf32 is CudaTF32.OFF:
                raise RuntimeUnavailableError("--cuda-tf32 off: the native onnxruntime backend "
                                              "(--serving-backend onnxruntime) is configured without it and "
                                              "serves with TF32 on; use auto or on, or the python runner")
            self.options = replace(self.options, layout=CudaLayout.NCHW, tf32=CudaTF32.ON)
        if self.options.tensorrt_fp16 and serving_backend is not ServingBackend.ONNXRUNTIME:
            raise RuntimeUnavailableError("--ort-tensorrt-fp16: needs --serving-backend onnxruntime (the NGC "
                                          "image's native backend); the bundled server has no TensorRT")

    def identity(self) -> dict[str, str]:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.options.device_id)
            gpu, driver = str(pynvml.nvmlDeviceGetName(handle)), str(pynvml.nvmlSystemGetDriverVersion())
        finally:
            pynvml.nvmlShutdown()
        return {"onnxruntime": ort.__version__, "serving_backend": self.serving_backend.value, "gpu": gpu,
                "driver": driver, **self.options.record()}

    def served_options(self, artifact: Path) -> dict[str, str]:
        """The CUDA provider's options with `auto` resolved for this graph (layout, TF32), as the accuracy run
        used them and as the python runner resolves them when the model loads."""
        return self.options.provider_options(artifact)

    def carry_over(self, previous: Path, version_dir: Path, target: CompileTarget) -> None:
        """Nothing to carry: the artifact is the variant ONNX itself."""

    def compile(self, onnx_path: Path, out_path: Path, target: CompileTarget) -> None:
        copy_model(onnx_path, out_path)  # with its data file, if it has one (a model over 2 GB)

    def run(self, artifact: Path, samples: Mapping[str, NDArray[Any]], batch_size: int | None) -> Outputs:
        session = cuda_session(artifact, self.options, log_file=self.log_file)
        if batch_size is None:  # no batch axis: each sample whole, as on the CPU
            return run_session(session, samples, None)
        return run_padded(session, samples, batch_size)

    def backend_config(self, target: CompileTarget, version_dir: Path) -> BackendConfig:
        if self.serving_backend is not ServingBackend.PYTHON:
            return cuda_backend_config(self.serving_backend, self.options)
        artifact = version_dir / self.artifact
        return cuda_backend_config(self.serving_backend, self.options, graph_kind(artifact),
                                   graph_convolutions(artifact))


# The python runner's instances per GPU where models.toml names none. One instance serializes each batch's Python
# work (reading requests, building responses: about half of Triton's compute_infer) with its GPU run; measured
# on an H100, FP16 EfficientNet-Lite0 at concurrency 256, 1/2/4 instances served 0.31x/0.44x/0.61x of the
# in-process ceiling (4: 0.55-0.62x over two machine starts), with J/inference 0.046/0.039/0.036; at
# concurrency 32, 2 served more than 4 (docs/results/gpu.md): `trtbuild tune` finds a model's own count.
GPU_RUNNER_INSTANCES = 4


def cuda_backend_config(serving_backend: ServingBackend, o: CudaOptions, kind: str | None = None,
                        convolutions: bool | None = None) -> BackendConfig:
    """A GPU instance group; the python runner gets provider cuda and its options, the native
    onnxruntime backend the CUDA provider's search mode and, with tensorrt_fp16, TensorRT in FP16.
    `kind`: the artifact's graph_kind, which the runner's `auto` options are resolved from (the runner reads the
    graph itself where the parameter is absent); `convolutions`: whether it has any (NHWC's `auto` needs them)."""
    if serving_backend is ServingBackend.ONNXRUNTIME:
        accelerator: tuple[tuple[str, str], ...] = ()
        if o.tensorrt_fp16:
            accelerator = (("precision_mode", "FP16"), ("trt_engine_cache_enable", "1"),
                           ("trt_engine_cache_path", "/tmp/triton-trt-cache"))
        return BackendConfig(backend=TritonBackend.ONNXRUNTIME, artifact=OnnxRuntimeCUDA.artifact,
                             instance_kind=InstanceKind.GPU,
                             parameters=(("cudnn_conv_algo_search", o.cudnn_conv_algo_search.triton_code),),
                             tensorrt_accelerator=accelerator)
    return BackendConfig(backend=TritonBackend.PYTHON, artifact=OnnxRuntimeCUDA.artifact,
                         instance_kind=InstanceKind.GPU, default_instances=GPU_RUNNER_INSTANCES,
                         parameters=(("provider", "cuda"), ("device_id", str(o.device_id)),
                                     ("cudnn_conv_algo_search", o.cudnn_conv_algo_search.value),
                                     ("cuda_graphs", "1" if o.cuda_graphs else "0"),
                                     ("prefer_nhwc", o.runner_layout()),
                                     ("use_tf32", o.runner_tf32()),
                                     *((("graph_kind", kind),) if kind is not None else ()),
                                     *((("graph_convolutions", "1" if convolutions else "0"),)
                                       if convolutions is not None else ()),
                                     # Inputs a client sent through CUDA shared memory reach the runner
                                     # as device tensors (copied on the GPU into its bound buffers)
                                     # instead of being staged through host memory by the backend.
                                     ("FORCE_CPU_ONLY_INPUT_TENSORS", "no")))
