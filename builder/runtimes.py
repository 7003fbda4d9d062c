"""Where variants execute: ONNX Runtime here; TensorRT plugs in behind the same seam.

A runtime turns a precision variant's ONNX into the artifact Triton serves and runs that artifact
for the accuracy check.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import onnxruntime as ort
from numpy.typing import NDArray

from builder.errors import RuntimeUnavailableError
from builder.manifest import DimRange, TensorSpec
from builder.tensorrt_plan import PlanMetadata, TrtBuildOptions, plan_filename, profile_shapes, stale_reasons

log = logging.getLogger(__name__)

RUNTIMES = ("auto", "onnxruntime", "tensorrt")

Outputs = dict[str, NDArray[Any]]


@dataclass(frozen=True)
class CompileTarget:
    """What a runtime needs to know about the model to compile one variant."""

    inputs: tuple[TensorSpec, ...]
    batch: DimRange
    dims: Mapping[str, DimRange] = field(default_factory=dict)
    onnx_sha256: str = ""


class Runtime(Protocol):
    name: str
    artifact: str  # file name inside the Triton model version folder
    triton_backend: str | None  # None: the --serving-backend choice; else the backend this runtime needs
    instance_kind: str

    def identity(self) -> dict[str, str]:
        """Everything about this machine's runtime that a built artifact depends on."""
        ...

    def compile(self, onnx_path: Path, out_path: Path, target: CompileTarget) -> None: ...

    def run(self, artifact: Path, samples: Mapping[str, NDArray[Any]], batch_size: int) -> Outputs: ...


def ort_session(path: Path, intra_op_threads: int = 0) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if intra_op_threads:
        options.intra_op_num_threads = intra_op_threads
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def run_session(session: ort.InferenceSession, samples: Mapping[str, NDArray[Any]], batch_size: int) -> Outputs:
    """Run every sample through the session in batches; outputs concatenated along axis 0."""
    count = len(next(iter(samples.values())))
    names = [o.name for o in session.get_outputs()]
    chunks: dict[str, list[NDArray[Any]]] = {n: [] for n in names}
    for start in range(0, count, batch_size):
        feed = {k: v[start : start + batch_size] for k, v in samples.items()}
        for name, value in zip(names, session.run(names, feed), strict=True):
            chunks[name].append(np.asarray(value))
    return {n: np.concatenate(parts) for n, parts in chunks.items()}


def ort_throughput(path: Path, feed: Mapping[str, NDArray[Any]], threads: int = 0, seconds: float = 1.0) -> float:
    """Inferences per second of one feed, repeated for `seconds` after three warm-up runs."""
    import time

    session = ort_session(path, threads)
    for _ in range(3):
        session.run(None, dict(feed))
    batch = len(next(iter(feed.values())))
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        session.run(None, dict(feed))
        runs += 1
    return runs * batch / (time.perf_counter() - start)


class OnnxRuntimeCPU:
    """The variant ONNX is the artifact; Triton's python backend runs it with ONNX Runtime."""

    name = "onnxruntime"
    artifact = "model.onnx"
    triton_backend: str | None = None
    instance_kind = "KIND_CPU"

    def identity(self) -> dict[str, str]:
        return {"onnxruntime": ort.__version__}

    def compile(self, onnx_path: Path, out_path: Path, target: CompileTarget) -> None:
        shutil.copyfile(onnx_path, out_path)

    def run(self, artifact: Path, samples: Mapping[str, NDArray[Any]], batch_size: int) -> Outputs:
        return run_session(ort_session(artifact), samples, batch_size)


def tensorrt_available() -> bool:
    """True when the real TensorRT (not only its type stubs) imports and a CUDA GPU answers."""
    if importlib.util.find_spec("tensorrt") is None:
        return False
    try:
        import tensorrt

        if not hasattr(tensorrt, "Builder"):
            return False
        tensorrt.Builder(tensorrt.Logger(tensorrt.Logger.ERROR))
    except Exception:  # noqa: BLE001 - any failure means "not usable here"
        return False
    return True


class TensorRTRuntime:
    """Strongly typed TensorRT plans, one per compute capability, with a metadata record beside each."""

    name = "tensorrt"
    triton_backend: str | None = "tensorrt"
    instance_kind = "KIND_GPU"

    def __init__(self, options: TrtBuildOptions, cache_dir: Path) -> None:
        from builder import tensorrt_engine

        self.engine = tensorrt_engine
        self.options = options.check()
        self.gpu = tensorrt_engine.gpu_info()
        self.trt_version = tensorrt_engine.tensorrt_version()
        self.artifact = plan_filename(self.gpu.major, self.gpu.minor)
        self.cache_dir = cache_dir

    def identity(self) -> dict[str, str]:
        return {"tensorrt": self.trt_version, "gpu": self.gpu.name,
                "compute_capability": self.gpu.compute_capability, "driver": self.gpu.driver}

    def metadata(self, target: CompileTarget) -> PlanMetadata:
        profile = profile_shapes(target.inputs, target.batch, target.dims)
        return PlanMetadata(
            tensorrt_version=self.trt_version, gpu_name=self.gpu.name,
            compute_capability=self.gpu.compute_capability, driver=self.gpu.driver,
            onnx_sha256=target.onnx_sha256, build_options=dict(self.options.__dict__),
            profile={k: [list(s) for s in v] for k, v in profile.shapes.items()},
        )

    def compile(self, onnx_path: Path, out_path: Path, target: CompileTarget) -> None:
        from builder.tensorrt_plan import timing_cache_name

        wanted = self.metadata(target)
        meta_path = out_path.with_name(out_path.name + ".json")
        try:
            present = PlanMetadata.from_json(json.loads(meta_path.read_text()))
        except (OSError, ValueError):
            present = None
        reasons = stale_reasons(present, wanted) if out_path.is_file() else ["no plan present"]
        if not reasons:
            log.info("%s: plan up to date, not rebuilt", out_path)
            return
        log.info("%s: building (%s)", out_path, "; ".join(reasons))
        cache = self.cache_dir / "tensorrt" / timing_cache_name(self.gpu.name, self.gpu.major, self.gpu.minor,
                                                                self.trt_version)
        self.engine.build_plan(onnx_path, out_path, profile_shapes(target.inputs, target.batch, target.dims),
                               self.options, cache)
        meta_path.write_text(json.dumps(wanted.to_json(), indent=2) + "\n")

    def run(self, artifact: Path, samples: Mapping[str, NDArray[Any]], batch_size: int) -> Outputs:
        return self.engine.run_plan(artifact, samples, batch_size)


def select(requested: str, options: TrtBuildOptions | None = None, cache_dir: Path | None = None) -> Runtime:
    if requested not in RUNTIMES:
        raise RuntimeUnavailableError(f"--runtime {requested!r}: expected one of {', '.join(RUNTIMES)}")
    if requested == "auto":
        requested = "tensorrt" if tensorrt_available() else "onnxruntime"
        log.info("runtime: %s (auto)", requested)
    if requested == "tensorrt":
        if not tensorrt_available():
            raise RuntimeUnavailableError(
                "--runtime tensorrt: TensorRT with a CUDA GPU is not available here; install it with "
                "pip install '.[tensorrt]' on a GPU machine, or build inside the NGC Triton container"
            )
        from builder.precision import default_cache_dir

        return TensorRTRuntime(options or TrtBuildOptions(), cache_dir or default_cache_dir())
    return OnnxRuntimeCPU()
