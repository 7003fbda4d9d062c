"""One model made ready for its variants: the FP32 ONNX (exported, or the user's file), its signature and shape
ranges, the evaluation and calibration samples (load), and, once a rebuild is due, the graph checked, cleaned up
and run for the FP32 reference at every shape level it is measured on (reference: the ModelContext its variants
share). Graphs run through the build's reference executor."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder.errors import AccuracyError, DataError
from builder.repository import onnx_files
from builder.runtimes.base import ReferenceExecutor
from builder.spec.enums import Precision, Task
from builder.spec.model import ModelSpec
from builder.spec.shapes import Level, ModelShapes, for_model
from builder.steps import accuracy, cleanup, onnx_model, samples, speed
from builder.steps.cleanup import SlimReport
from builder.steps.context import EVAL_BATCH, BuildContext, LevelSamples, ModelContext

# A model's build lines keep the name they have always had in the build log and on stderr
# ("INFO builder.pipeline: m: rebuilding: ..."), which users and scripts filter on.
log = logging.getLogger("builder.pipeline")


@dataclass(frozen=True)
class Source:
    """The model as given, before any rebuild: its FP32 graph, signature, shape ranges and samples."""

    fp32_path: Path
    signature: onnx_model.Signature
    shapes: ModelShapes
    evaluation: samples.Samples
    calibration: samples.Samples | None


def load(job: BuildContext, work: Path) -> Source:
    """The FP32 ONNX in `work`, checked against the spec's inputs, with its shape ranges and samples."""
    spec = job.spec
    what = f"model {spec.name!r}"
    fp32_path = work / "reference.onnx"
    source_onnx(spec, fp32_path)
    sig = onnx_model.signature(onnx_model.inferred(fp32_path, what), what)
    onnx_model.check_manifest_inputs(sig, spec.inputs, what)
    shapes = for_model(spec, sig.inputs, what)
    if not shapes.batching:
        log.warning("%s: built with max_batch_size 0 (whole shapes, no dynamic batching): %s",
                    spec.name, shapes.reason)
    evaluation, calibration = load_samples(spec, sig, shapes)
    return Source(fp32_path, sig, shapes, evaluation, calibration)


def reference(job: BuildContext, source: Source, *, work: Path, calibration_digest: str | None, build_key: str,
              inputs_record: dict[str, Any],
              variant_inputs: Mapping[Precision, tuple[str, Mapping[str, Any]]]) -> tuple[ModelContext, SlimReport]:
    """The graph checked on the user's data, cleaned up (kept only where its outputs stay equal), checked at
    every shape level, and its FP32 reference: what every variant of the model shares."""
    spec, fp32_path, evaluation, shapes = job.spec, source.fp32_path, source.evaluation, source.shapes
    what = f"model {spec.name!r}"
    executor = job.executor
    eval_batch = EVAL_BATCH if shapes.batching else None
    # The user's data first, on the graph as given (a size inside the range the graph cannot take):
    # one line here, not a traceback from the clean-up's probe run.
    onnx_model.run_fp32(fp32_path, samples.take(evaluation, 0, 4), eval_batch, what, executor=executor)
    declared = onnx_model.signature(onnx_files.load(fp32_path), what)  # as the user's graph declares them
    slim_report = cleanup.slim(fp32_path, samples.take(evaluation, 0, 4), executor=executor, batch_size=eval_batch)
    onnx_model.check_runs_at_levels(fp32_path, source.signature.inputs, shapes, what, executor=executor,
                                    value_ranges=spec.input_ranges, examples=evaluation)
    outputs = onnx_model.run_fp32(fp32_path, evaluation, eval_batch, what, executor=executor)
    # Outputs as the executor returns them: a declared shape the graph contradicts is one warning line.
    for note in onnx_model.output_shape_notes(declared, outputs, batching=shapes.batching):
        log.warning("%s: %s", spec.name, note)
    if spec.task is Task.DETECTION:
        _say_what_detection_checks(spec.name, outputs)
    model = ModelContext(
        spec=spec, fp32_path=fp32_path, fp32_sha=onnx_files.sha256_model(fp32_path),
        signature=onnx_model.returned_outputs(declared, outputs, batching=shapes.batching),
        evaluation=evaluation, calibration=source.calibration, calibration_digest=calibration_digest,
        reference=outputs, build_key=build_key, variant_inputs=variant_inputs,
        inputs_record=inputs_record, work=work, cache_dir=job.cache_dir, repository=job.repository,
        executor=executor, shapes=shapes,
        other_levels=other_levels(spec, source.signature, shapes, fp32_path, eval_batch, what, evaluation, executor),
        guard_sensitivity=job.guard_sensitivity, guard_budget_s=job.guard_budget_s,
        speed_meter=None if speed.skipped() else job.speed_meter, log_file=job.log_file,
    )
    return model, slim_report


def _say_what_detection_checks(name: str, outputs: Mapping[str, Any]) -> None:
    """A detector's gate counts the detections FP32 makes on the evaluation samples: with none (random inputs,
    images without the objects) it checks nothing, and the build says so (it still builds)."""
    try:
        found = accuracy.reference_detections(outputs[accuracy.detection_output(outputs)])
    except AccuracyError:
        return  # the variants' gate says what is missing, in one line each
    if found == 0:
        log.warning("%s: the FP32 model detects nothing (score %.2f or more) on the evaluation samples, so the "
                    "detection agreement of its variants checks nothing; give images with the objects "
                    "(--eval-data FILE.npz or [model.evaluation])", name, accuracy.DETECTION_SCORE)
    else:
        log.info("%s: the FP32 model makes %d detections on the evaluation samples", name, found)


def source_onnx(spec: ModelSpec, out: Path) -> None:
    """The model's FP32 ONNX in `out`: exported from PyTorch, or the user's file."""
    if spec.source is not None:
        from builder.steps.export import export  # imports torch: only when exporting

        export(spec, out)
        return
    assert spec.onnx is not None
    onnx_files.load(spec.onnx)
    onnx_files.copy_model(spec.onnx, out)  # with its external data file, if it has one


def load_samples(spec: ModelSpec, sig: onnx_model.Signature,
                  shapes: ModelShapes) -> tuple[samples.Samples, samples.Samples | None]:
    """Held-out evaluation samples and calibration samples, both checked against the graph's inputs."""
    calibration = None
    if spec.calibration is not None:
        calibration = samples.load(spec.calibration.data, f"model {spec.name!r}: calibration")
        samples.validate(calibration, sig.inputs, shapes, f"model {spec.name!r}: calibration data")
    if spec.evaluation is not None:
        evaluation = samples.load(spec.evaluation, f"model {spec.name!r}: evaluation")
        samples.validate(evaluation, sig.inputs, shapes, f"model {spec.name!r}: evaluation data")
    elif calibration is not None:
        # Hold out the last quarter: evaluation never sees a calibration sample.
        count = len(next(iter(calibration.values())))
        if count < 8:
            raise DataError(
                f"model {spec.name!r}: calibration data has {count} samples; with no evaluation data "
                "expected at least 8 (a quarter is held out for the accuracy check)"
            )
        calibration, evaluation = samples.hold_out(calibration)
    else:
        evaluation = samples.synthetic(sig.inputs, shapes, 16, seed=1, value_ranges=spec.input_ranges,
                                       what=f"model {spec.name!r}")
    return evaluation, calibration


# Samples per extra shape level (min, max) the variants are measured on.
LEVEL_SAMPLES = 4


def other_levels(spec: ModelSpec, sig: onnx_model.Signature, shapes: ModelShapes, fp32_path: Path,
                  batch: int | None, what: str, evaluation: samples.Samples,
                  executor: ReferenceExecutor) -> tuple[LevelSamples, ...]:
    """Sets at the min and max shapes where the evaluation samples' shape is not theirs, each with its FP32
    outputs, so the gate sees the whole range: synthetic without the user's data (the evaluation set is then
    at the opt shape); else the user's samples brought to those shapes (an image resized, other dims drawn in
    the data's range: samples.at_shapes), since data at one size says nothing of the others."""
    user = spec.evaluation is not None or spec.calibration is not None
    found = []
    seen = [tuple(tuple(evaluation[t.name].shape[1:]) for t in sig.inputs)] if user else []
    for index, level in enumerate(lv for lv in shapes.levels() if user or lv is not Level.OPT):
        wanted = {t.name: tuple(shapes.sample_range(t.name).at(level)) for t in sig.inputs}
        key = tuple(wanted[t.name] for t in sig.inputs)
        if key in seen:
            continue
        seen.append(key)
        if user:
            extra = samples.at_shapes(evaluation, sig.inputs, wanted, LEVEL_SAMPLES, seed=11 + index)
        else:
            extra = samples.synthetic(sig.inputs, shapes, LEVEL_SAMPLES, seed=11 + index, level=level,
                                      value_ranges=spec.input_ranges, what=what)
        found.append(LevelSamples(level.value, extra,
                                  onnx_model.run_fp32(fp32_path, extra, batch, what, executor=executor)))
    return tuple(found)
