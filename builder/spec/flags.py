"""`trtbuild build`'s model flags as a models.toml [[model]] table, checked by models.toml's own schema and rules.

The flags are parsed here for their syntax only (`NAME:DxD`, `NAME=MIN:OPT:MAX`, `NAME:LOW:HIGH`, commas) and
for what a table cannot hold (one input given twice, `--shapes` beside `--min-shapes`); what the values may be
is said once, by `builder.spec.manifest.model_spec`. So a bad value gets the line models.toml gets, with the
flag in place of the key: `--min-shapes/--opt-shapes x: axis 0 has min 4, …` where models.toml says
`model[0].shapes.x: axis 0 has min 4, …`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from builder.errors import ManifestError
from builder.spec.keys import Loc, key_path
from builder.spec.manifest import model_spec
from builder.spec.model import ModelSpec
from builder.spec.names import name_from_path
from builder.spec.shapes import Shape, parse_shapes, parse_value_range

CALIBRATION_SAMPLES = 512  # --calibration-samples' default (models.toml's is the schema's, 64)
EVAL_SAMPLES = 1 << 20  # --eval-data FILE.npz: every sample of the file (a module:function: the schema's default)


@dataclass(frozen=True)
class BuildFlags:
    """The model flags of `trtbuild build` as argparse leaves them (each field is its flag's dest)."""

    onnx: Path
    name: str | None = None
    precision: str | None = None  # comma-separated
    calibration: Path | None = None
    calibration_method: str | None = None
    calibration_samples: int | None = None
    int8_recipe: str | None = None
    eval_data: Path | None = None
    max_batch: int | None = None
    dim: Sequence[str] = ()  # NAME=MIN:OPT:MAX each
    shapes: Sequence[str] = ()  # NAME:DxD[,NAME:DxD...] each, for the four shape flags
    min_shapes: Sequence[str] = ()
    opt_shapes: Sequence[str] = ()
    max_shapes: Sequence[str] = ()
    input_range: Sequence[str] = ()  # NAME:LOW:HIGH each
    no_batch: bool = False
    task: str = "generic"


# The flag that fills each key of the table; keys per input, per dim and calibration's are named in FlagKeys.at.
_FLAGS = {"name": "--name", "onnx": "--onnx", "precisions": "--precision", "task": "--task", "batch": "--max-batch",
          "no_batch": "--no-batch", "evaluation": "--eval-data", "calibration": "--calibration"}
_CALIBRATION = {"source": "--calibration", "samples": "--calibration-samples", "method": "--calibration-method",
                "recipe": "--int8-recipe"}
_RANGE_FLAGS = {"--min-shapes": "min", "--opt-shapes": "opt", "--max-shapes": "max"}


@dataclass(frozen=True)
class FlagKeys:
    """The flags' names for a [[model]] table's keys (`builder.spec.schema.Keys`). `shapes`: the flags that
    gave each input's shape (`--shapes`, or those of `--min-shapes/--opt-shapes/--max-shapes` given)."""

    shapes: Mapping[str, str] = field(default_factory=dict)

    def at(self, loc: Loc) -> str:
        head, rest = (str(loc[0]), loc[1:]) if loc else ("", ())
        if head == "shapes" and rest:
            name, part, axis = rest[0], rest[1:2], rest[2:]
            given = self.shapes.get(str(name), "--shapes")
            # A fixed shape is stored as the range's opt: the flag is still --shapes.
            flag = f"--{part[0]}-shapes" if part and given != "--shapes" else given
            return f"{flag} {name}" + (f" axis {axis[0]}" if axis else "")
        if head == "dims" and rest:
            return f"--dim {rest[0]}" + (f" ({rest[1]})" if len(rest) > 1 else "")
        if head == "input_ranges" and rest:
            return f"--input-range {rest[0]}"
        if head == "calibration" and rest and str(rest[0]) in _CALIBRATION:
            return _CALIBRATION[str(rest[0])]
        return _FLAGS.get(head, key_path(loc))

    def give(self, loc: Loc) -> str:
        if loc == ("calibration",):
            return "--calibration FILE.npz"
        if len(loc) == 2 and loc[0] == "dims":
            return f"--dim {loc[1]}=MIN:OPT:MAX"
        if len(loc) == 2 and loc[0] == "shapes":
            return f"--shapes {loc[1]}:DxD…"
        return self.at(loc)


def model_table(flags: BuildFlags) -> tuple[dict[str, Any], FlagKeys]:
    """The [[model]] table the flags stand for (as TOML would read it), and the flags' names for its keys.
    Raises ManifestError for flag syntax, and for what a table cannot hold."""
    if flags.calibration is None:
        alone = [flag for flag, value in (("--calibration-method", flags.calibration_method),
                                          ("--calibration-samples", flags.calibration_samples),
                                          ("--int8-recipe", flags.int8_recipe)) if value is not None]
        if alone:  # they would be dropped without a word: there is nothing to calibrate on
            raise ManifestError(f"{'/'.join(alone)}: only with --calibration FILE.npz")
    precisions = flags.precision or ("fp32,fp16,int8" if flags.calibration is not None else "fp32,fp16")
    shapes, sources = _shape_tables(flags)
    table: dict[str, Any] = {
        "name": flags.name if flags.name is not None else name_from_path(str(flags.onnx)),
        "onnx": str(flags.onnx),
        "task": flags.task,
        "precisions": [p.strip() for p in precisions.split(",") if p.strip()],
        "dims": _dims(flags.dim),
        "shapes": shapes,
        "input_ranges": {name: [low, high] for name, low, high in
                         (parse_value_range(value, "--input-range") for value in flags.input_range)},
        "no_batch": flags.no_batch,
    }
    if flags.max_batch is not None:  # absent: the shapes' axis 0, else the default range, may give the batch
        table["batch"] = [1, max(1, flags.max_batch // 2), flags.max_batch]
    if flags.calibration is not None:
        table["calibration"] = {
            "source": str(flags.calibration),
            "samples": CALIBRATION_SAMPLES if flags.calibration_samples is None else flags.calibration_samples,
            "method": "entropy" if flags.calibration_method is None else flags.calibration_method,
            **({} if flags.int8_recipe is None else {"recipe": flags.int8_recipe}),
        }
    if flags.eval_data is not None:
        source = str(flags.eval_data)
        table["evaluation"] = {"source": source, **({"samples": EVAL_SAMPLES} if source.endswith(".npz") else {})}
    return table, FlagKeys(sources)


def spec_from_flags(flags: BuildFlags) -> ModelSpec:
    """The flags' spec, through models.toml's schema and rules; ManifestError naming the flags otherwise,
    one line per error. Relative paths stay relative to the working directory."""
    table, keys = model_table(flags)
    spec = model_spec(table, base=Path(), keys=keys)
    # Each shape keeps the flags that gave it: later lines (against the graph) name them, and build keys
    # recorded by earlier builds hold them.
    return replace(spec, shapes={name: replace(rng, source=keys.shapes[name]) for name, rng in spec.shapes.items()})


def _dims(values: Sequence[str]) -> dict[str, list[int]]:
    dims = {}
    for value in values:
        name, sep, rng = value.partition("=")
        parts = rng.split(":")
        if not sep or not name or len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ManifestError(f"--dim {value!r}: expected NAME=MIN:OPT:MAX with integers")
        dims[name] = [int(p) for p in parts]
    return dims


def _shape_tables(flags: BuildFlags) -> tuple[dict[str, Any], dict[str, str]]:
    """models.toml's `shapes` table from the four shape flags (a list: fixed; a table of those of min, opt, max
    given: trtexec's rule that a missing min or max is the opt is the table's too), and which flags gave each."""
    given = {flag: _per_input(values, flag) for flag, values in (
        ("--shapes", flags.shapes), ("--min-shapes", flags.min_shapes), ("--opt-shapes", flags.opt_shapes),
        ("--max-shapes", flags.max_shapes))}
    tables: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name in dict.fromkeys(name for by_input in given.values() for name in by_input):
        ranged = [flag for flag in _RANGE_FLAGS if name in given[flag]]
        if name in given["--shapes"]:
            if ranged:
                raise ManifestError(f"--shapes {name}: also given by {', '.join(ranged)}; "
                                    "expected either --shapes or min/opt/max shapes for one input")
            tables[name] = list(given["--shapes"][name])
            sources[name] = "--shapes"
        else:
            tables[name] = {_RANGE_FLAGS[flag]: list(given[flag][name]) for flag in ranged}
            sources[name] = "/".join(ranged)
    return tables, sources


def _per_input(values: Sequence[str], flag: str) -> dict[str, Shape]:
    found: dict[str, Shape] = {}
    for value in values:  # a repeated flag adds inputs
        for name, shape in parse_shapes(value, flag).items():
            if name in found:
                raise ManifestError(f"{flag}: input {name!r} is given twice")
            found[name] = shape
    return found
