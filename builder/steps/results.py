"""Typed records of what a build produced, as build.json and the build report hold them."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from builder.repository.onnx_files import model_size, sha256_model
from builder.spec.enums import Precision
from builder.spec.model import Tolerance
from builder.steps.accuracy import Metrics
from builder.steps.context import VariantContext
from builder.steps.fp16_guard import Fp16GuardReport
from builder.steps.guard import GuardReport
from builder.steps.precision import CalibrationResult
from builder.steps.resources import StepFigures
from builder.steps.speed import Speed


@dataclass(frozen=True)
class VariantResult:
    name: str
    precision: Precision
    runtime: str
    artifact: str  # relative to the repository
    sha256: str
    size_bytes: int
    accuracy: Metrics
    tolerance: Tolerance
    build_seconds: float
    calibration: CalibrationResult | None = None
    guard: GuardReport | None = None
    fp16_guard: Fp16GuardReport | None = None
    # Each step's wall time and this process's peak RSS so far when it ended (monotonic: steps/resources.py).
    steps: tuple[StepFigures, ...] = ()
    # Each shape level's figures ("evaluation", "min", "max") where more than one was measured; `accuracy`
    # is the worst of them.
    accuracy_levels: dict[str, Metrics] | None = None
    # In-process throughput at the opt shape and size against FP32's, and whether it is worth serving
    # (None: not measured: another runtime than ONNX Runtime on the CPU, or TRTBUILD_NO_SPEED).
    speed: Speed | None = None

    @property
    def worth_serving(self) -> bool | None:
        return self.speed.worth_serving if self.speed is not None else None

    @staticmethod
    def of(ctx: VariantContext) -> VariantResult:
        assert ctx.metrics is not None, "a variant result needs its accuracy measured"
        return VariantResult(
            name=ctx.name,
            precision=ctx.precision,
            runtime=ctx.runtime.name,
            artifact=str(Path(ctx.name) / "1" / ctx.runtime.artifact),
            sha256=sha256_model(ctx.artifact),  # with the data file beside an ONNX over 2 GB
            size_bytes=model_size(ctx.artifact),
            accuracy=ctx.metrics,
            tolerance=ctx.model.spec.tolerance(ctx.precision),
            build_seconds=round(time.perf_counter() - ctx.started, 3),
            calibration=ctx.calibration,
            guard=ctx.guard,
            fp16_guard=ctx.fp16_guard,
            steps=tuple(ctx.steps.steps),
            accuracy_levels=dict(ctx.level_metrics) or None,
            speed=ctx.speed,
        )

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "worth_serving": self.worth_serving}
