"""One precision variant, built as a short sequence of small steps over a VariantContext:

    MakePrecision → Compile → Measure → Gate (→ guarded FP16 or INT8: Guard, Compile, Measure, Gate)
    → the VariantResult → WriteModelFolder

Each step reads what earlier ones left in the context and adds its own part; each can run alone
in a test given a context that holds what it reads.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import onnx

from builder.errors import AccuracyError, BuilderError, DataError, OnnxModelError, ToolError, tool_cause
from builder.repository import model_folder, onnx_files
from builder.repository.onnx_files import copy_model, sha256_model
from builder.repository.triton_config import ConfigInputs
from builder.spec.enums import Precision, RuntimeChoice
from builder.spec.model import DataSpec, ModelSpec
from builder.steps import accuracy, onnx_model, precision, samples, speed
from builder.steps.accuracy import Metrics
from builder.steps.context import ModelContext, VariantContext
from builder.steps.fp16_cache import cached_conversion, feeds_digest, fp16_key
from builder.steps.fp16_fallback import TOOL as FALLBACK_TOOL
from builder.steps.fp16_fallback import to_fp16_checked
from builder.steps.fp16_guard import guard_fp16
from builder.steps.guard import guard_int8
from builder.steps.onnx_model import default_opset
from builder.steps.results import VariantResult
from builder.steps.speed import Speed
from common import progress

log = logging.getLogger(__name__)


class Step(Protocol):
    label: str  # the step, as a failure line names it

    def run(self, ctx: VariantContext) -> None: ...


def fp16_feeds(model: ModelContext) -> list[precision.Feed]:
    """What autocast measures tensor ranges on: the user's samples (calibration, else evaluation data),
    else synthetic samples at the min, opt and max shapes — never autocast's own guesses."""
    spec = model.spec
    shapes = model.input_shapes
    if model.calibration is not None:
        sets = [model.calibration]
    elif spec.evaluation is not None:
        sets = [model.evaluation]
    else:
        sets = list(samples.shape_sets(model.signature.inputs, shapes, precision.AUTOCAST_BATCH, seed=7,
                                       value_ranges=spec.input_ranges, what=what(model)).values())
    return precision.autocast_feeds(sets, precision.AUTOCAST_BATCH if shapes.batching else None)


def what(model: ModelContext) -> str:
    return f"model {model.spec.name!r}"


class MakePrecision:
    """The variant ONNX: the FP32 graph itself, FP16 by autocast (else onnxconverter-common's float16, where
    autocast fails or its graph does not run at the min, opt and max shapes), or INT8 by calibrated Q/DQ."""

    label = "precision conversion"

    def run(self, ctx: VariantContext) -> None:
        model = ctx.model
        if ctx.precision is Precision.FP32:
            copy_model(model.fp32_path, ctx.variant_onnx)  # with its data file, if it has one
            ctx.settings = {}
        elif ctx.precision is Precision.FP16:
            def check(path: Path) -> None:
                onnx_model.check_runs_at_levels(path, model.signature.inputs, model.input_shapes, what(model),
                                                executor=model.executor, graph=f"the FP16 graph ({path.name})",
                                                value_ranges=model.spec.input_ranges, examples=model.evaluation)

            feeds = fp16_feeds(model)

            def make(out: Path) -> dict[str, object]:
                return to_fp16_checked(model.fp32_path, out, feeds=feeds, what=what(model), check=check,
                                       log_file=model.log_file)

            # Reused from an earlier run with the same graph, feeds and check (steps/fp16_cache.py): the check's
            # shapes, value ranges and the examples its integer inputs take values from decide whether
            # autocast's graph is kept or onnxconverter-common's replaces it.
            key = fp16_key(fp32_sha=model.fp32_sha, feeds=feeds_digest(feeds),
                           what_made_it={"converter": "to_fp16_checked", "shapes": model.input_shapes.to_json(),
                                         "input_ranges": {name: [r.low, r.high] for name, r
                                                          in sorted(model.spec.input_ranges.items())},
                                         "examples": samples.digest(model.evaluation)})
            try:
                ctx.settings, cached = cached_conversion(model.cache_dir, key, ctx.variant_onnx, make)
            except (ToolError, OnnxModelError) as exc:  # a converter failed, or its graph does not run
                # Quantized by its exporter, wholly or in part (kokoro keeps 26 float MatMul beside its integer
                # ops): the converters' failure is that graph's, and the model as given is what there is to serve.
                quantized = precision.already_quantized(model.fp32_path) or precision.integer_compute(model.fp32_path)
                if quantized is None:
                    raise
                # Both converters fail on a graph quantized by whoever made it (kokoro's TTS: MatMulInteger,
                # DynamicQuantizeLSTM): its FP16 variant is the model as given, as its INT8 variant is.
                log.warning("%s: the model is already quantized (%s) and FP16 conversion failed; the FP16 variant "
                            "is the model as given", what(model), quantized)
                copy_model(model.fp32_path, ctx.variant_onnx)
                ctx.settings = {"as_given": True, "fallback": "fp32", "why": f"already quantized ({quantized}); {exc}"}
                cached = False
            if cached:
                log.debug("%s: FP16 conversion reused from the cache", ctx.name)
        else:
            calibration_spec = model.spec.calibration
            if calibration_spec is None or model.calibration is None or model.calibration_digest is None:
                raise AssertionError("an INT8 variant without calibration data passed the spec check")
            ctx.calibration = precision.to_int8(
                model.fp32_path, fp32_sha=model.fp32_sha, calibration=model.calibration,
                data_digest=model.calibration_digest, spec=calibration_spec, out_path=ctx.variant_onnx,
                cache_dir=model.cache_dir, what=what(model), runtime=ctx.runtime.name, log_file=model.log_file)
            ctx.settings = ctx.calibration.settings


class Compile:
    """The artifact Triton serves, compiled from the variant ONNX by the runtime (which may reuse
    artifacts of an earlier build that are still valid)."""

    label = "compile"

    def run(self, ctx: VariantContext) -> None:
        ctx.variant_sha = sha256_model(ctx.variant_onnx)
        source, written = default_opset(ctx.model.fp32_path), default_opset(ctx.variant_onnx)
        if source != written:  # ModelOpt upgrades old exports (autocast to 13, Q/DQ to 19): say so
            log.debug("%s: the variant ONNX is opset %s (the model's is %s)", ctx.name, written, source)
            ctx.settings = {**ctx.settings, "opset": {"model": source, "variant": written}}
        ctx.version_dir.mkdir(parents=True, exist_ok=True)
        target = ctx.target()
        ctx.runtime.carry_over(ctx.model.repository / ctx.name / "1", ctx.version_dir, target)
        ctx.runtime.compile(ctx.variant_onnx, ctx.artifact, target)


class Measure:
    """The compiled artifact against the FP32 reference on the held-out samples and on samples at the min
    and max shapes where theirs differ (synthetic, or the user's brought to those shapes); the gate judges
    the worst level, and each level's figures are recorded."""

    label = "accuracy check (running the variant)"

    def run(self, ctx: VariantContext) -> None:
        ctx.metrics, levels = ctx.model.measure_levels(
            lambda samples: ctx.runtime.run(ctx.artifact, samples, ctx.model.eval_batch))
        ctx.level_metrics = levels if len(levels) > 1 else {}
        log.debug("%s: %s", ctx.name, ctx.metrics.summary())


class Gate:
    """The tolerance check. An FP16 or INT8 variant is guarded, whatever its tolerance's source (unless
    --no-guard): when it misses, search for the nodes to keep in higher precision, rebuild and check again.
    The failure line says whether a guard ran."""

    label = "accuracy gate"

    def run(self, ctx: VariantContext) -> None:
        assert ctx.metrics is not None, "Gate runs after Measure"
        spec = ctx.model.spec
        tolerance = spec.tolerance(ctx.precision)
        found = accuracy.first_violation(ctx.metrics, tolerance)
        if found is None:
            return
        problem = f"{ctx.name}: {found.text()}"
        if found.value is None:  # a limit on a metric this task does not give: no search can meet it
            raise AccuracyError(problem, violation=found)
        ran = ("after the FP16 guard" if ctx.fp16_guard is not None else
               "after the INT8 guard" if ctx.guard is not None else None)
        if ctx.precision is Precision.FP32 or ran is not None or not spec.guard:
            note = ran or (None if ctx.precision is Precision.FP32 else "no guard: --no-guard")
            raise AccuracyError(f"{problem} ({note})" if note else problem, violation=found, guard=note)
        fp16 = ctx.precision is Precision.FP16
        if fp16 and ctx.settings.get("tool") == FALLBACK_TOOL:
            # The FP16 guard converts with autocast, which failed on this model: no search can run.
            note = "no FP16 guard: it converts with ModelOpt autocast, which failed on this model"
            raise AccuracyError(f"{problem} ({note})", violation=found, guard=note)
        log.warning("%s; searching for nodes to keep in higher precision", problem)
        guard: Fp16Guard | Guard = Fp16Guard() if fp16 else Guard()
        with ctx.steps.step(type(guard).__name__):  # inside the Gate's own figures, listed before them
            guard.run(ctx)
        Compile().run(ctx)
        Measure().run(ctx)
        self.run(ctx)


class MeasureSpeed:
    """The gated variant's throughput at the opt shape (and FP32's, alternating) and size against FP32's, where
    the runtime is ONNX Runtime on the CPU (the artifact is what this process can run as served): an FP16 or
    INT8 variant slower or larger than FP32 is marked not worth serving (steps/speed.py). A variant that is
    FP32's graph under its name (a guard that fell back to FP32, a model given already quantized) is marked so
    on every runtime, without a measurement: FP32 itself is the one to serve. A measurement that fails is a
    warning: the variant met its tolerance."""

    label = "throughput measurement"

    def run(self, ctx: VariantContext) -> None:
        model = ctx.model
        fell_back = (ctx.guard.fallback if ctx.guard is not None else None) or \
            (ctx.fp16_guard.fallback if ctx.fp16_guard is not None else None)
        # FP32's graph under this variant's name: FP32 itself is the one to serve on any runtime.
        same_graph = (f"the FP32 graph (no {ctx.precision.value.upper()} mix met the tolerance)"
                      if fell_back is Precision.FP32 else
                      "the model as given (already quantized; FP16 conversion failed)"
                      if ctx.precision is Precision.FP16 and ctx.settings.get("as_given") else None)
        # Two measurements of one graph would say only how noisy the machine is: not worth their build time.
        ctx.speed = self._measured(ctx) if same_graph is None else \
            speed.unmeasured(speed.opt_batch(model.input_shapes), model.spec.serving.ort_intra_op_threads,
                             onnx_files.model_size(ctx.artifact), onnx_files.model_size(model.fp32_path), same_graph)
        if ctx.speed is not None and not ctx.speed.worth_serving:
            log.warning("%s not worth serving: %s", ctx.name, ctx.speed.reason)

    @staticmethod
    def _measured(ctx: VariantContext) -> Speed | None:
        model = ctx.model
        if model.speed_meter is None or ctx.runtime.name != RuntimeChoice.ONNXRUNTIME.value:
            return None
        # A graph the meter cannot run fails as under the executor (ONNX Runtime both, by default).
        failed: tuple[type[Exception], ...] = (*model.executor.errors, DataError)
        try:
            feed, batch = speed.opt_feed(model.signature.inputs, model.input_shapes, model.spec.input_ranges,
                                         real=model.evaluation)
            return speed.measure(ctx.precision, ctx.artifact, model.fp32_path, feed, batch=batch,
                                 threads=model.spec.serving.ort_intra_op_threads,
                                 size=onnx_files.model_size(ctx.artifact),
                                 fp32_size=onnx_files.model_size(model.fp32_path), meter=model.speed_meter)
        except failed as exc:
            log.warning("%s: throughput not measured: %s", ctx.name, tool_cause(exc))
            return None


class Guard:
    """Replace the plain INT8 ONNX by the guarded mix (or FP16 when no mix meets the tolerance)."""

    label = "INT8 guard"

    def run(self, ctx: VariantContext) -> None:
        model = ctx.model
        spec = model.spec
        assert spec.calibration is not None and model.calibration is not None
        assert model.calibration_digest is not None
        # The settings that made the plain INT8: the recipe chosen for "auto" with its op types and the nodes it
        # left in float, or the fallback's where the first recipe failed on this model (to_int8), so the guard's
        # candidates do not run the failing recipe again, each with its warning.
        done = ctx.calibration.spec if ctx.calibration is not None else None
        ctx.guard = guard_int8(
            fp32_path=model.fp32_path, fp32_sha=model.fp32_sha, calibration=model.calibration,
            calibration_digest=model.calibration_digest, spec=done or spec.calibration, runtime=ctx.runtime.name,
            variant_onnx=ctx.variant_onnx,
            evaluation=model.evaluation, reference=model.reference, task=spec.task,
            tolerance=spec.tolerance(ctx.precision), cache_dir=model.cache_dir, work=model.work,
            fp16_feeds=fp16_feeds(model), what=what(model), log_file=model.log_file, executor=model.executor,
            batch_size=model.eval_batch, method=model.guard_sensitivity, budget_s=model.guard_budget_s,
            # Scored as the gate scores (the evaluation samples and the min/max levels): a pick measured on
            # the evaluation samples alone met the limit in the search and missed it at the gate (MiniLM
            # INT8: 0.607 at another sequence length).
            measure=lambda path: model.measure(lambda samples: model.executor.run(path, samples, model.eval_batch)),
            float_graph=_quantizer_input(model, ctx.calibration),
        )


def _quantizer_input(model: ModelContext, calibration: precision.CalibrationResult | None) -> Path | None:
    """The float graph the plain INT8's quantizer was given, where it is not the FP32 graph (kept beside the
    calibration: ONNX Runtime's pre-processing); None: the FP32 graph."""
    if calibration is None or not calibration.cache_key:
        return None
    path = precision.float_graph(model.cache_dir, calibration.cache_key)
    return path if path.is_file() else None


class Fp16Guard:
    """Replace the plain FP16 ONNX by the guarded mix (or FP32 when no mix meets the tolerance)."""

    label = "FP16 guard"

    def run(self, ctx: VariantContext) -> None:
        model = ctx.model

        def evaluate(path: Path) -> Metrics:
            return model.measure(lambda samples: model.executor.run(path, samples, model.eval_batch))

        ctx.fp16_guard = guard_fp16(
            fp32_path=model.fp32_path, feeds=fp16_feeds(model), variant_onnx=ctx.variant_onnx, evaluate=evaluate,
            tolerance=model.spec.tolerance(ctx.precision), what=what(model), work=model.work,
            log_file=model.log_file, evaluation=model.evaluation, batch_size=model.eval_batch,
            method=model.guard_sensitivity, cache_dir=model.cache_dir, budget_s=model.guard_budget_s)
        ctx.settings = ctx.fp16_guard.settings or {"fallback": "fp32", "why": "no FP16 mix met the tolerance"}


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
                              backend=ctx.runtime.backend_config(target, ctx.version_dir), shapes=model.input_shapes)
        model_folder.write_config(ctx.model_dir, ctx.version_dir, inputs)
        build_key, recorded_inputs = model.record_of(ctx.precision)
        model_folder.write_record(ctx.model_dir, {
            "build_key": build_key,
            "model": spec.name,
            "source": spec.source or str(spec.onnx),
            "fp32_onnx_sha256": model.fp32_sha,
            "precision_settings": ctx.settings,
            "served_options": ctx.runtime.served_options(ctx.version_dir / ctx.runtime.artifact),
            "variant_onnx_sha256": ctx.variant_sha,
            "inputs": dict(recorded_inputs),
            "shapes": model.input_shapes.to_json(),
            "tools": model.inputs_record["tools"],
            "samples": samples_record(spec),
            **self.result.to_json(),
        })


def samples_record(spec: ModelSpec) -> dict[str, object]:
    """Where the build's samples came from, for `trtbuild verify` without a models.toml (build --onnx): the
    evaluation and calibration data (files by absolute path) and the value ranges of synthetic ones."""

    def data(spec_data: DataSpec | None) -> dict[str, object] | None:
        if spec_data is None:
            return None
        source = str(Path(spec_data.source).resolve()) if spec_data.is_file else spec_data.source
        return {"source": source, "samples": spec_data.samples, "seed": spec_data.seed}

    return {"evaluation": data(spec.evaluation),
            "calibration": data(spec.calibration.data if spec.calibration is not None else None),
            "input_ranges": {name: [r.low, r.high] for name, r in spec.input_ranges.items()},
            "task": spec.task.value}


STEPS: tuple[Step, ...] = (MakePrecision(), Compile(), Measure(), Gate(), MeasureSpeed())


# An ONNX check failing inside a step, or (with the executor's `errors`, added in run_step) a converted graph
# the reference executor cannot load or run: the user's model (or a tool's output for it), not a bug of ours:
# one line, the full text in the build log.
_GRAPH_ERRORS: tuple[type[BaseException], ...] = (onnx.checker.ValidationError, onnx.shape_inference.InferenceError)


def run_step(step: Step, ctx: VariantContext) -> None:
    """One step; a converted graph's failure inside it, or any exception a tool raised (ONNX Runtime's Python
    layer, onnx, ModelOpt: precision.raised_by_tool), becomes a ToolError naming the model, the variant and
    the step (the other variants go on), with the traceback in the build log. Our own code's exceptions are
    bugs and keep their traceback."""
    try:
        step.run(ctx)
    except BuilderError:
        raise
    except Exception as exc:
        if not (isinstance(exc, (*ctx.model.executor.errors, *_GRAPH_ERRORS)) or precision.raised_by_tool(exc)):
            raise
        model = what(ctx.model)
        record = precision.failure_log(f"{ctx.name} {step.label} {model}", "", exc, log_file=ctx.model.log_file)
        raise ToolError(f"{model}: {ctx.name}: {step.label} failed: {tool_cause(exc)} (full output: {record})"
                        ) from exc


def build_variant(ctx: VariantContext) -> VariantResult:
    with progress.task(f"{ctx.name}: building"):
        for step in STEPS:
            with ctx.steps.step(type(step).__name__):
                run_step(step, ctx)
    result = VariantResult.of(ctx)
    WriteModelFolder(result).run(ctx)
    log.debug("%s built in %.1f s", ctx.name, result.build_seconds)
    return result
