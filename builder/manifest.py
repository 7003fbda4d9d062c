"""models.toml → validated, typed model specifications.

Every error names the file, the model and the key, and says what was expected.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builder.dtypes import check_dtype
from builder.errors import ManifestError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PRECISIONS = ("fp32", "fp16", "int8")
TASKS = ("classification", "embedding", "generic")
CALIBRATION_METHODS = ("entropy", "max")
# modelopt: symmetric INT8 Q/DQ for TensorRT; onnxruntime: per-channel U8S8 Q/DQ that ORT fuses on CPU.
INT8_RECIPES = ("modelopt", "onnxruntime")
_METRICS = ("max_abs", "max_rel", "cosine_min", "cosine_mean_min", "top1_agreement_min")


@dataclass(frozen=True)
class DimRange:
    """min/opt/max of one dynamic dimension (the batch, or e.g. a sequence length)."""

    min: int
    opt: int
    max: int

    def check(self, what: str) -> DimRange:
        if not (1 <= self.min <= self.opt <= self.max):
            raise ManifestError(
                f"{what}: expected 1 <= min <= opt <= max, got min={self.min} opt={self.opt} max={self.max}"
            )
        return self


@dataclass(frozen=True)
class TensorSpec:
    """An input: its name, dtype and shape; shape[0] is the batch axis, other dims are ints or names."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]

    @property
    def sample_shape(self) -> tuple[int | str, ...]:
        return self.shape[1:]


@dataclass(frozen=True)
class DataSpec:
    """Where samples come from: `module:function(count, seed)` or an `.npz` keyed by input name."""

    source: str
    samples: int
    seed: int = 0

    @property
    def is_file(self) -> bool:
        return self.source.endswith(".npz")


@dataclass(frozen=True)
class CalibrationSpec:
    data: DataSpec
    method: str = "entropy"
    recipe: str = "modelopt"
    op_types_to_quantize: tuple[str, ...] = ()
    nodes_to_exclude: tuple[str, ...] = ()
    nodes_to_quantize: tuple[str, ...] = ()  # set by the accuracy guard's per-node sensitivity runs


@dataclass(frozen=True)
class Tolerance:
    """Limits a variant must meet against the FP32 reference; None means not checked."""

    max_abs: float | None = None
    max_rel: float | None = None
    cosine_min: float | None = None
    cosine_mean_min: float | None = None
    top1_agreement_min: float | None = None


@dataclass(frozen=True)
class ServingSpec:
    instances: int = 1
    dynamic_batching: bool = True
    max_queue_delay_us: int = 0
    ort_intra_op_threads: int = 0


@dataclass(frozen=True)
class ModelSpec:
    name: str
    batch: DimRange
    precisions: tuple[str, ...]
    source: str | None = None
    onnx: Path | None = None
    task: str = "generic"
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[str, ...] = ()
    dims: Mapping[str, DimRange] = field(default_factory=dict)
    calibration: CalibrationSpec | None = None
    evaluation: DataSpec | None = None
    tolerances: Mapping[str, Tolerance] = field(default_factory=dict)
    serving: ServingSpec = ServingSpec()
    opset: int = 17

    def check(self) -> ModelSpec:
        what = f"model {self.name!r}"
        if (self.source is None) == (self.onnx is None):
            raise ManifestError(f"{what}: give exactly one of 'source' (module:function) or 'onnx' (a file)")
        if self.source is not None and not self.inputs:
            raise ManifestError(f"{what}: a 'source' model needs 'inputs' (name, dtype, shape)")
        if self.source is not None and ":" not in self.source:
            raise ManifestError(f"{what}: source {self.source!r} is not of the form module:function")
        for tensor in self.inputs:
            if tensor.shape and tensor.shape[0] != -1:
                raise ManifestError(f"{what}: input {tensor.name!r}: shape[0] must be -1 (the batch axis)")
            for dim in tensor.sample_shape:
                if isinstance(dim, str) and dim not in self.dims:
                    raise ManifestError(
                        f"{what}: input {tensor.name!r}: dynamic dim {dim!r} has no range; "
                        f"add dims.{dim} = [min, opt, max]"
                    )
                if isinstance(dim, int) and dim < 1:
                    raise ManifestError(
                        f"{what}: input {tensor.name!r}: non-batch dims must be >= 1 or a named range, got {dim}"
                    )
        if "int8" in self.precisions and self.calibration is None:
            raise ManifestError(f"{what}: precision int8 needs a [calibration] table")
        if self.opset < 17:
            raise ManifestError(f"{what}: opset must be >= 17, got {self.opset}")
        return self


def parse_precisions(value: str | Sequence[str], what: str) -> tuple[str, ...]:
    items = [p.strip() for p in value.split(",")] if isinstance(value, str) else [str(p) for p in value]
    items = [p for p in items if p]
    if not items:
        raise ManifestError(f"{what}: expected at least one of {', '.join(PRECISIONS)}")
    for precision in items:
        if precision not in PRECISIONS:
            raise ManifestError(
                f"{what}: unknown precision {precision!r}; expected one of {', '.join(PRECISIONS)}"
            )
    # fp32 is the reference every variant is checked against, so order it first.
    return tuple(sorted(dict.fromkeys(items), key=PRECISIONS.index))


def parse_dim_range(value: Any, what: str) -> DimRange:
    if isinstance(value, Mapping):
        value = [value.get("min"), value.get("opt"), value.get("max")]
    if (
        not isinstance(value, Sequence)
        or isinstance(value, str)
        or len(value) != 3
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise ManifestError(f"{what}: expected [min, opt, max] as three integers, got {value!r}")
    return DimRange(int(value[0]), int(value[1]), int(value[2])).check(what)


def load_manifest(path: Path, base_dir: Path | None = None) -> list[ModelSpec]:
    """Read and validate models.toml. Relative file paths resolve against the manifest's folder."""
    if not path.is_file():
        raise ManifestError(f"{path}: manifest not found")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: not valid TOML ({exc})") from exc
    models = raw.get("model")
    if not isinstance(models, list) or not models:
        raise ManifestError(f"{path}: expected at least one [[model]] table")
    base = base_dir or path.parent
    specs = [_parse_model(entry, base, f"{path}: model #{i + 1}") for i, entry in enumerate(models)]
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ManifestError(f"{path}: duplicate model names: {', '.join(duplicates)}")
    return specs


def _parse_model(entry: Any, base: Path, where: str) -> ModelSpec:
    if not isinstance(entry, Mapping):
        raise ManifestError(f"{where}: expected a table")
    name = _get(entry, "name", str, where)
    if not name.replace("_", "").replace("-", "").isalnum():
        raise ManifestError(f"{where}: name {name!r} may hold only letters, digits, '_' and '-'")
    what = f"{where} ({name})"
    known = {
        "name", "source", "onnx", "task", "inputs", "outputs", "batch", "dims", "precisions",
        "calibration", "evaluation", "tolerances", "serving", "opset",
    }
    unknown = sorted(set(entry) - known)
    if unknown:
        raise ManifestError(f"{what}: unknown keys {', '.join(unknown)}; expected some of {', '.join(sorted(known))}")
    task = entry.get("task", "generic")
    if task not in TASKS:
        raise ManifestError(f"{what}: task {task!r}; expected one of {', '.join(TASKS)}")
    onnx_path = entry.get("onnx")
    dims = {
        str(k): parse_dim_range(v, f"{what}: dims.{k}") for k, v in _table(entry, "dims", what).items()
    }
    tolerances = {}
    for precision, table in _table(entry, "tolerances", what).items():
        parse_precisions([precision], f"{what}: tolerances.{precision}")
        tolerances[precision] = _parse_tolerance(table, f"{what}: tolerances.{precision}")
    calibration = None
    if "calibration" in entry:
        cal = _table(entry, "calibration", what)
        method = cal.get("method", "entropy")
        if method not in CALIBRATION_METHODS:
            raise ManifestError(
                f"{what}: calibration.method {method!r}; expected one of {', '.join(CALIBRATION_METHODS)}"
            )
        recipe = cal.get("recipe", "modelopt")
        if recipe not in INT8_RECIPES:
            raise ManifestError(
                f"{what}: calibration.recipe {recipe!r}; expected one of {', '.join(INT8_RECIPES)}"
            )
        calibration = CalibrationSpec(
            data=_parse_data(cal, base, f"{what}: calibration"),
            method=method,
            recipe=recipe,
            op_types_to_quantize=tuple(cal.get("op_types_to_quantize", ())),
            nodes_to_exclude=tuple(cal.get("nodes_to_exclude", ())),
        )
    evaluation = (
        _parse_data(_table(entry, "evaluation", what), base, f"{what}: evaluation")
        if "evaluation" in entry
        else None
    )
    serving_raw = _table(entry, "serving", what)
    serving = ServingSpec(
        instances=_positive(serving_raw.get("instances", 1), f"{what}: serving.instances"),
        dynamic_batching=bool(serving_raw.get("dynamic_batching", True)),
        max_queue_delay_us=_non_negative(
            serving_raw.get("max_queue_delay_us", 0), f"{what}: serving.max_queue_delay_us"
        ),
        ort_intra_op_threads=_non_negative(
            serving_raw.get("ort_intra_op_threads", 0), f"{what}: serving.ort_intra_op_threads"
        ),
    )
    spec = ModelSpec(
        name=name,
        source=entry.get("source"),
        onnx=(base / onnx_path) if isinstance(onnx_path, str) else None,
        task=task,
        inputs=tuple(_parse_input(t, f"{what}: inputs[{i}]") for i, t in enumerate(entry.get("inputs", []))),
        outputs=tuple(str(o) for o in entry.get("outputs", [])),
        batch=parse_dim_range(entry.get("batch"), f"{what}: batch"),
        dims=dims,
        precisions=parse_precisions(entry.get("precisions", ["fp32"]), f"{what}: precisions"),
        calibration=calibration,
        evaluation=evaluation,
        tolerances=tolerances,
        serving=serving,
        opset=int(entry.get("opset", 17)),
    )
    try:
        return spec.check()
    except ManifestError as exc:
        raise ManifestError(f"{where}: {exc}") from None


def _parse_input(raw: Any, what: str) -> TensorSpec:
    if not isinstance(raw, Mapping):
        raise ManifestError(f"{what}: expected a table with name, dtype, shape")
    shape = raw.get("shape")
    if not isinstance(shape, list) or not shape or not all(isinstance(d, int | str) for d in shape):
        raise ManifestError(f"{what}: shape must be a list like [-1, 3, 224, 224] or [-1, \"seq\"]")
    return TensorSpec(
        name=_get(raw, "name", str, what),
        dtype=check_dtype(_get(raw, "dtype", str, what), f"{what}: dtype"),
        shape=tuple(shape),
    )


def _parse_data(raw: Mapping[str, Any], base: Path, what: str) -> DataSpec:
    source = _get(raw, "source", str, what)
    if source.endswith(".npz"):
        source = str(base / source)
    elif ":" not in source:
        raise ManifestError(f"{what}: source {source!r}; expected module:function or a .npz file")
    return DataSpec(
        source=source,
        samples=_positive(raw.get("samples", 64), f"{what}.samples"),
        seed=int(raw.get("seed", 0)),
    )


def _parse_tolerance(raw: Any, what: str) -> Tolerance:
    if not isinstance(raw, Mapping):
        raise ManifestError(f"{what}: expected a table of {', '.join(_METRICS)}")
    unknown = sorted(set(raw) - set(_METRICS))
    if unknown:
        raise ManifestError(f"{what}: unknown metrics {', '.join(unknown)}; expected some of {', '.join(_METRICS)}")
    values: dict[str, float] = {}
    for key, value in raw.items():
        if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
            raise ManifestError(f"{what}.{key}: expected a non-negative number, got {value!r}")
        values[key] = float(value)
    return Tolerance(**values)


def _table(entry: Mapping[str, Any], key: str, what: str) -> Mapping[str, Any]:
    value = entry.get(key, {})
    if not isinstance(value, Mapping):
        raise ManifestError(f"{what}: {key} must be a table")
    return value


def _get(entry: Mapping[str, Any], key: str, kind: type, what: str) -> Any:
    value = entry.get(key)
    if not isinstance(value, kind):
        raise ManifestError(f"{what}: missing or invalid {key!r} (expected {kind.__name__})")
    return value


def _positive(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ManifestError(f"{what}: expected a positive integer, got {value!r}")
    return value


def _non_negative(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ManifestError(f"{what}: expected a non-negative integer, got {value!r}")
    return value
