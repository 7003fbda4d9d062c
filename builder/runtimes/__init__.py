"""Where variants execute: ONNX Runtime on the CPU, or TensorRT where it and a GPU exist; `select()`
picks one behind the `Runtime` seam."""

from __future__ import annotations

import logging
from pathlib import Path

from builder.errors import RuntimeUnavailableError
from builder.runtimes.base import CompileTarget, Outputs, Runtime
from builder.runtimes.onnxruntime import OnnxRuntimeCPU
from builder.runtimes.tensorrt import tensorrt_available
from builder.runtimes.tensorrt_plan import TrtBuildOptions
from builder.spec.enums import RuntimeChoice, ServingBackend
from builder.spec.settings import default_cache_dir

log = logging.getLogger(__name__)

__all__ = ["CompileTarget", "OnnxRuntimeCPU", "Outputs", "Runtime", "select", "tensorrt_available"]


def select(requested: RuntimeChoice, *, serving_backend: ServingBackend = ServingBackend.PYTHON,
           trt_options: TrtBuildOptions | None = None, cache_dir: Path | None = None) -> Runtime:
    requested = RuntimeChoice.parse(requested, "--runtime", error=RuntimeUnavailableError)
    serving_backend = ServingBackend.parse(serving_backend, "--serving-backend", error=RuntimeUnavailableError)
    if requested is RuntimeChoice.AUTO:
        requested = RuntimeChoice.TENSORRT if tensorrt_available() else RuntimeChoice.ONNXRUNTIME
        log.debug("runtime: %s (auto)", requested)
    if requested is RuntimeChoice.TENSORRT:
        if not tensorrt_available():
            raise RuntimeUnavailableError(
                "--runtime tensorrt: TensorRT with a CUDA GPU is not available here; install it with "
                "pip install '.[tensorrt]' on a GPU machine, or build inside the NGC Triton container"
            )
        from builder.runtimes.tensorrt import TensorRTRuntime

        return TensorRTRuntime(trt_options or TrtBuildOptions(), cache_dir or default_cache_dir())
    return OnnxRuntimeCPU(serving_backend)
