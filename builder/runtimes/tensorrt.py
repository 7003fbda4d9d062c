"""TensorRT: strongly typed plans, one per compute capability, each with a metadata record beside
it that says when it must be rebuilt. The real API lives in tensorrt_engine (imported only where
TensorRT and a GPU exist); the decisions in tensorrt_plan are pure and tested on CPU."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from numpy.typing import NDArray

from builder.repository.triton_config import BackendConfig, InstanceKind, TritonBackend
from builder.runtimes.base import CompileTarget, Outputs
from builder.runtimes.tensorrt_plan import (
    PlanMetadata,
    TrtBuildOptions,
    cc_model_filenames,
    plan_filename,
    profile_shapes,
    stale_reasons,
    timing_cache_name,
    warmup_inputs,
)
from common import progress

log = logging.getLogger(__name__)


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


def _read_metadata(path: Path) -> PlanMetadata | None:
    try:
        return PlanMetadata.from_json(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def _metadata_path(plan: Path) -> Path:
    return plan.with_name(plan.name + ".json")


class TensorRTRuntime:
    """Strongly typed TensorRT plans, one per compute capability, with a metadata record beside each."""

    name = "tensorrt"

    def __init__(self, options: TrtBuildOptions, cache_dir: Path, *, log_file: Path | None = None) -> None:
        from builder.runtimes import tensorrt_engine

        self.engine = tensorrt_engine
        self.options = options.check()
        self.gpu = tensorrt_engine.gpu_info()
        self.trt_version = tensorrt_engine.tensorrt_version()
        self.artifact = plan_filename(self.gpu.major, self.gpu.minor)
        self.cache_dir = cache_dir
        self.log_file = log_file  # the build log, where TensorRT's own messages go: its errors name it

    def identity(self) -> dict[str, str]:
        return {"tensorrt": self.trt_version, "gpu": self.gpu.name,
                "compute_capability": self.gpu.compute_capability, "driver": self.gpu.driver}

    def served_options(self, artifact: Path) -> dict[str, str]:
        return {}

    def metadata(self, target: CompileTarget) -> PlanMetadata:
        profile = profile_shapes(target.model_shapes())
        return PlanMetadata(
            tensorrt_version=self.trt_version, gpu_name=self.gpu.name,
            compute_capability=self.gpu.compute_capability, driver=self.gpu.driver,
            onnx_sha256=target.onnx_sha256, build_options=self.options.to_json(),
            profile={k: [list(s) for s in v] for k, v in profile.shapes.items()},
        )

    def carry_over(self, previous: Path, version_dir: Path, target: CompileTarget) -> None:
        """Keep plans built on other GPU types for the same variant ONNX (cc_model_filenames)."""
        if not previous.is_dir():
            return
        for plan in previous.glob("model.sm*.plan"):
            meta = _read_metadata(_metadata_path(plan))
            if meta is not None and meta.onnx_sha256 == target.onnx_sha256:
                shutil.copy2(plan, version_dir / plan.name)
                shutil.copy2(_metadata_path(plan), version_dir / _metadata_path(plan).name)

    def compile(self, onnx_path: Path, out_path: Path, target: CompileTarget) -> None:
        wanted = self.metadata(target)
        meta_path = _metadata_path(out_path)
        reasons = stale_reasons(_read_metadata(meta_path), wanted) if out_path.is_file() else ["no plan present"]
        if not reasons:
            log.debug("%s: plan up to date, not rebuilt", out_path)
            return
        log.info("%s: building (%s)", out_path, "; ".join(reasons))
        cache = self.cache_dir / "tensorrt" / timing_cache_name(self.gpu.name, self.gpu.major, self.gpu.minor,
                                                                self.trt_version)
        with progress.task(f"TensorRT build: {out_path.parent.parent.name} ({self.gpu.name})"):
            self.engine.build_plan(onnx_path, out_path, profile_shapes(target.model_shapes()),
                                   self.options, cache, log_file=self.log_file)
        meta_path.write_text(json.dumps(wanted.to_json(), indent=2) + "\n")

    def run(self, artifact: Path, samples: Mapping[str, NDArray[Any]], batch_size: int | None) -> Outputs:
        return self.engine.run_plan(artifact, samples, batch_size)

    def backend_config(self, target: CompileTarget, version_dir: Path) -> BackendConfig:
        profile = profile_shapes(target.model_shapes())
        return BackendConfig(
            backend=TritonBackend.TENSORRT, artifact=self.artifact, instance_kind=InstanceKind.GPU,
            max_batch=profile.max_batch, cuda_graphs=self.options.cuda_graphs,
            warmup=tuple(warmup_inputs(target.inputs, profile)) if self.options.warmup else (),
            cc_model_filenames=tuple(cc_model_filenames([p.name for p in version_dir.iterdir()]).items()),
        )
