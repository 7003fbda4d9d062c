"""models.toml → validated, typed model specifications.

Every error names the file, the model and the key, and says what was expected.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from builder.errors import ManifestError
from builder.spec.dtypes import check_dtype
from builder.spec.enums import CalibrationMethod, Int8Recipe, Precision, Task
from builder.spec.model import (
    CalibrationSpec,
    DataSpec,
    DimRange,
    ModelSpec,
    ServingSpec,
    TensorSpec,
    Tolerance,
)
from builder.spec.names import check_model_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_METRICS = ("max_abs", "max_rel", "cosine_min", "cosine_mean_min", "top1_agreement_min")
_MODEL_KEYS = ("name", "source", "onnx", "task", "inputs", "outputs", "batch", "dims", "precisions",
               "calibration", "evaluation", "tolerances", "serving", "opset")
_CALIBRATION_KEYS = ("source", "samples", "seed", "method", "recipe", "op_types_to_quantize", "nodes_to_exclude")
_DATA_KEYS = ("source", "samples", "seed")
_SERVING_KEYS = ("instances", "dynamic_batching", "max_queue_delay_us", "ort_intra_op_threads")


def parse_precisions(value: str | Sequence[str], what: str) -> tuple[Precision, ...]:
    """A comma-separated string (CLI) or a list (models.toml); FP32 first, duplicates dropped."""
    if isinstance(value, str):
        items: list[object] = [p.strip() for p in value.split(",") if p.strip()]
    elif isinstance(value, Sequence):
        items = list(value)
    else:
        raise ManifestError(f"{what}: expected a list of {', '.join(Precision.values())}, got {value!r}")
    if not items:
        raise ManifestError(f"{what}: expected at least one of {', '.join(Precision.values())}")
    parsed = [Precision.parse(p, f"{what}: unknown precision", error=ManifestError) for p in items]
    order = list(Precision)
    # fp32 is the reference every variant is checked against, so order it first.
    return tuple(sorted(dict.fromkeys(parsed), key=order.index))


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
    name = check_model_name(entry.get("name"), f"{where}: name")
    what = f"{where} ({name})"
    _known(entry, _MODEL_KEYS, what)
    onnx_path = entry.get("onnx")
    if onnx_path is not None and not isinstance(onnx_path, str):
        raise ManifestError(f"{what}: onnx must be a file path (a string), got {onnx_path!r}")
    source = entry.get("source")
    if source is not None and not isinstance(source, str):
        raise ManifestError(f"{what}: source must be module:function (a string), got {source!r}")
    dims = {str(k): parse_dim_range(v, f"{what}: dims.{k}") for k, v in _table(entry, "dims", what).items()}
    tolerances = {
        Precision.parse(key, f"{what}: tolerances table", error=ManifestError):
            _parse_tolerance(table, f"{what}: tolerances.{key}")
        for key, table in _table(entry, "tolerances", what).items()
    }
    spec = ModelSpec(
        name=name,
        source=source,
        onnx=(base / onnx_path) if onnx_path is not None else None,
        task=Task.parse(entry.get("task", "generic"), f"{what}: task", error=ManifestError),
        inputs=tuple(_parse_input(t, f"{what}: inputs[{i}]")
                     for i, t in enumerate(_list(entry, "inputs", what))),
        outputs=tuple(_strings(entry, "outputs", what)),
        batch=parse_dim_range(entry.get("batch"), f"{what}: batch"),
        dims=dims,
        precisions=parse_precisions(entry.get("precisions", ["fp32"]), f"{what}: precisions"),
        calibration=_parse_calibration(entry, base, what) if "calibration" in entry else None,
        evaluation=(_parse_data(_table(entry, "evaluation", what), _DATA_KEYS, base, f"{what}: evaluation")
                    if "evaluation" in entry else None),
        tolerances=tolerances,
        serving=_parse_serving(_table(entry, "serving", what), f"{what}: serving"),
        opset=_integer(entry.get("opset", 17), f"{what}: opset", low=1),
    )
    try:
        return spec.check()
    except ManifestError as exc:
        raise ManifestError(f"{where}: {exc}") from None


def _parse_calibration(entry: Mapping[str, Any], base: Path, what: str) -> CalibrationSpec:
    cal = _table(entry, "calibration", what)
    return CalibrationSpec(
        data=_parse_data(cal, _CALIBRATION_KEYS, base, f"{what}: calibration"),
        method=CalibrationMethod.parse(cal.get("method", "entropy"), f"{what}: calibration.method",
                                       error=ManifestError),
        recipe=Int8Recipe.parse(cal.get("recipe", "modelopt"), f"{what}: calibration.recipe", error=ManifestError),
        op_types_to_quantize=tuple(_strings(cal, "op_types_to_quantize", f"{what}: calibration")),
        nodes_to_exclude=tuple(_strings(cal, "nodes_to_exclude", f"{what}: calibration")),
    )


def _parse_serving(raw: Mapping[str, Any], what: str) -> ServingSpec:
    _known(raw, _SERVING_KEYS, what)
    batching = raw.get("dynamic_batching", True)
    if not isinstance(batching, bool):
        raise ManifestError(f"{what}.dynamic_batching: expected true or false, got {batching!r}")
    return ServingSpec(
        instances=_integer(raw.get("instances", 1), f"{what}.instances", low=1),
        dynamic_batching=batching,
        max_queue_delay_us=_integer(raw.get("max_queue_delay_us", 0), f"{what}.max_queue_delay_us", low=0),
        ort_intra_op_threads=_integer(raw.get("ort_intra_op_threads", 0), f"{what}.ort_intra_op_threads", low=0),
    )


def _parse_input(raw: Any, what: str) -> TensorSpec:
    if not isinstance(raw, Mapping):
        raise ManifestError(f"{what}: expected a table with name, dtype, shape")
    _known(raw, ("name", "dtype", "shape"), what)
    shape = raw.get("shape")
    if not isinstance(shape, list) or not shape or not all(
        isinstance(d, str) or (isinstance(d, int) and not isinstance(d, bool)) for d in shape
    ):
        raise ManifestError(f"{what}: shape must be a list like [-1, 3, 224, 224] or [-1, \"seq\"]")
    name = raw.get("name")
    dtype = raw.get("dtype")
    if not isinstance(name, str) or not name:
        raise ManifestError(f"{what}: missing or invalid 'name' (expected a string)")
    if not isinstance(dtype, str):
        raise ManifestError(f"{what}: missing or invalid 'dtype' (expected a string)")
    return TensorSpec(name=name, dtype=check_dtype(dtype, f"{what}: dtype"), shape=tuple(shape))


def _parse_data(raw: Mapping[str, Any], keys: tuple[str, ...], base: Path, what: str) -> DataSpec:
    _known(raw, keys, what)
    source = raw.get("source")
    if not isinstance(source, str):
        raise ManifestError(f"{what}: missing or invalid 'source' (expected module:function or a .npz file)")
    if source.endswith(".npz"):
        source = str(base / source)
    elif ":" not in source:
        raise ManifestError(f"{what}: source {source!r}; expected module:function or a .npz file")
    return DataSpec(
        source=source,
        samples=_integer(raw.get("samples", 64), f"{what}.samples", low=1),
        seed=_integer(raw.get("seed", 0), f"{what}.seed", low=0),
    )


def _parse_tolerance(raw: Any, what: str) -> Tolerance:
    if not isinstance(raw, Mapping):
        raise ManifestError(f"{what}: expected a table of {', '.join(_METRICS)}")
    _known(raw, _METRICS, what)
    values: dict[str, float] = {}
    for key, value in raw.items():
        if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
            raise ManifestError(f"{what}.{key}: expected a non-negative number, got {value!r}")
        values[key] = float(value)
    return Tolerance(**values)


def _known(raw: Mapping[str, Any], keys: tuple[str, ...], what: str) -> None:
    unknown = sorted(set(raw) - set(keys))
    if unknown:
        raise ManifestError(f"{what}: unknown keys {', '.join(unknown)}; expected some of {', '.join(sorted(keys))}")


def _table(entry: Mapping[str, Any], key: str, what: str) -> Mapping[str, Any]:
    value = entry.get(key, {})
    if not isinstance(value, Mapping):
        raise ManifestError(f"{what}: {key} must be a table")
    return value


def _list(entry: Mapping[str, Any], key: str, what: str) -> list[Any]:
    value = entry.get(key, [])
    if not isinstance(value, list):
        raise ManifestError(f"{what}: {key} must be a list, got {value!r}")
    return value


def _strings(entry: Mapping[str, Any], key: str, what: str) -> list[str]:
    values = _list(entry, key, what)
    if not all(isinstance(v, str) and v for v in values):
        raise ManifestError(f"{what}: {key} must be a list of names, got {values!r}")
    return values


def _integer(value: Any, what: str, *, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        kind = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise ManifestError(f"{what}: expected {kind}, got {value!r}")
    return value
