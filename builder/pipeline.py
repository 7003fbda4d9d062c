"""One model through the whole pipeline: export → clean-up → precision variants → accuracy → staged model folders."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from numpy.typing import NDArray

from builder import __version__, accuracy, cleanup, onnx_model, precision, triton_config
from builder import data as data_mod
from builder.errors import AccuracyError, DataError
from builder.manifest import ModelSpec, Tolerance
from builder.repository import RECORD, Staging, read_record, write_json
from builder.runtimes import CompileTarget, Runtime

log = logging.getLogger(__name__)

# Batch used to run held-out samples through each variant during the accuracy check.
_EVAL_BATCH = 16
# Applied when models.toml gives no tolerance for a precision.
DEFAULT_TOLERANCES = {
    "fp32": Tolerance(max_rel=1e-4),
    "fp16": Tolerance(cosine_min=0.999),
    "int8": Tolerance(cosine_min=0.97),
}


@dataclass
class BuildOptions:
    repository: Path
    runtime: Runtime
    serving_backend: str = "python"
    cache_dir: Path = field(default_factory=precision.default_cache_dir)
    force: bool = False


@dataclass
class VariantResult:
    name: str
    precision: str
    runtime: str
    artifact: str
    sha256: str
    size_bytes: int
    accuracy: dict[str, float]
    tolerance: dict[str, float | None]
    build_seconds: float
    calibration: dict[str, object] | None = None
    guard: dict[str, Any] | None = None


@dataclass
class ModelResult:
    name: str
    status: str  # built | unchanged
    build_key: str
    variants: list[VariantResult]
    cleanup: dict[str, object] | None = None
    seconds: float = 0.0


def tool_versions() -> dict[str, str]:
    names = ["torch", "onnx", "onnxruntime", "nvidia-modelopt", "onnxslim", "tritonclient"]
    found = {"builder": __version__}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "absent"
    return found


def variant_name(model: str, prec: str) -> str:
    return f"{model}_{prec}"


def _load_samples(spec: ModelSpec, sig: onnx_model.Signature) -> tuple[data_mod.Samples, data_mod.Samples | None]:
    """Held-out evaluation samples and calibration samples, both checked against the graph's inputs."""
    dims = dict(spec.dims)
    calibration = None
    if spec.calibration is not None:
        calibration = data_mod.load(spec.calibration.data, f"model {spec.name!r}: calibration")
        data_mod.validate(calibration, sig.inputs, dims, f"model {spec.name!r}: calibration data")
    if spec.evaluation is not None:
        evaluation = data_mod.load(spec.evaluation, f"model {spec.name!r}: evaluation")
        data_mod.validate(evaluation, sig.inputs, dims, f"model {spec.name!r}: evaluation data")
    elif calibration is not None:
        # Hold out the last quarter: evaluation never sees a calibration sample.
        count = len(next(iter(calibration.values())))
        if count < 8:
            raise DataError(
                f"model {spec.name!r}: calibration data has {count} samples; with no evaluation data "
                "expected at least 8 (a quarter is held out for the accuracy check)"
            )
        cut = count - count // 4
        evaluation = data_mod.take(calibration, cut, count)
        calibration = data_mod.take(calibration, 0, cut)
    else:
        evaluation = data_mod.random_samples(sig.inputs, dims, 16, seed=1)
    return evaluation, calibration


def _spec_fingerprint(spec: ModelSpec) -> dict[str, Any]:
    raw = asdict(spec)
    raw["onnx"] = None  # the file's content is hashed instead of its path
    return raw


def _digest(payload: object) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _up_to_date(spec: ModelSpec, repository: Path, key: str) -> bool:
    for prec in spec.precisions:
        record = read_record(repository / variant_name(spec.name, prec))
        if record is None or record.get("build_key") != key:
            return False
    return True


def build_model(spec: ModelSpec, options: BuildOptions, staging: Staging) -> ModelResult:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"trtbuild-{spec.name}-") as tmp:
        work = Path(tmp)
        fp32_path = work / "reference.onnx"
        if spec.source is not None:
            from builder.export import export

            export(spec, fp32_path)
        else:
            assert spec.onnx is not None
            onnx_model.load(spec.onnx)
            shutil.copyfile(spec.onnx, fp32_path)
        model = onnx_model.infer_shapes(onnx_model.load(fp32_path), f"model {spec.name!r}")
        sig = onnx_model.signature(model, f"model {spec.name!r}")
        onnx_model.check_manifest_inputs(sig, spec.inputs, f"model {spec.name!r}")
        onnx_model.check_batchable(sig, dict(spec.dims), f"model {spec.name!r}")
        evaluation, calibration = _load_samples(spec, sig)
        eval_digest = data_mod.digest(evaluation)
        calib_digest = data_mod.digest(calibration) if calibration is not None else None
        exported_sha = onnx_model.sha256_file(fp32_path)
        # Everything a variant depends on; its digest is the build key, and a changed field names the reason.
        inputs_record = {"onnx": exported_sha, "evaluation": eval_digest, "calibration": calib_digest,
                         "spec": _digest(_spec_fingerprint(spec)),
                         "runtime": {"name": options.runtime.name, **options.runtime.identity()},
                         "serving_backend": options.serving_backend, "recipe": precision.RECIPE_VERSION,
                         "tools": tool_versions()}
        key = _digest(inputs_record)
        if not options.force and _up_to_date(spec, options.repository, key):
            log.info("%s: inputs unchanged, nothing rebuilt", spec.name)
            return ModelResult(spec.name, "unchanged", key, [], seconds=time.perf_counter() - started)
        for reason in rebuild_reasons(spec, options.repository, inputs_record):
            log.info("%s: rebuilding: %s", spec.name, reason)

        slim_report = cleanup.slim(fp32_path, data_mod.take(evaluation, 0, 4))
        fp32_sha = onnx_model.sha256_file(fp32_path)
        sig = onnx_model.signature(onnx_model.load(fp32_path), f"model {spec.name!r}")
        # The reference is always FP32 under ONNX Runtime, whatever runtime serves the variants.
        reference = _ort_reference(fp32_path, evaluation)
        variants = []
        for prec in spec.precisions:
            variants.append(
                _build_variant(spec, prec, fp32_path, fp32_sha, sig, evaluation, calibration, calib_digest,
                               reference, key, options, staging, work, inputs_record)
            )
    return ModelResult(spec.name, "built", key, variants, slim_report, time.perf_counter() - started)


def rebuild_reasons(spec: ModelSpec, repository: Path, wanted: dict[str, Any]) -> list[str]:
    """Why a model's variants are rebuilt, from what their build records say they were built from."""
    labels = {"onnx": "exported ONNX", "evaluation": "evaluation data", "calibration": "calibration data",
              "spec": "models.toml entry", "runtime": "runtime", "serving_backend": "serving backend",
              "recipe": "build recipe", "tools": "tool versions"}
    reasons: list[str] = []
    for prec in spec.precisions:
        record = read_record(repository / variant_name(spec.name, prec))
        if record is None:
            reasons.append(f"{variant_name(spec.name, prec)} not built yet")
            continue
        present = record.get("inputs", {})
        for key, label in labels.items():
            if present.get(key) != wanted.get(key):
                old, new = present.get(key), wanted.get(key)
                if isinstance(old, dict) and isinstance(new, dict):
                    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
                    detail = ", ".join(f"{k} {old.get(k)} -> {new.get(k)}" for k in changed)
                    reasons.append(f"{label} changed ({detail})")
                else:
                    reasons.append(f"{label} changed")
    return sorted(set(reasons)) or ["--force"]


def _carry_plans(previous: Path, version_dir: Path, variant_sha: str) -> None:
    """Keep plans built on other GPU types for the same variant ONNX (cc_model_filenames)."""
    from builder.tensorrt_plan import PlanMetadata

    if not previous.is_dir():
        return
    for plan in previous.glob("model.sm*.plan"):
        meta_file = plan.with_name(plan.name + ".json")
        try:
            meta = PlanMetadata.from_json(json.loads(meta_file.read_text()))
        except (OSError, ValueError):
            continue
        if meta is not None and meta.onnx_sha256 == variant_sha:
            shutil.copy2(plan, version_dir / plan.name)
            shutil.copy2(meta_file, version_dir / meta_file.name)


def _config_inputs(spec: ModelSpec, name: str, sig: onnx_model.Signature, options: BuildOptions,
                   version_dir: Path) -> triton_config.ConfigInputs:
    from builder.tensorrt_plan import cc_model_filenames, profile_shapes, warmup_inputs

    backend = options.runtime.triton_backend or options.serving_backend
    if backend != "tensorrt":
        return triton_config.ConfigInputs(
            name=name, inputs=sig.inputs, outputs=sig.outputs, batch=spec.batch, serving=spec.serving,
            backend=backend, artifact=options.runtime.artifact, instance_kind=options.runtime.instance_kind,
        )
    profile = profile_shapes(sig.inputs, spec.batch, spec.dims)
    # Never accept a batch the engine's profile cannot run.
    batch = replace(spec.batch, max=min(spec.batch.max, profile.max_batch))
    trt_options = getattr(options.runtime, "options", None)
    return triton_config.ConfigInputs(
        name=name, inputs=sig.inputs, outputs=sig.outputs, batch=batch, serving=spec.serving,
        backend="tensorrt", artifact=options.runtime.artifact, instance_kind="KIND_GPU",
        cuda_graphs=bool(getattr(trt_options, "cuda_graphs", False)),
        warmup=tuple(warmup_inputs(sig.inputs, profile)) if getattr(trt_options, "warmup", True) else (),
        cc_model_filenames=tuple(cc_model_filenames([p.name for p in version_dir.iterdir()]).items()),
    )


def _guard_int8(
    spec: ModelSpec, fp32_path: Path, fp32_sha: str, calibration: data_mod.Samples, calib_digest: str,
    variant_onnx: Path, evaluation: data_mod.Samples, reference: dict[str, NDArray[Any]], tolerance: Tolerance,
    options: BuildOptions, work: Path,
) -> dict[str, Any]:
    """Replace variant_onnx by the guarded INT8 mix, or by FP16 when none meets the tolerance."""
    from builder import guard

    assert spec.calibration is not None
    plain = work / "int8_plain.onnx"
    shutil.copyfile(variant_onnx, plain)
    search_dir = work / "guard"
    search_dir.mkdir(exist_ok=True)
    quantize = guard.make_quantizer(fp32_path, fp32_sha, calibration, calib_digest, options.cache_dir)
    result, guarded = guard.guard(quantize, spec.calibration, plain, evaluation, reference, spec.task, tolerance,
                                  search_dir)
    if guarded is not None:
        shutil.copyfile(guarded, variant_onnx)
        fallback = None
    else:
        precision.to_fp16(fp32_path, variant_onnx)
        fallback = "fp16"
        log.warning("%s_int8: no INT8 mix meets the tolerance; serving the FP16 model under this name", spec.name)
    top = sorted(result.sensitivity.items(), key=lambda kv: kv[1], reverse=True)[:10]
    return {
        "excluded": result.excluded,
        "fallback": fallback,
        "before": result.before,
        "after": result.after,
        "quantizations": result.quantizations,
        "search": result.searched,
        "most_sensitive": [{"node": n, "damage": d} for n, d in top],
        "seconds": round(result.seconds, 2),
        "size_bytes": {"fp32": fp32_path.stat().st_size, "int8_plain": plain.stat().st_size,
                       "int8_guarded": variant_onnx.stat().st_size},
        "throughput_b1_cpu": {"fp32": guard.throughput(fp32_path, evaluation),
                              "int8_plain": guard.throughput(plain, evaluation),
                              "int8_guarded": guard.throughput(variant_onnx, evaluation)},
    }


def _ort_reference(fp32_path: Path, evaluation: data_mod.Samples) -> dict[str, NDArray[Any]]:
    from builder.runtimes import ort_session, run_session

    return run_session(ort_session(fp32_path), evaluation, _EVAL_BATCH)


def _build_variant(
    spec: ModelSpec,
    prec: str,
    fp32_path: Path,
    fp32_sha: str,
    sig: onnx_model.Signature,
    evaluation: data_mod.Samples,
    calibration: data_mod.Samples | None,
    calib_digest: str | None,
    reference: dict[str, NDArray[Any]],
    key: str,
    options: BuildOptions,
    staging: Staging,
    work: Path,
    inputs_record: dict[str, Any],
) -> VariantResult:
    started = time.perf_counter()
    name = variant_name(spec.name, prec)
    variant_onnx = work / f"{prec}.onnx"
    calibration_info: dict[str, object] | None = None
    settings: dict[str, object]
    if prec == "fp32":
        shutil.copyfile(fp32_path, variant_onnx)
        settings = {}
    elif prec == "fp16":
        settings = precision.to_fp16(fp32_path, variant_onnx)
    else:
        assert spec.calibration is not None and calibration is not None and calib_digest is not None
        result = precision.to_int8(fp32_path, fp32_sha, calibration, calib_digest, spec.calibration,
                                   variant_onnx, options.cache_dir)
        settings = result.settings
        calibration_info = {**result.settings, "cache_key": result.cache_key, "cached": result.cached}
    out_dir = staging.dir(name)
    version_dir = out_dir / "1"
    version_dir.mkdir()
    artifact = version_dir / options.runtime.artifact

    def compile_and_compare() -> tuple[str, accuracy.Metrics]:
        """Compile the current variant ONNX and measure the artifact against the FP32 reference."""
        sha = onnx_model.sha256_file(variant_onnx)
        options.runtime.compile(variant_onnx, artifact, CompileTarget(sig.inputs, spec.batch, dict(spec.dims), sha))
        return sha, accuracy.compare(reference, options.runtime.run(artifact, evaluation, _EVAL_BATCH), spec.task)

    _carry_plans(options.repository / name / "1", version_dir, onnx_model.sha256_file(variant_onnx))
    variant_sha, metrics = compile_and_compare()
    tolerance = spec.tolerances.get(prec, DEFAULT_TOLERANCES[prec])
    log.info("%s: %s", name, ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
    guard_report = None
    try:
        accuracy.check(metrics, tolerance, name)
    except AccuracyError as exc:
        # An explicit INT8 tolerance in models.toml means "guarded": search for a mix that meets it.
        if prec != "int8" or "int8" not in spec.tolerances:
            raise
        assert spec.calibration is not None and calibration is not None and calib_digest is not None
        log.warning("%s; searching for nodes to keep in higher precision", exc)
        guard_report = _guard_int8(spec, fp32_path, fp32_sha, calibration, calib_digest, variant_onnx, evaluation,
                                   reference, tolerance, options, work)
        variant_sha, metrics = compile_and_compare()  # the guarded mix (or FP16) replaced the plain INT8
        accuracy.check(metrics, tolerance, name)
        if calibration_info is not None:
            calibration_info["nodes_kept_in_higher_precision"] = guard_report["excluded"]

    config = triton_config.build(_config_inputs(spec, name, sig, options, version_dir))
    (out_dir / "config.pbtxt").write_text(triton_config.to_text(config), encoding="utf-8")
    if config.backend == "python":
        source = resources.files("builder").joinpath("triton_python_model.py").read_text(encoding="utf-8")
        (version_dir / "model.py").write_text(source, encoding="utf-8")
    variant = VariantResult(
        name=name,
        precision=prec,
        runtime=options.runtime.name,
        artifact=str(Path(name) / "1" / options.runtime.artifact),
        sha256=onnx_model.sha256_file(artifact),
        size_bytes=artifact.stat().st_size,
        accuracy=metrics,
        tolerance=asdict(tolerance),
        build_seconds=round(time.perf_counter() - started, 3),
        calibration=calibration_info,
        guard=guard_report,
    )
    write_json(out_dir / RECORD, {
        "build_key": key,
        "model": spec.name,
        "source": spec.source or str(spec.onnx),
        "fp32_onnx_sha256": fp32_sha,
        "precision_settings": settings,
        "variant_onnx_sha256": variant_sha,
        "inputs": inputs_record,
        "tools": inputs_record["tools"],
        **asdict(variant),
    })
    return variant


def build_all(
    specs: list[ModelSpec], options: BuildOptions, report_path: Path | None, command: list[str]
) -> list[ModelResult]:
    """Build every model; commit to the repository only if all of them passed."""
    started = time.time()
    staging = Staging(options.repository)
    results: list[ModelResult] = []
    try:
        for spec in specs:
            results.append(build_model(spec, options, staging))
        staging.commit()
    finally:
        staging.discard()
    if report_path is not None:
        write_json(report_path, {
            "command": command,
            "started_unix": started,
            "seconds": round(time.time() - started, 3),
            "repository": str(options.repository),
            "runtime": options.runtime.name,
            "tools": tool_versions(),
            "models": [asdict(r) for r in results],
        })
    return results
