"""Pure decisions for TensorRT plans, testable without TensorRT: optimization-profile shapes,
build options, timing-cache keys, plan metadata and when a plan is stale, per-GPU plan names."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from builder.errors import ManifestError
from builder.spec.dtypes import to_triton_config
from builder.spec.model import TensorSpec
from builder.spec.shapes import ModelShapes
from common.choices import Choice


class HardwareCompatibility(Choice):
    NONE = "none"
    AMPERE_PLUS = "ampere_plus"
    SAME_COMPUTE_CAPABILITY = "same_compute_capability"


Shape = tuple[int, ...]


@dataclass(frozen=True)
class TrtBuildOptions:
    workspace_mib: int = 4096
    optimization_level: int = 3  # TensorRT's default; 0-5
    version_compatible: bool = False
    hardware_compatibility: HardwareCompatibility = HardwareCompatibility.NONE
    cuda_graphs: bool = False
    warmup: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "hardware_compatibility", HardwareCompatibility.parse(
            self.hardware_compatibility, "--trt-hardware-compatibility", error=ManifestError))

    def check(self) -> TrtBuildOptions:
        if self.workspace_mib < 1:
            raise ManifestError(f"--trt-workspace-mib {self.workspace_mib}: expected a positive number of MiB")
        if not 0 <= self.optimization_level <= 5:
            raise ManifestError(f"--trt-optimization-level {self.optimization_level}: expected 0 to 5")
        return self

    def to_json(self) -> dict[str, Any]:
        return {k: (v.value if isinstance(v, Choice) else v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class ProfileShapes:
    """min/opt/max shape of every input (the batch axis first for a batching model)."""

    shapes: Mapping[str, tuple[Shape, Shape, Shape]]
    batching: bool = True

    @property
    def max_batch(self) -> int | None:
        """The largest batch the profile takes; None for a model that does not batch (max_batch_size 0)."""
        if not self.batching:
            return None
        return min(s[2][0] for s in self.shapes.values())


def profile_shapes(shapes: ModelShapes) -> ProfileShapes:
    """One optimization profile: every input's resolved min/opt/max shape, as the user gave it."""
    return ProfileShapes(shapes.profile(), shapes.batching)


def compute_capability_tag(major: int, minor: int) -> str:
    return f"sm{major}{minor}"


def plan_filename(major: int, minor: int) -> str:
    """One plan per compute capability, so one model folder can serve several GPU types."""
    return f"model.{compute_capability_tag(major, minor)}.plan"


_PLAN_NAME = re.compile(r"^model\.sm(\d+)(\d)\.plan$")


def cc_model_filenames(files: list[str]) -> dict[str, str]:
    """Triton's cc_model_filenames ({"9.0": "model.sm90.plan"}) for the plans present in a version folder."""
    mapping = {}
    for name in sorted(files):
        match = _PLAN_NAME.match(name)
        if match:
            mapping[f"{int(match.group(1))}.{match.group(2)}"] = name
    return mapping


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")


def timing_cache_name(gpu_name: str, major: int, minor: int, trt_version: str) -> str:
    """Timing caches are only valid for one GPU model and TensorRT version."""
    return f"timing-{_slug(gpu_name)}-{compute_capability_tag(major, minor)}-trt{_slug(trt_version)}.cache"


@dataclass(frozen=True)
class PlanMetadata:
    """What a plan depends on; written beside it as JSON and compared before every build."""

    tensorrt_version: str
    gpu_name: str
    compute_capability: str
    driver: str
    onnx_sha256: str
    build_options: dict[str, Any] = field(default_factory=dict)
    profile: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> PlanMetadata | None:
        try:
            return PlanMetadata(**{k: data[k] for k in PlanMetadata.__dataclass_fields__})
        except (KeyError, TypeError):
            return None


_LABELS = {
    "tensorrt_version": "TensorRT version",
    "gpu_name": "GPU",
    "compute_capability": "compute capability",
    "driver": "driver",
    "onnx_sha256": "input ONNX",
    "build_options": "build options",
    "profile": "optimization profile",
}


def stale_reasons(present: PlanMetadata | None, wanted: PlanMetadata) -> list[str]:
    """Why the present plan cannot be reused; empty when it matches what would be built."""
    if present is None:
        return ["no plan with metadata present"]
    reasons = []
    for key, label in _LABELS.items():
        old, new = getattr(present, key), getattr(wanted, key)
        if old != new:
            if key == "onnx_sha256":
                reasons.append(f"{label} changed ({old[:12]} -> {new[:12]})")
            elif isinstance(old, dict):
                changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
                reasons.append(f"{label} changed ({', '.join(changed)})")
            else:
                reasons.append(f"{label} {old} -> {new}")
    return reasons


def warmup_inputs(inputs: tuple[TensorSpec, ...], profile: ProfileShapes) -> list[dict[str, Any]]:
    """model_warmup entries (random data at the profile's opt shape) for config.pbtxt."""
    if not profile.batching:
        # max_batch_size 0: dims are whole shapes and the batch size is 1.
        return [{
            "name": "warmup_opt",
            "batch_size": 1,
            "inputs": {t.name: {"data_type": to_triton_config(t.dtype), "dims": _warmup_dims(profile.shapes[t.name][1]),
                                "random_data": True} for t in inputs},
        }]
    opt_batch = min(s[1][0] for s in profile.shapes.values())
    return [{
        "name": f"warmup_batch_{opt_batch}",
        "batch_size": opt_batch,
        "inputs": {
            t.name: {"data_type": to_triton_config(t.dtype), "dims": list(profile.shapes[t.name][1][1:]),
                     "random_data": True}
            for t in inputs
        },
    }]


def _warmup_dims(shape: Shape) -> list[int]:
    return list(shape) or [1]  # a scalar is sent as [1] (config.pbtxt reshapes it to [])
