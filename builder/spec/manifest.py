"""models.toml → validated, typed model specifications.

The file is checked whole before anything is built: its schema (`builder.spec.schema`, pydantic) and
then each model's cross-key rules (`ModelSpec.problems`). Every error found is one line naming the
file and the key path (`models.toml: model[0].serving.max_queue_delay: unknown key; did you mean
max_queue_delay_us?`); all of them travel in one ManifestError. Each [[model]] table goes through
`model_entry`, as the table `trtbuild build`'s flags stand for does (`builder.spec.flags`, by `model_spec`);
only the names in the lines differ (`builder.spec.schema.Keys`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from builder.errors import ManifestError
from builder.spec.enums import Precision
from builder.spec.model import (
    CalibrationSpec,
    DataSpec,
    DimRange,
    ModelSpec,
    ServingSpec,
    TensorSpec,
    Tolerance,
)
from builder.spec.schema import (
    DataTable,
    DimTable,
    Keys,
    ManifestFile,
    ModelTable,
    TomlKeys,
    error_lines,
    toml_value,
)
from builder.spec.shapes import DEFAULT_BATCH, ShapeRange, ValueRange

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def parse_precisions(value: str | Sequence[str], what: str) -> tuple[Precision, ...]:
    """A comma-separated string (a CLI flag) or a list; FP32 first, duplicates dropped."""
    if isinstance(value, str):
        items: list[object] = [p.strip() for p in value.split(",") if p.strip()]
    elif isinstance(value, Sequence):
        items = list(value)
    else:
        raise ManifestError(f"{what}: expected a list of {', '.join(Precision.values())}, got {value!r}")
    if not items:
        raise ManifestError(f"{what}: expected at least one of {', '.join(Precision.values())}")
    return _ordered([Precision.parse(p, f"{what}: unknown precision", error=ManifestError) for p in items])


def load_manifest(path: Path, base_dir: Path | None = None) -> list[ModelSpec]:
    """Read and validate models.toml. Relative file paths resolve against the manifest's folder
    (or `base_dir`). Raises one ManifestError holding every error of the file, one line each."""
    if not path.is_file():
        raise ManifestError(f"{path}: manifest not found")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: not valid TOML ({exc})") from exc
    # (model index or -1 for the file's own keys, line): reported grouped by model, schema errors first.
    errors: list[tuple[int, str]] = []
    try:
        ManifestFile.model_validate(raw)
    except ValidationError as exc:
        # The file's own keys here; each [[model]] table is checked (and reported) by model_entry below.
        errors += [(-1, line) for loc, line in error_lines(exc) if _model_index(loc) < 0]
    base = base_dir or path.parent
    models = raw.get("model")
    specs = []
    for i, entry in enumerate(models if isinstance(models, list) else []):
        spec, lines = model_entry(entry, base=base, keys=TomlKeys(("model", i)))
        errors += [(i, line) for line in lines]
        if spec is not None:
            specs.append(spec)
    first: dict[str, int] = {}
    for i, entry in enumerate(models if isinstance(models, list) else []):
        name = entry.get("name") if isinstance(entry, dict) else None
        if isinstance(name, str) and name in first:
            errors.append((i, f"model[{i}].name: duplicate model name {toml_value(name)} (also model[{first[name]}])"))
        elif isinstance(name, str):
            first[name] = i
    if errors:
        errors.sort(key=lambda error: error[0])  # stable: keeps each model's own order
        raise ManifestError("\n".join(f"{path}: {line}" for _, line in errors))
    return specs


def model_entry(entry: object, *, base: Path, keys: Keys) -> tuple[ModelSpec | None, list[str]]:
    """One [[model]] table, as TOML reads it, → its spec and every error of it, one line each, named by `keys`:
    the schema's errors, else the cross-key rules' (the spec is None when the schema refused the table)."""
    try:
        table = ModelTable.model_validate(entry)
    except ValidationError as exc:
        return None, [line for _, line in error_lines(exc, keys.at, inside=("model", 0))]
    spec = _to_spec(table, base)
    return spec, [f"{keys.at(loc)}: {what}" for loc, what in spec.problems(keys)]


def model_spec(entry: object, *, base: Path, keys: Keys) -> ModelSpec:
    """One [[model]] table → its spec, or ManifestError with every error of it, one line each."""
    spec, lines = model_entry(entry, base=base, keys=keys)
    if lines or spec is None:
        raise ManifestError("\n".join(lines))
    return spec


def _model_index(loc: tuple[str | int, ...]) -> int:
    return loc[1] if len(loc) > 1 and loc[0] == "model" and isinstance(loc[1], int) else -1


def _to_spec(table: ModelTable, base: Path) -> ModelSpec:
    return ModelSpec(
        name=table.name,
        source=table.source,
        onnx=(base / table.onnx) if table.onnx is not None else None,
        task=table.task,
        inputs=tuple(TensorSpec(name=t.name, dtype=t.dtype, shape=tuple(t.shape)) for t in table.inputs),
        outputs=tuple(table.outputs),
        batch=_dim_range(table.batch) if table.batch is not None else DEFAULT_BATCH,
        batch_given=table.batch is not None,
        shapes={name: ShapeRange(tuple(r.min or r.opt), tuple(r.opt), tuple(r.max or r.opt), f"shapes.{name}")
                for name, r in table.shapes.items()},
        input_ranges={name: ValueRange(low, high) for name, (low, high) in table.input_ranges.items()},
        no_batch=table.no_batch,
        dims={name: _dim_range(dims) for name, dims in table.dims.items()},
        precisions=_ordered(table.precisions),
        calibration=None if table.calibration is None else CalibrationSpec(
            data=_data(table.calibration, base),
            method=table.calibration.method,
            recipe=table.calibration.recipe,
            op_types_to_quantize=tuple(table.calibration.op_types_to_quantize),
            nodes_to_exclude=tuple(table.calibration.nodes_to_exclude),
        ),
        evaluation=None if table.evaluation is None else _data(table.evaluation, base),
        tolerances={Precision(key): Tolerance(**limits.model_dump())
                    for key, limits in table.tolerances if limits is not None},
        serving=ServingSpec(**table.serving.model_dump()),
        opset=table.opset,
    )


def _dim_range(table: DimTable) -> DimRange:
    return DimRange(table.min, table.opt, table.max)


def _data(table: DataTable, base: Path) -> DataSpec:
    source = str(base / table.source) if table.source.endswith(".npz") else table.source
    return DataSpec(source=source, samples=table.samples, seed=table.seed)


def _ordered(precisions: Sequence[Precision]) -> tuple[Precision, ...]:
    """FP32 first (the reference every variant is checked against), duplicates dropped."""
    order = list(Precision)
    return tuple(sorted(dict.fromkeys(precisions), key=order.index))

