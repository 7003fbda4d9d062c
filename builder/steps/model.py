"""One model's build, from the context the orchestrator hands down to the result it returns: the model loaded,
its build keys (nothing rebuilt where they are unchanged), the FP32 reference prepared, each stale variant built
by its steps and committed as it passes (or, all-or-nothing, left staged for the caller), and the tuned serving
settings layered over each config."""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

from builder.errors import BuilderError
from builder.repository import onnx_files
from builder.repository.tuned_serving import layer
from builder.spec.enums import Precision
from builder.spec.names import variant_name
from builder.steps import precision, prepare, samples
from builder.steps.build_key import digest, int8_key, rebuild_reasons, spec_fields, stale, tool_versions, variant_inputs
from builder.steps.context import BuildContext, ModelContext, VariantContext
from builder.steps.model_result import ModelResult, ModelStatus, VariantFailure, failure
from builder.steps.results import VariantResult
from builder.steps.variant import build_variant

# A model's build lines keep the name they have always had in the build log and on stderr
# ("INFO builder.pipeline: m: rebuilding: ..."), which users and scripts filter on.
log = logging.getLogger("builder.pipeline")


def build_model(job: BuildContext) -> ModelResult:
    started = time.perf_counter()
    spec = job.spec
    with tempfile.TemporaryDirectory(prefix=f"trtbuild-{spec.name}-") as tmp:
        work = Path(tmp)
        source = prepare.load(job, work)
        fp32_path = source.fp32_path
        calibration_digest = samples.digest(source.calibration) if source.calibration is not None else None
        # What every variant depends on, and each variant's own settings: the digest of both is that variant's
        # build key, and a changed field names the reason. A variant whose key is unchanged is not rebuilt.
        inputs_record = {"onnx": onnx_files.sha256_model(fp32_path), "evaluation": samples.digest(source.evaluation),
                         "calibration": calibration_digest, "spec": spec_fields(spec),
                         "runtime": {"name": job.runtime.name, **job.runtime.identity()},
                         "recipe": precision.RECIPE_VERSION, "tools": tool_versions()}
        key = digest(inputs_record)
        per_variant = variant_inputs(spec, inputs_record, int8_key(spec, fp32_path, job.runtime.name),
                                     job.guard_sensitivity, job.guard_budget_s)
        keys = {prec: digest(record) for prec, record in per_variant.items()}
        to_build = list(spec.precisions) if job.force else stale(spec, job.repository, keys)
        if not to_build:
            log.info("%s: inputs unchanged, nothing rebuilt", spec.name)
            layer_tuned(job, job.repository)
            return ModelResult(spec.name, ModelStatus.UNCHANGED, key, [], seconds=time.perf_counter() - started)
        reasons = rebuild_reasons(spec, job.repository, inputs_record, origin=job.spec_origin,
                                  per_precision={p: {"settings": r["settings"]} for p, r in per_variant.items()})
        log.info("%s: rebuilding: %s", spec.name, "; ".join(reasons or ["--force"]))  # one line per model

        model, slim_report = prepare.reference(
            job, source, work=work, calibration_digest=calibration_digest, build_key=key,
            inputs_record=inputs_record, variant_inputs={p: (keys[p], r) for p, r in per_variant.items()})
        variants, failures = _variants(job, model, to_build)
        layer_tuned(job, job.staging.root)  # all-or-nothing: the staged variants
    return ModelResult(spec.name, ModelStatus.BUILT, key, variants, slim_report, time.perf_counter() - started,
                       failures, unchanged=[variant_name(spec.name, p) for p in spec.precisions if p not in to_build])


def _variants(job: BuildContext, model: ModelContext,
              to_build: list[Precision]) -> tuple[list[VariantResult], list[VariantFailure]]:
    """Each stale variant through its steps, committed as soon as it passes (unless all-or-nothing)."""
    variants: list[VariantResult] = []
    failures: list[VariantFailure] = []
    for prec in job.spec.precisions:
        name = variant_name(job.spec.name, prec)
        if prec not in to_build:  # built from these very inputs: left as it is
            continue
        try:
            variants.append(build_variant(VariantContext(model, prec, job.runtime, job.staging.dir(name))))
        except BuilderError as exc:
            # A variant the tools refused (ModelOpt, TensorRT's parser), the gate rejected, or whose
            # own data failed: the model's other variants go on.
            if job.all_or_nothing:
                raise
            job.staging.drop(name)
            failures.append(failure(name, prec, exc, job.repository))
            log.debug("%s", failures[-1].line())  # the CLI prints the failures once, at the end
            continue
        if not job.all_or_nothing:
            layer_tuned(job, job.staging.root)
            job.staging.commit_one(name)
    return variants, failures


def layer_tuned(job: BuildContext, root: Path) -> None:
    """Each variant's config serves its tuned settings where tuned.toml has some (else the manifest's)."""
    for prec in job.spec.precisions:
        name = variant_name(job.spec.name, prec)
        if (root / name / "config.pbtxt").is_file():
            line = layer(root / name, job.tuned.get(name))
            if line is not None:
                log.info("%s", line)
