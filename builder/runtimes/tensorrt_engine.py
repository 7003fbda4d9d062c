"""TensorRT build and execution through the real API. Imported only where `import tensorrt` works
and a CUDA GPU answers (see runtimes.tensorrt.tensorrt_available); everything decidable without TensorRT
lives in tensorrt_plan.py and is tested on CPU.

Strongly typed networks only: precision comes from the ONNX graph (FP16 casts, INT8 Q/DQ), as
TensorRT 11 requires and 10.x supports.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tensorrt as trt
from numpy.typing import NDArray

from builder.errors import BuilderError
from builder.runtimes.base import feeds as sample_feeds
from builder.runtimes.base import join as join_outputs
from builder.runtimes.tensorrt_plan import HardwareCompatibility, ProfileShapes, TrtBuildOptions
from common.files import write_atomic

log = logging.getLogger(__name__)

_LOGGER = trt.Logger(trt.Logger.WARNING)


@dataclass(frozen=True)
class GpuInfo:
    name: str
    major: int
    minor: int
    driver: str

    @property
    def compute_capability(self) -> str:
        return f"{self.major}.{self.minor}"


def gpu_info(index: int = 0) -> GpuInfo:
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        return GpuInfo(str(pynvml.nvmlDeviceGetName(handle)), int(major), int(minor),
                       str(pynvml.nvmlSystemGetDriverVersion()))
    finally:
        pynvml.nvmlShutdown()


def tensorrt_version() -> str:
    return str(trt.__version__)


def _network_flags() -> int:
    # TensorRT 11 networks are strongly typed by default and may no longer list the flag.
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 1 << int(flag) if flag is not None else 0


def _messages(build_log: Path | None) -> str:
    """Where TensorRT's own messages went: its logger writes to the native stderr, which a build sends to
    its log file `build_log` (common.logs); the variant ONNX's path is a temporary one and is not named."""
    return f"TensorRT's messages: {build_log}" if build_log is not None else "TensorRT's messages are on stderr"


def build_plan(onnx_path: Path, plan_path: Path, profile: ProfileShapes, options: TrtBuildOptions,
               timing_cache: Path, *, log_file: Path | None) -> None:
    """Parse the ONNX, build one optimization profile, reuse and update the timing cache, write the plan."""
    builder = trt.Builder(_LOGGER)
    network = builder.create_network(_network_flags())
    parser = trt.OnnxParser(network, _LOGGER)
    if not parser.parse_from_file(str(onnx_path)):
        errors = []
        for i in range(parser.num_errors):
            error = parser.get_error(i)
            errors.append(f"node {error.node_name() or '?'} ({error.node_operator() or '?'}): {error.desc()}")
        raise BuilderError(f"TensorRT's ONNX parser failed on the {onnx_path.stem} ONNX: "
                           f"{'; '.join(errors) or 'no details'} ({_messages(log_file)})")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_mib << 20)
    config.builder_optimization_level = options.optimization_level
    if options.version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    if options.hardware_compatibility is HardwareCompatibility.AMPERE_PLUS:
        config.hardware_compatibility_level = trt.HardwareCompatibilityLevel.AMPERE_PLUS
    elif options.hardware_compatibility is HardwareCompatibility.SAME_COMPUTE_CAPABILITY:
        config.hardware_compatibility_level = trt.HardwareCompatibilityLevel.SAME_COMPUTE_CAPABILITY
    trt_profile = builder.create_optimization_profile()
    for name, (low, opt, high) in profile.shapes.items():
        trt_profile.set_shape(name, trt.Dims(list(low)), trt.Dims(list(opt)), trt.Dims(list(high)))
    config.add_optimization_profile(trt_profile)
    cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise BuilderError(f"TensorRT could not build an engine from the {onnx_path.stem} ONNX ({_messages(log_file)})")
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(plan_path, bytes(memoryview(serialized)))
    timing_cache.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(timing_cache, bytes(memoryview(config.get_timing_cache().serialize())))
    log.debug("TensorRT plan %s (%d bytes); timing cache %s", plan_path, plan_path.stat().st_size, timing_cache)


def _cudart() -> Any:
    try:
        from cuda.bindings import runtime
    except ImportError:  # cuda-python < 12.6
        from cuda import cudart as runtime
    return runtime


def _check(result: Any, what: str) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise BuilderError(f"CUDA {what} failed: {err}")
    return rest[0] if rest else None


def _dtype(engine: trt.ICudaEngine, name: str) -> np.dtype[Any]:
    return np.dtype(trt.nptype(engine.get_tensor_dtype(name)))  # type: ignore[no-untyped-call]


def run_plan(plan_path: Path, samples: Mapping[str, NDArray[Any]], batch: int | None) -> dict[str, NDArray[Any]]:
    """Deserialize the plan and run every sample through it in batches with cuda-python buffers
    (`batch` None: the model does not batch; each sample whole)."""
    cudart = _cudart()
    engine = trt.Runtime(_LOGGER).deserialize_cuda_engine(plan_path.read_bytes())
    if engine is None:
        raise BuilderError(f"{plan_path}: TensorRT could not deserialize the plan")
    context = engine.create_execution_context()
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
    outputs = [n for n in names if n not in inputs]
    chunks: dict[str, list[NDArray[Any]]] = {n: [] for n in outputs}
    stream = _check(cudart.cudaStreamCreate(), "cudaStreamCreate")
    h2d, d2h = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
    try:
        for feed in sample_feeds(samples, batch):
            buffers: list[int] = []
            try:
                for name in inputs:
                    dtype = _dtype(engine, name)
                    host = np.require(feed[name], dtype=dtype, requirements="C")  # a scalar stays 0-d
                    context.set_input_shape(name, host.shape)
                    pointer = _check(cudart.cudaMalloc(max(host.nbytes, 1)), "cudaMalloc")
                    buffers.append(pointer)
                    _check(cudart.cudaMemcpyAsync(pointer, host.ctypes.data, host.nbytes, h2d, stream), "copy in")
                    context.set_tensor_address(name, pointer)
                results = {}
                for name in outputs:
                    dims = context.get_tensor_shape(name)
                    host = np.empty(tuple(dims[i] for i in range(len(dims))), dtype=_dtype(engine, name))
                    pointer = _check(cudart.cudaMalloc(max(host.nbytes, 1)), "cudaMalloc")
                    buffers.append(pointer)
                    context.set_tensor_address(name, pointer)
                    results[name] = (host, pointer)
                if not context.execute_async_v3(stream):
                    raise BuilderError(f"{plan_path}: TensorRT execution failed")
                for host, pointer in results.values():
                    _check(cudart.cudaMemcpyAsync(host.ctypes.data, pointer, host.nbytes, d2h, stream), "copy out")
                _check(cudart.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
                for name, (host, _) in results.items():
                    chunks[name].append(host)
            finally:
                for pointer in buffers:
                    cudart.cudaFree(pointer)
    finally:
        cudart.cudaStreamDestroy(stream)
    return join_outputs(chunks, batch)
