"""The state a build carries from step to step: one model's build as the orchestrator hands it down, what the
model's variants share, and one variant's own progress. Steps read and fill these; nothing else passes between
them, and nothing calls back into the orchestrator."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builder.repository.staging import Staging
from builder.runtimes.base import CompileTarget, Outputs, ReferenceExecutor, Runtime
from builder.spec.enums import GuardSensitivity, Precision
from builder.spec.model import ModelSpec
from builder.spec.names import variant_name
from builder.spec.shapes import ModelShapes, for_model
from builder.spec.tuned import TunedServing
from builder.steps import accuracy
from builder.steps.accuracy import Metrics
from builder.steps.budget import DEFAULT_GUARD_BUDGET_S
from builder.steps.fp16_guard import Fp16GuardReport
from builder.steps.guard import GuardReport
from builder.steps.onnx_model import Signature
from builder.steps.precision import CalibrationResult
from builder.steps.resources import StepLog
from builder.steps.samples import Samples
from builder.steps.speed import Meter, Speed

# Batch used to run held-out samples through each variant during the accuracy check.
EVAL_BATCH = 16


@dataclass(frozen=True)
class BuildContext:
    """One model's build, as the orchestrator (pipeline.build_all) hands it down: the spec, the build's options,
    where to write, the log sink and the reference executor. steps/model.build_model takes it from here."""

    spec: ModelSpec
    runtime: Runtime  # compiles and serves the variants
    executor: ReferenceExecutor  # runs the FP32 reference and the candidates compared with it
    repository: Path  # the live repository: earlier builds' records and artifacts
    staging: Staging  # where the variants are written before each is committed
    cache_dir: Path
    log_file: Path | None  # the build log tools' full output goes to (None: a file per failure)
    force: bool = False
    all_or_nothing: bool = False  # the first failure raises; the staged variants are committed by the caller
    tuned: Mapping[str, TunedServing] = field(default_factory=dict)
    guard_sensitivity: GuardSensitivity = GuardSensitivity.ONE_PASS
    guard_budget_s: float | None = DEFAULT_GUARD_BUDGET_S
    spec_origin: str = "models.toml entry"
    speed_meter: Meter | None = None


@dataclass(frozen=True)
class LevelSamples:
    """Samples at one more shape level (min or max) the variants are measured on, with their FP32 outputs."""

    level: str
    samples: Samples
    reference: Outputs


@dataclass(frozen=True)
class ModelContext:
    """Prepared once per model: the cleaned-up FP32 ONNX, its signature, the data and the reference."""

    spec: ModelSpec
    fp32_path: Path
    fp32_sha: str
    signature: Signature
    evaluation: Samples
    calibration: Samples | None
    calibration_digest: str | None
    reference: Outputs  # FP32 under the reference executor on the held-out samples, whatever serves the variants
    build_key: str
    inputs_record: dict[str, Any]  # everything the variants depend on; its digest is build_key
    work: Path  # a private temporary folder
    cache_dir: Path
    repository: Path  # the live repository, where earlier builds may hold reusable artifacts
    # Runs the FP32 reference and the candidates the guards try (ONNX Runtime on the CPU: BuildOptions.executor).
    executor: ReferenceExecutor
    shapes: ModelShapes | None = None  # resolved by the pipeline; None: from the spec and signature
    # Samples at the min and max shapes too (where the evaluation set's shape is not theirs), each with its
    # FP32 reference: synthetic, or the user's own brought to those shapes; every variant is measured on all.
    other_levels: tuple[LevelSamples, ...] = ()
    # How the accuracy guards rank nodes before their search (BuildOptions.guard_sensitivity).
    guard_sensitivity: GuardSensitivity = GuardSensitivity.ONE_PASS
    guard_budget_s: float | None = DEFAULT_GUARD_BUDGET_S  # each guard's search, in seconds (BuildOptions)
    # Each variant's build key and inputs (inputs_record and the variant's own settings); a precision not in
    # it is recorded with build_key and inputs_record.
    variant_inputs: Mapping[Precision, tuple[str, Mapping[str, Any]]] = field(default_factory=dict)
    # How each variant's throughput is measured against FP32's (steps/speed.py); None: not measured.
    speed_meter: Meter | None = None
    # The build log a tool's full output goes to, as the one-line errors name it (BuildOptions.log_file);
    # None: each failure's output in a file of its own (steps/precision.failure_log).
    log_file: Path | None = None

    def record_of(self, precision: Precision) -> tuple[str, Mapping[str, Any]]:
        """The build key and inputs a variant's build.json records."""
        return self.variant_inputs.get(precision, (self.build_key, self.inputs_record))

    @property
    def input_shapes(self) -> ModelShapes:
        """Every input's min/opt/max shape and whether the model batches on axis 0."""
        if self.shapes is not None:
            return self.shapes
        return for_model(self.spec, self.signature.inputs, f"model {self.spec.name!r}")

    def measure(self, run: Callable[[Samples], Outputs]) -> Metrics:
        """A variant's figures against FP32: `run` gives its outputs on a sample set; over the evaluation
        samples and those at the min and max shapes too (the worst of them)."""
        return self.measure_levels(run)[0]

    def measure_levels(self, run: Callable[[Samples], Outputs]) -> tuple[Metrics, dict[str, Metrics]]:
        """The figures over every level (the worst of them: the gate's) and each level's own: "evaluation"
        (the evaluation samples, at the user's shape or the opt shape), then "min" and "max" where measured."""
        sets = (LevelSamples("evaluation", self.evaluation, self.reference), *self.other_levels)
        each = {s.level: accuracy.compare(s.reference, run(s.samples), self.spec.task) for s in sets}
        return accuracy.combine(list(each.values())), each

    @property
    def eval_batch(self) -> int | None:
        """The batch to run samples with; None for a model that does not batch (each sample whole)."""
        return EVAL_BATCH if self.input_shapes.batching else None


@dataclass
class VariantContext:
    model: ModelContext
    precision: Precision
    runtime: Runtime
    model_dir: Path  # the staged Triton model folder
    started: float = field(default_factory=time.perf_counter)
    settings: dict[str, object] = field(default_factory=dict)  # how the precision step made the variant
    calibration: CalibrationResult | None = None
    variant_sha: str | None = None  # of the variant ONNX the artifact was compiled from; set by Compile
    metrics: Metrics | None = None
    level_metrics: dict[str, Metrics] = field(default_factory=dict)  # each shape level's own, where several
    guard: GuardReport | None = None
    fp16_guard: Fp16GuardReport | None = None
    speed: Speed | None = None  # throughput and size against FP32's, where measured
    steps: StepLog = field(default_factory=StepLog)  # each step's time and peak RSS so far

    @property
    def name(self) -> str:
        return variant_name(self.model.spec.name, self.precision)

    @property
    def variant_onnx(self) -> Path:
        return self.model.work / f"{self.precision.value}.onnx"

    @property
    def version_dir(self) -> Path:
        return self.model_dir / "1"

    @property
    def artifact(self) -> Path:
        return self.version_dir / self.runtime.artifact

    def target(self) -> CompileTarget:
        """What the runtime compiles; only once Compile has hashed the variant ONNX."""
        assert self.variant_sha is not None, "the compile target exists once the variant ONNX is final"
        spec = self.model.spec
        shapes = self.model.input_shapes
        return CompileTarget(self.model.signature.inputs, shapes.batch or spec.batch, dict(spec.dims),
                             self.variant_sha, shapes)
