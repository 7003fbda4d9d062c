"""One precision variant, built as a short sequence of small steps over a VariantContext:

    MakePrecision → Compile → Measure → Gate (→ guarded INT8: Guard, Compile, Measure, Gate)
    → the VariantResult → WriteModelFolder

Each step reads what earlier ones left in the context and adds its own part; each can run alone
in a test given a context that holds what it reads.
"""

from __future__ import annotations

import logging
import shutil
from typing import Protocol

from builder.errors import AccuracyError
from builder.repository import model_folder
from builder.repository.triton_config import ConfigInputs
from builder.spec.enums import Precision
from builder.steps import accuracy, precision
from builder.steps.context import EVAL_BATCH, VariantContext
from builder.steps.guard import guard_int8
from builder.steps.onnx_model import sha256_file
from builder.steps.results import VariantResult

log = logging.getLogger(__name__)


class Step(Protocol):
    def run(self, ctx: VariantContext) -> None: ...


class MakePrecision:
    """The variant ONNX: the FP32 graph itself, FP16 by autocast, or INT8 by calibrated Q/DQ."""

    def run(self, ctx: VariantContext) -> None:
        model = ctx.model
        if ctx.precision is Precision.FP32:
            shutil.copyfile(model.fp32_path, ctx.variant_onnx)
            ctx.settings = {}
        elif ctx.precision is Precision.FP16:
            ctx.settings = precision.to_fp16(model.fp32_path, ctx.variant_onnx)
        else:
            calibration_spec = model.spec.calibration
            if calibration_spec is None or model.calibration is None or model.calibration_digest is None:
                raise AssertionError("an INT8 variant without calibration data passed the spec check")
            ctx.calibration = precision.to_int8(
                model.fp32_path, fp32_sha=model.fp32_sha, calibration=model.calibration,
                data_digest=model.calibration_digest, spec=calibration_spec, out_path=ctx.variant_onnx,
                cache_dir=model.cache_dir)
            ctx.settings = ctx.calibration.settings


class Compile:
    """The artifact Triton serves, compiled from the variant ONNX by the runtime (which may reuse
    artifacts of an earlier build that are still valid)."""

    def run(self, ctx: VariantContext) -> None:
        ctx.variant_sha = sha256_file(ctx.variant_onnx)
        ctx.version_dir.mkdir(parents=True, exist_ok=True)
        target = ctx.target()
        ctx.runtime.carry_over(ctx.model.repository / ctx.name / "1", ctx.version_dir, target)
        ctx.runtime.compile(ctx.variant_onnx, ctx.artifact, target)


class Measure:
    """The compiled artifact against the FP32 reference on the held-out samples."""

    def run(self, ctx: VariantContext) -> None:
        outputs = ctx.runtime.run(ctx.artifact, ctx.model.evaluation, EVAL_BATCH)
        ctx.metrics = accuracy.compare(ctx.model.reference, outputs, ctx.model.spec.task)
        log.info("%s: %s", ctx.name, ctx.metrics.summary())


class Gate:
    """The tolerance check. An INT8 variant with an explicit tolerance in models.toml is guarded:
    when it misses, search for the nodes to keep in higher precision, rebuild and check again."""

    def run(self, ctx: VariantContext) -> None:
        assert ctx.metrics is not None, "Gate runs after Measure"
        spec = ctx.model.spec
        tolerance = spec.tolerance(ctx.precision)
        problem = accuracy.violation(ctx.metrics, tolerance, ctx.name)
        if problem is None:
            return
        guarded = ctx.precision is Precision.INT8 and Precision.INT8 in spec.tolerances and ctx.guard is None
        if not guarded:
            raise AccuracyError(problem)
        log.warning("%s; searching for nodes to keep in higher precision", problem)
        Guard().run(ctx)
        Compile().run(ctx)
        Measure().run(ctx)
        self.run(ctx)


class Guard:
    """Replace the plain INT8 ONNX by the guarded mix (or FP16 when no mix meets the tolerance)."""

    def run(self, ctx: VariantContext) -> None:
        model = ctx.model
        spec = model.spec
        assert spec.calibration is not None and model.calibration is not None
        assert model.calibration_digest is not None
        ctx.guard = guard_int8(
            fp32_path=model.fp32_path, fp32_sha=model.fp32_sha, calibration=model.calibration,
            calibration_digest=model.calibration_digest, spec=spec.calibration, variant_onnx=ctx.variant_onnx,
            evaluation=model.evaluation, reference=model.reference, task=spec.task,
            tolerance=spec.tolerance(ctx.precision), cache_dir=model.cache_dir, work=model.work,
        )


class WriteModelFolder:
    """config.pbtxt (backend settings from the runtime), the runner where needed, and build.json."""

    def __init__(self, result: VariantResult) -> None:
        self.result = result

    def run(self, ctx: VariantContext) -> None:
        model = ctx.model
        spec = model.spec
        target = ctx.target()
        inputs = ConfigInputs(name=ctx.name, inputs=model.signature.inputs, outputs=model.signature.outputs,
                              batch=spec.batch, serving=spec.serving,
                              backend=ctx.runtime.backend_config(target, ctx.version_dir))
        model_folder.write_config(ctx.model_dir, ctx.version_dir, inputs)
        model_folder.write_record(ctx.model_dir, {
            "build_key": model.build_key,
            "model": spec.name,
            "source": spec.source or str(spec.onnx),
            "fp32_onnx_sha256": model.fp32_sha,
            "precision_settings": ctx.settings,
            "variant_onnx_sha256": ctx.variant_sha,
            "inputs": model.inputs_record,
            "tools": model.inputs_record["tools"],
            **self.result.to_json(),
        })


STEPS: tuple[Step, ...] = (MakePrecision(), Compile(), Measure(), Gate())


def build_variant(ctx: VariantContext) -> VariantResult:
    for step in STEPS:
        step.run(ctx)
    result = VariantResult.of(ctx)
    WriteModelFolder(result).run(ctx)
    log.debug("%s built in %.1f s", ctx.name, result.build_seconds)
    return result
