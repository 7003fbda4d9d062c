"""Where variants execute: ONNX Runtime on the CPU, ONNX Runtime's CUDA provider where onnxruntime-gpu
and an NVIDIA GPU exist, or TensorRT where it and a GPU exist; `select()` picks one behind the
`Runtime` seam."""

from __future__ import annotations

import logging
from pathlib import Path

from builder.errors import RuntimeUnavailableError
from builder.runtimes.base import CompileTarget, Outputs, ReferenceExecutor, Runtime
from builder.runtimes.onnxruntime import OnnxRuntimeCPU, OnnxRuntimeReference
from builder.runtimes.onnxruntime_cuda import CudaOptions, OnnxRuntimeCUDA, cuda_available
from builder.runtimes.tensorrt import tensorrt_available
from builder.runtimes.tensorrt_plan import TrtBuildOptions
from builder.spec.enums import RuntimeChoice, ServingBackend
from builder.spec.settings import default_cache_dir

log = logging.getLogger(__name__)

__all__ = ["CompileTarget", "CudaOptions", "OnnxRuntimeCPU", "OnnxRuntimeCUDA", "OnnxRuntimeReference", "Outputs",
           "ReferenceExecutor", "Runtime", "cuda_available", "select", "tensorrt_available"]


def select(requested: RuntimeChoice, *, serving_backend: ServingBackend = ServingBackend.PYTHON,
           trt_options: TrtBuildOptions | None = None, cache_dir: Path | None = None,
           cuda_options: CudaOptions | None = None, log_file: Path | None = None) -> Runtime:
    """The runtime asked for; `auto` takes TensorRT, else ONNX Runtime CUDA, else ONNX Runtime CPU.
    `log_file`: the build log, where the native libraries' own messages go (common.logs.native_stderr_to_log);
    a runtime's errors name it."""
    requested = RuntimeChoice.parse(requested, "--runtime", error=RuntimeUnavailableError)
    serving_backend = ServingBackend.parse(serving_backend, "--serving-backend", error=RuntimeUnavailableError)
    if requested is RuntimeChoice.AUTO:
        if tensorrt_available():
            requested = RuntimeChoice.TENSORRT
        elif cuda_available():
            requested = RuntimeChoice.ONNXRUNTIME_CUDA
        else:
            requested = RuntimeChoice.ONNXRUNTIME
        log.debug("runtime: %s (auto)", requested)
    if cuda_options is not None and cuda_options.tensorrt_fp16 and requested is not RuntimeChoice.ONNXRUNTIME_CUDA:
        # asked for explicitly: one line rather than a config silently without it
        raise RuntimeUnavailableError(f"--ort-tensorrt-fp16: needs --runtime onnxruntime-cuda (this build runs "
                                      f"on {requested.value})")
    if requested is RuntimeChoice.TENSORRT:
        if not tensorrt_available():
            raise RuntimeUnavailableError(
                "--runtime tensorrt: TensorRT with a CUDA GPU is not available here; install it with "
                "pip install '.[tensorrt]' on a GPU machine, or build inside the NGC Triton container"
            )
        from builder.runtimes.tensorrt import TensorRTRuntime

        return TensorRTRuntime(trt_options or TrtBuildOptions(), cache_dir or default_cache_dir(), log_file=log_file)
    if requested is RuntimeChoice.ONNXRUNTIME_CUDA:
        return OnnxRuntimeCUDA(serving_backend, cuda_options, log_file=log_file)
    return OnnxRuntimeCPU(serving_backend)
