"""The orchestrator: each model through export → checks → clean-up → reference → its variants'
steps → staged model folders, each committed to the repository as soon as it passes (one that fails
is listed and the repository's copy of it stays), or, with `all_or_nothing`, all of them only when
every model passed.

It drives whatever runtime it is given through the Runtime seam and knows nothing specific to one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from builder import __version__
from builder.errors import AccuracyError, BuilderError, DataError
from builder.repository import onnx_files
from builder.repository.lock import repository_lock
from builder.repository.model_folder import read_record
from builder.repository.staging import Staging
from builder.repository.tuned_serving import layer
from builder.runtimes.base import ReferenceExecutor, Runtime
from builder.runtimes.onnxruntime import OnnxRuntimeReference, ort_rounds
from builder.spec.enums import GuardSensitivity, Precision
from builder.spec.model import ModelSpec
from builder.spec.names import variant_name
from builder.spec.settings import default_cache_dir
from builder.spec.shapes import Level, ModelShapes, for_model
from builder.spec.tuned import TunedServing
from builder.steps import cleanup, int8_recipe, onnx_model, precision, samples, speed
from builder.steps.cleanup import SlimReport
from builder.steps.context import EVAL_BATCH, LevelSamples, ModelContext, VariantContext
from builder.steps.results import VariantResult
from builder.steps.speed import Meter
from builder.steps.variant import build_variant
from common.choices import Choice
from common.files import write_json

log = logging.getLogger(__name__)


@dataclass
class BuildOptions:
    repository: Path
    runtime: Runtime
    cache_dir: Path = field(default_factory=default_cache_dir)
    force: bool = False
    wait: bool = True  # for another writer of the repository to finish (False: fail at once)
    # `trtbuild tune`'s settings by variant name (tuned.toml beside the manifest), layered over models.toml.
    tuned: Mapping[str, TunedServing] = field(default_factory=dict)
    # True: the first failure stops the build and nothing is written (for CI pipelines that want it);
    # False: every variant that passes is written, each on its own, and failures are listed.
    all_or_nothing: bool = False
    # How the accuracy guards rank nodes: one pass over both graphs, or one conversion per node.
    guard_sensitivity: GuardSensitivity = GuardSensitivity.ONE_PASS
    # Where the specs came from, as rebuild reasons name it: "models.toml entry", or "build flags" (build --onnx).
    spec_origin: str = "models.toml entry"
    # How each variant's throughput is measured against FP32's (steps/speed.py); None, or TRTBUILD_NO_SPEED
    # set: not measured.
    speed_meter: Meter | None = ort_rounds
    # The build log: tools' full output is appended there and the one-line errors name it (the CLI's --log);
    # None: each failure's output in a file of its own under the cache. The runtime gets it at construction.
    log_file: Path | None = None
    # What runs the FP32 reference and the candidates the clean-up and the guards compare with it, whatever
    # runtime serves the variants; the steps get it through their context, never ONNX Runtime directly.
    executor: ReferenceExecutor = field(default_factory=OnnxRuntimeReference)


class ModelStatus(Choice):
    BUILT = "built"
    UNCHANGED = "unchanged"
    FAILED = "failed"  # before any variant was built (export, checks, data): none written


@dataclass(frozen=True)
class VariantFailure:
    """A variant not written by this build: why, as one line, and for an accuracy miss the metric, its
    value and the limit. `kept_previous`: the repository still holds the copy an earlier build wrote."""

    variant: str
    precision: Precision
    reason: str
    metric: str | None = None
    value: float | None = None
    limit: float | None = None
    kept_previous: bool = False

    def line(self) -> str:
        kept = f"; the previous {self.variant} stays in place" if self.kept_previous else ""
        return f"{self.variant} not written: {self.reason}{kept}"


def _failure(variant: str, prec: Precision, exc: BuilderError, repository: Path) -> VariantFailure:
    kept = (repository / variant / "config.pbtxt").is_file()
    found = exc.violation if isinstance(exc, AccuracyError) else None
    if found is not None:
        guard = exc.guard if isinstance(exc, AccuracyError) and exc.guard else None
        reason = f"{found.text()} ({guard})" if guard else found.text()
        return VariantFailure(variant, prec, reason, found.metric, found.value, found.limit, kept)
    return VariantFailure(variant, prec, str(exc).removeprefix(f"{variant}: "), kept_previous=kept)


@dataclass
class ModelResult:
    name: str
    status: ModelStatus
    build_key: str
    variants: list[VariantResult]
    cleanup: SlimReport | None = None
    seconds: float = 0.0
    failures: list[VariantFailure] = field(default_factory=list)
    error: str | None = None  # status FAILED: why no variant was built
    unchanged: list[str] = field(default_factory=list)  # status BUILT: variants whose inputs had not changed


def tool_versions() -> dict[str, str]:
    names = ["torch", "onnx", "onnxruntime", "nvidia-modelopt", "onnxslim", "tritonclient"]
    found = {"builder": __version__}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "absent"
    return found


def _load_samples(spec: ModelSpec, sig: onnx_model.Signature,
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


def _other_levels(spec: ModelSpec, sig: onnx_model.Signature, shapes: ModelShapes, fp32_path: Path,
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


def _digest(payload: object) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _spec_fingerprint(spec: ModelSpec) -> dict[str, Any]:
    raw = asdict(spec)
    raw["onnx"] = None  # the file's content is hashed instead of its path
    return raw


# Fields of a spec that are one precision's own (its tolerance, INT8's calibration settings): they are in
# that variant's "settings", so that changing one rebuilds that variant only.
_PER_PRECISION = ("precisions", "tolerances", "calibration", "guard")


def spec_fields(spec: ModelSpec) -> dict[str, str]:
    """The spec's fields every variant depends on, each by a short digest (a changed one is named)."""
    raw = _spec_fingerprint(spec)
    return {name: _digest(value)[:16] for name, value in sorted(raw.items()) if name not in _PER_PRECISION}


def precision_settings(spec: ModelSpec, prec: Precision, int8: Mapping[str, Any] | None = None,
                       guard_sensitivity: GuardSensitivity = GuardSensitivity.ONE_PASS) -> dict[str, Any]:
    """What only this precision's variant depends on: its tolerance, its guard and how the guard ranks nodes
    (another ranking can keep other nodes in higher precision), and, for INT8, the calibration settings (the
    data itself is in the inputs every variant shares: FP16 measures its ranges on it too) and the recipe
    `int8` the graph and runtime decide (int8_key)."""
    settings: dict[str, Any] = {"tolerance": asdict(spec.tolerance(prec))}
    if prec is not Precision.FP32:
        settings["guard"] = spec.guard
        if spec.guard:
            settings["guard_sensitivity"] = guard_sensitivity
    if prec is Precision.INT8 and spec.calibration is not None:
        settings["calibration"] = {k: v for k, v in asdict(spec.calibration).items() if k != "data"}
        settings["int8_version"] = precision.INT8_VERSION
        if int8 is not None:
            settings["int8_recipe"] = dict(int8)
    recorded: dict[str, Any] = json.loads(json.dumps(settings, sort_keys=True, default=str))  # as build.json holds it
    return recorded


def variant_inputs(spec: ModelSpec, shared: Mapping[str, Any],
                   int8: Mapping[str, Any] | None = None,
                   guard_sensitivity: GuardSensitivity = GuardSensitivity.ONE_PASS) -> dict[Precision, dict[str, Any]]:
    """Each variant's inputs: what every variant shares and its own settings; its digest is its build key."""
    return {prec: {**shared, "settings": precision_settings(spec, prec, int8, guard_sensitivity)}
            for prec in spec.precisions}


def int8_key(spec: ModelSpec, fp32_path: Path, runtime: str) -> dict[str, Any] | None:
    """The INT8 recipe the graph and the runtime decide (steps/int8_recipe.py), as the INT8 variant's build key
    holds it: a new runtime or class rebuilds that variant. None without an INT8 variant."""
    if Precision.INT8 not in spec.precisions or spec.calibration is None:
        return None
    choice = int8_recipe.choose_for(fp32_path, spec.calibration.recipe, runtime)
    return {"recipe": choice.recipe.value, "class": choice.model_class.value,
            "as_given": precision.already_quantized(fp32_path) is not None}


def _stale(spec: ModelSpec, repository: Path, keys: Mapping[Precision, str]) -> list[Precision]:
    """The precisions whose variant in the repository was not built from these inputs."""
    found = []
    for prec in spec.precisions:
        record = read_record(repository / variant_name(spec.name, prec))
        if record is None or record.build_key != keys[prec]:
            found.append(prec)
    return found


_REASON_LABELS = {"onnx": "exported ONNX", "evaluation": "evaluation data", "calibration": "calibration data",
                  "spec": "models.toml entry", "settings": "models.toml entry", "runtime": "runtime",
                  "recipe": "build recipe", "tools": "tool versions"}


def _change(old: object, new: object) -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        return ", ".join(f"{k} {old.get(k)} -> {new.get(k)}" for k in changed)
    return f"{old} -> {new}"


def rebuild_reasons(spec: ModelSpec, repository: Path, wanted: Mapping[str, Any], *,
                    per_precision: Mapping[Precision, Mapping[str, Any]] | None = None,
                    origin: str = "models.toml entry") -> list[str]:
    """Why a model's variants are rebuilt, from what their build records say they were built from: `wanted`
    (what every variant depends on) and `per_precision` (each variant's own, e.g. its "settings"). `origin`
    names where the spec came from ("models.toml entry", "build flags"). Empty when the records match (a
    forced rebuild)."""
    reasons: list[str] = []
    missing: list[str] = []
    for prec in spec.precisions:
        record = read_record(repository / variant_name(spec.name, prec))
        if record is None:
            missing.append(variant_name(spec.name, prec))
            continue
        present = record.inputs
        want = {**wanted, **(per_precision or {}).get(prec, {})}
        for key in sorted(set(present) | set(want), key=lambda k: (k not in _REASON_LABELS, k)):
            old, new = present.get(key), want.get(key)
            if old == new:
                continue
            label = origin if key in ("spec", "settings") else _REASON_LABELS.get(key, key)
            if key == "spec" and isinstance(old, dict) and isinstance(new, dict):
                changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
                reasons.append(f"{label} changed: {', '.join(changed)}")
            elif key == "settings" and isinstance(old, dict) and isinstance(new, dict):
                for name in sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k)):
                    reasons.append(f"{label} changed: {name} {prec.value} ({_change(old.get(name), new.get(name))})")
            elif isinstance(old, dict) and isinstance(new, dict):
                reasons.append(f"{label} changed ({_change(old, new)})")
            else:
                reasons.append(f"{label} changed")
    return ([f"{', '.join(missing)} not built yet"] if missing else []) + sorted(set(reasons))


def _source_onnx(spec: ModelSpec, out: Path) -> None:
    """The model's FP32 ONNX in `out`: exported from PyTorch, or the user's file."""
    if spec.source is not None:
        from builder.steps.export import export  # imports torch: only when exporting

        export(spec, out)
        return
    assert spec.onnx is not None
    onnx_files.load(spec.onnx)
    onnx_files.copy_model(spec.onnx, out)  # with its external data file, if it has one


def build_model(spec: ModelSpec, options: BuildOptions, staging: Staging) -> ModelResult:
    started = time.perf_counter()
    what = f"model {spec.name!r}"
    with tempfile.TemporaryDirectory(prefix=f"trtbuild-{spec.name}-") as tmp:
        work = Path(tmp)
        fp32_path = work / "reference.onnx"
        _source_onnx(spec, fp32_path)
        sig = onnx_model.signature(onnx_model.inferred(fp32_path, what), what)
        onnx_model.check_manifest_inputs(sig, spec.inputs, what)
        shapes = for_model(spec, sig.inputs, what)
        if not shapes.batching:
            log.warning("%s: built with max_batch_size 0 (whole shapes, no dynamic batching): %s",
                        spec.name, shapes.reason)
        evaluation, calibration = _load_samples(spec, sig, shapes)
        calibration_digest = samples.digest(calibration) if calibration is not None else None
        # What every variant depends on, and each variant's own settings: the digest of both is that variant's
        # build key, and a changed field names the reason. A variant whose key is unchanged is not rebuilt.
        inputs_record = {"onnx": onnx_files.sha256_model(fp32_path), "evaluation": samples.digest(evaluation),
                         "calibration": calibration_digest, "spec": spec_fields(spec),
                         "runtime": {"name": options.runtime.name, **options.runtime.identity()},
                         "recipe": precision.RECIPE_VERSION, "tools": tool_versions()}
        key = _digest(inputs_record)
        per_variant = variant_inputs(spec, inputs_record, int8_key(spec, fp32_path, options.runtime.name),
                                     options.guard_sensitivity)
        keys = {prec: _digest(record) for prec, record in per_variant.items()}
        stale = list(spec.precisions) if options.force else _stale(spec, options.repository, keys)
        if not stale:
            log.info("%s: inputs unchanged, nothing rebuilt", spec.name)
            _layer_tuned(spec, options.repository, options.tuned)
            return ModelResult(spec.name, ModelStatus.UNCHANGED, key, [], seconds=time.perf_counter() - started)
        reasons = rebuild_reasons(spec, options.repository, inputs_record, origin=options.spec_origin,
                                  per_precision={p: {"settings": r["settings"]} for p, r in per_variant.items()})
        log.info("%s: rebuilding: %s", spec.name, "; ".join(reasons or ["--force"]))  # one line per model

        eval_batch = EVAL_BATCH if shapes.batching else None
        # The user's data first, on the graph as given (a size inside the range the graph cannot take):
        # one line here, not a traceback from the clean-up's probe run.
        executor = options.executor
        onnx_model.run_fp32(fp32_path, samples.take(evaluation, 0, 4), eval_batch, what, executor=executor)
        declared = onnx_model.signature(onnx_files.load(fp32_path), what)  # as the user's graph declares them
        slim_report = cleanup.slim(fp32_path, samples.take(evaluation, 0, 4), executor=executor,
                                   batch_size=eval_batch)
        onnx_model.check_runs_at_levels(fp32_path, sig.inputs, shapes, what, executor=executor,
                                        value_ranges=spec.input_ranges, examples=evaluation)
        reference = onnx_model.run_fp32(fp32_path, evaluation, eval_batch, what, executor=executor)
        # Outputs as ONNX Runtime returns them: a declared shape the graph contradicts is one warning line.
        for note in onnx_model.output_shape_notes(declared, reference, batching=shapes.batching):
            log.warning("%s: %s", spec.name, note)
        model = ModelContext(
            spec=spec, fp32_path=fp32_path, fp32_sha=onnx_files.sha256_model(fp32_path),
            signature=onnx_model.returned_outputs(declared, reference, batching=shapes.batching),
            evaluation=evaluation, calibration=calibration, calibration_digest=calibration_digest,
            reference=reference, build_key=key, variant_inputs={p: (keys[p], r) for p, r in per_variant.items()},
            inputs_record=inputs_record, work=work, cache_dir=options.cache_dir, repository=options.repository,
            executor=executor, shapes=shapes,
            other_levels=_other_levels(spec, sig, shapes, fp32_path, eval_batch, what, evaluation, executor),
            guard_sensitivity=options.guard_sensitivity,
            speed_meter=None if speed.skipped() else options.speed_meter, log_file=options.log_file,
        )
        variants: list[VariantResult] = []
        failures: list[VariantFailure] = []
        for prec in spec.precisions:
            name = variant_name(spec.name, prec)
            if prec not in stale:  # built from these very inputs: left as it is
                continue
            try:
                variants.append(build_variant(VariantContext(model, prec, options.runtime, staging.dir(name))))
            except BuilderError as exc:
                # A variant the tools refused (ModelOpt, TensorRT's parser), the gate rejected, or whose
                # own data failed: the model's other variants go on.
                if options.all_or_nothing:
                    raise
                staging.drop(name)
                failures.append(_failure(name, prec, exc, options.repository))
                log.debug("%s", failures[-1].line())  # the CLI prints the failures once, at the end
                continue
            if not options.all_or_nothing:
                _layer_tuned(spec, staging.root, options.tuned)
                staging.commit_one(name)
        _layer_tuned(spec, staging.root, options.tuned)  # all-or-nothing: the staged variants
    return ModelResult(spec.name, ModelStatus.BUILT, key, variants, slim_report, time.perf_counter() - started,
                       failures, unchanged=[variant_name(spec.name, p) for p in spec.precisions if p not in stale])


def _layer_tuned(spec: ModelSpec, root: Path, tuned: Mapping[str, TunedServing]) -> None:
    """Each variant's config serves its tuned settings where tuned.toml has some (else the manifest's)."""
    for prec in spec.precisions:
        name = variant_name(spec.name, prec)
        if (root / name / "config.pbtxt").is_file():
            line = layer(root / name, tuned.get(name))
            if line is not None:
                log.info("%s", line)


def _model_failed(spec: ModelSpec, exc: BuilderError, repository: Path) -> ModelResult:
    failures = []
    for prec in spec.precisions:
        failures.append(_failure(variant_name(spec.name, prec), prec, exc, repository))
    log.debug("%s: %s", spec.name, exc)  # the CLI prints it once, at the end
    return ModelResult(spec.name, ModelStatus.FAILED, "", [], failures=failures, error=str(exc))


def _accumulated(report_path: Path, repository: Path, models: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """This build's models after those an earlier report of the same repository lists and this build did not
    build (per model, the newest build's entry): one report for every model built into the repository."""
    try:
        earlier = json.loads(report_path.read_text(encoding="utf-8"))
        # The same repository however it was spelled (`R`, `./R`, `/abs/R`): the default report lies in it,
        # and a relative path recorded by an earlier build is read from here, where builds usually run.
        recorded = earlier.get("repository")
        same = report_path.resolve().parent == repository.resolve() or (
            isinstance(recorded, str) and Path(recorded).resolve() == repository.resolve())
        kept = earlier["models"] if same else []
        names = {m["name"] for m in models}
        kept = [m for m in kept if isinstance(m, dict) and m.get("name") not in names]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none yet, or not one of ours
        kept = []
    return [*kept, *models]


def build_all(
    specs: list[ModelSpec], options: BuildOptions, report_path: Path | None, command: list[str]
) -> list[ModelResult]:
    """Build every model. Each variant that passes is written as it passes and each failure is listed in
    its model's result (the report is written either way); with `all_or_nothing`, the first failure
    raises and nothing is written."""
    started = time.time()
    results: list[ModelResult] = []
    with repository_lock(options.repository, what=f"the build of {', '.join(s.name for s in specs)}",
                         wait=options.wait):
        staging = Staging(options.repository)
        errors: list[BuilderError] = []
        try:
            for spec in specs:
                try:
                    results.append(build_model(spec, options, staging))
                except BuilderError as exc:
                    # The model failed before its variants (export, checks, data): the other models go on.
                    if options.all_or_nothing:
                        raise
                    errors.append(exc)
                    results.append(_model_failed(spec, exc, options.repository))
            if options.all_or_nothing:
                staging.commit()
        finally:
            staging.discard()
        if report_path is not None:  # under the lock: a build beside this one adds its models after
            models = [{**asdict(r), "command": command, "started_unix": started} for r in results]
            write_json(report_path, {
                "command": command,
                "started_unix": started,
                "seconds": round(time.time() - started, 3),
                "repository": str(options.repository),
                "runtime": options.runtime.name,
                "tools": tool_versions(),
                "models": _accumulated(report_path, options.repository, models),
            })
    if errors and len(errors) == len(specs):
        # Every model failed before building anything: no model was written; the report (above) says why.
        if len(errors) == 1:
            raise errors[0]
        raise BuilderError("\n".join(str(e) for e in errors))
    return results
