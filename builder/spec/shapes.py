"""Shapes per input, the trtexec way, and how a model's inputs resolve to one range each.

A user gives `--min-shapes/--opt-shapes/--max-shapes NAME:DxDxD[,NAME:DxDxD…]` or `--shapes` (fixed), or
named dim ranges (`--dim NAME=MIN:OPT:MAX`, the shorthand); `resolve()` turns those and the graph's
inputs into a `ModelShapes`: one full min/opt/max shape per input and whether the model batches on
axis 0. Every consumer (samples, the TensorRT profile, config.pbtxt, verify) reads that one object.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from builder.errors import ManifestError
from common.choices import Choice

if TYPE_CHECKING:
    from builder.spec.model import ModelSpec, TensorSpec

Shape = tuple[int, ...]


class Level(Choice):
    MIN = "min"
    OPT = "opt"
    MAX = "max"


@dataclass(frozen=True)
class DimRange:
    """min/opt/max of one dynamic dimension (the batch, or e.g. a sequence length)."""

    min: int
    opt: int
    max: int


# When neither a batch range nor shapes say otherwise (`trtbuild build` without --max-batch: 1, 8, 16).
DEFAULT_BATCH = DimRange(1, 8, 16)


@dataclass(frozen=True)
class ShapeRange:
    """min/opt/max of one input's whole shape (its batch axis included for a batching model).
    `source` names where it was given (`--shapes`, `shapes.x`) for error lines."""

    min: Shape
    opt: Shape
    max: Shape
    source: str = field(default="shapes", compare=False)

    @staticmethod
    def fixed(shape: Shape, source: str = "--shapes") -> ShapeRange:
        return ShapeRange(shape, shape, shape, source)

    def where(self, name: str) -> str:
        """`--shapes x`, or `shapes.x` where the source (a models.toml key) already names the input."""
        return self.source if self.source.endswith(f".{name}") else f"{self.source} {name}"

    def at(self, level: Level) -> Shape:
        return {Level.MIN: self.min, Level.OPT: self.opt, Level.MAX: self.max}[level]

    def drop_first(self) -> ShapeRange:
        return ShapeRange(self.min[1:], self.opt[1:], self.max[1:], self.source)

    def to_json(self) -> dict[str, list[int]]:
        return {"min": list(self.min), "opt": list(self.opt), "max": list(self.max)}


@dataclass(frozen=True)
class ValueRange:
    """Values of synthetic samples for one input: integers LOW..HIGH inclusive (floats uniform)."""

    low: int
    high: int


def format_shape(shape: Sequence[int | str]) -> str:
    """1x3x224x224; a scalar is `[]`."""
    return "x".join(str(d) for d in shape) if shape else "[]"


# ---- parsing the flags -------------------------------------------------------------------------

_DIMS = re.compile(r"^(\[\]|[0-9]+(x[0-9]+)*)$")
MAX_DIM = 2**31 - 1  # TensorRT's and ONNX Runtime's dims are int64, but no real input has a dim this large


def parse_shapes(value: str, flag: str) -> dict[str, Shape]:
    """`NAME:DxDxD[,NAME:DxDxD…]` → {NAME: shape}. The name is everything before the last `:`, so names
    with `:` or `.` work; `NAME:[]` (or `NAME:`) is a scalar. The syntax only: the sizes allowed are
    models.toml's schema's to check (`builder.spec.flags`)."""
    found: dict[str, Shape] = {}
    for item in value.split(","):
        item = item.strip()
        if not item:
            raise ManifestError(f"{flag} {value!r}: an empty item between commas; expected NAME:DxDxD[,NAME:DxDxD...]")
        name, sep, dims = item.rpartition(":")
        dims = dims.strip() or "[]"
        if not sep or not name or not _DIMS.match(dims):
            raise ManifestError(f"{flag} {item!r}: expected NAME:DxDxD (e.g. x:1x3x224x224), "
                                "several separated by commas")
        shape = () if dims == "[]" else tuple(int(d) for d in dims.split("x"))
        if name in found:
            raise ManifestError(f"{flag}: input {name!r} is given twice")
        found[name] = shape
    return found


def parse_value_range(value: str, flag: str) -> tuple[str, int, int]:
    """`NAME:LOW:HIGH` (integers; the name may hold `:`) → (NAME, LOW, HIGH); LOW <= HIGH is the schema's."""
    head, sep1, high = value.rpartition(":")
    name, sep2, low = head.rpartition(":")
    if not (sep1 and sep2 and name and re.fullmatch(r"-?[0-9]+", low) and re.fullmatch(r"-?[0-9]+", high)):
        raise ManifestError(f"{flag} {value!r}: expected NAME:LOW:HIGH with integers (e.g. ids:0:999)")
    return name, int(low), int(high)


# ---- resolving against the graph ---------------------------------------------------------------

@dataclass(frozen=True)
class ModelShapes:
    """Every input's full min/opt/max shape. A batching model takes its batch on axis 0 of every input
    (Triton max_batch_size > 0); one that does not is served with max_batch_size 0 and full shapes."""

    batching: bool
    inputs: Mapping[str, ShapeRange]
    reason: str | None = None  # why the model does not batch

    @property
    def batch(self) -> DimRange | None:
        if not self.batching:
            return None
        first = next(iter(self.inputs.values()))
        return DimRange(first.min[0], first.opt[0], first.max[0])

    def sample_range(self, name: str) -> ShapeRange:
        """The shape range of one sample: without the batch axis for a batching model, whole otherwise."""
        full = self.inputs[name]
        return full.drop_first() if self.batching else full

    def config_dims(self, name: str) -> list[int]:
        """config.pbtxt dims: -1 where the range is dynamic; without the batch axis when batching."""
        one = self.sample_range(name)
        return [low if low == high else -1 for low, high in zip(one.min, one.max, strict=True)]

    def levels(self) -> list[Level]:
        """min, opt, max: those whose sample shapes differ (only opt for fixed shapes)."""
        seen: list[tuple[Shape, ...]] = []
        out = []
        for level in (Level.OPT, Level.MIN, Level.MAX):  # where two levels are equal, opt is the one kept
            key = tuple(self.sample_range(n).at(level) for n in self.inputs)
            if key not in seen:
                seen.append(key)
                out.append(level)
        return sorted(out, key=list(Level).index)

    def profile(self) -> dict[str, tuple[Shape, Shape, Shape]]:
        return {n: (r.min, r.opt, r.max) for n, r in self.inputs.items()}

    def to_json(self) -> dict[str, Any]:
        return {"batching": self.batching, "reason": self.reason,
                "inputs": {n: r.to_json() for n, r in self.inputs.items()}}

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> ModelShapes:
        return ModelShapes(bool(data["batching"]), {
            n: ShapeRange(tuple(r["min"]), tuple(r["opt"]), tuple(r["max"]), "build.json")
            for n, r in data["inputs"].items()}, data.get("reason"))


def _dynamic(dim: int | str) -> bool:
    return isinstance(dim, str) or dim < 1


def _label(dim: int | str) -> str:
    return f"{dim!r}" if isinstance(dim, str) else "unnamed"


def _example(tensor: TensorSpec) -> str:
    return format_shape([d if isinstance(d, int) and d > 0 else "D" for d in tensor.shape])


def _not_batching(inputs: Sequence[TensorSpec], no_batch: bool) -> str | None:
    """Why the model cannot batch on axis 0 (None when it can)."""
    if no_batch:
        return "--no-batch (no_batch = true) was given"
    for tensor in inputs:
        if not tensor.shape:
            return f"input {tensor.name!r} is a scalar"
        if not _dynamic(tensor.shape[0]):
            return f"input {tensor.name!r} has a fixed size {tensor.shape[0]} on axis 0 {_shape_text(tensor)}"
    return None


def _shape_text(tensor: TensorSpec) -> str:
    return "[" + ", ".join(str(d) if isinstance(d, int) and d > 0 else (repr(d) if isinstance(d, str) else "?")
                           for d in tensor.shape) + "]"


def resolve(inputs: Sequence[TensorSpec], *, batch: DimRange, batch_given: bool = True,
            dims: Mapping[str, DimRange], shapes: Mapping[str, ShapeRange], no_batch: bool = False,
            what: str) -> ModelShapes:
    """One full shape range per graph input. `inputs` are the graph's: ints are fixed sizes, strings
    named dynamic dims, -1 unnamed ones. Raises ManifestError naming the flag and input when a dynamic
    dim has no range, a given shape contradicts the graph, or a name is not an input."""
    names = [t.name for t in inputs]
    unknown = [n for n in shapes if n not in names]
    if unknown:
        raise ManifestError(f"{what}: {shapes[unknown[0]].where(unknown[0])}: the model has no input "
                            f"{unknown[0]!r}; its inputs: {', '.join(names)}")
    named = list(dict.fromkeys(d for t in inputs for d in t.shape if isinstance(d, str)))
    stray = [n for n in dims if n not in named]
    if stray:
        # The spec does not say whether the range came from the flag or models.toml: name both.
        theirs = (f"its named dims: {', '.join(repr(n) for n in named)}" if named else "it has no named dims")
        raise ManifestError(f"{what}: --dim {stray[0]} (dims.{stray[0]}): the model has no dim {stray[0]!r}; {theirs} "
                            f"(inputs: {', '.join(f'{t.name} {_shape_text(t)}' for t in inputs)})")
    reason = _not_batching(inputs, no_batch)
    batching = reason is None
    given_batch = _given_batch(shapes, batching)
    if given_batch is not None and batch_given and given_batch != batch:
        raise ManifestError(f"{what}: the shapes give axis 0 (the batch) {_triple(given_batch)} but the batch range "
                            f"(--max-batch, batch) is {_triple(batch)}; expected one or the other")
    batch_range = given_batch or batch
    resolved: dict[str, ShapeRange] = {}
    for tensor in inputs:
        if tensor.name in shapes:
            resolved[tensor.name] = _check_given(tensor, shapes[tensor.name], what)
        else:
            resolved[tensor.name] = _from_dims(tensor, batching=batching, batch=batch_range, dims=dims, what=what)
    _check_shared_names(inputs, resolved, what)
    return ModelShapes(batching, resolved, reason)


def _triple(rng: DimRange) -> str:
    return f"{rng.min}:{rng.opt}:{rng.max}"


def _given_batch(shapes: Mapping[str, ShapeRange], batching: bool) -> DimRange | None:
    if not batching or not shapes:
        return None
    found = {n: (r.min[0], r.opt[0], r.max[0]) for n, r in shapes.items() if r.min}
    if len(set(found.values())) > 1:
        listed = ", ".join(f"{n} {lo}:{mid}:{hi}" for n, (lo, mid, hi) in found.items())
        source = next(iter(shapes.values())).source
        raise ManifestError(f"{source}: axis 0 is the batch and must have one range for every input; got {listed}")
    if not found:  # only scalars given: the rank check against the graph names the input
        return None
    low, mid, high = next(iter(found.values()))
    return DimRange(low, mid, high)


def _check_given(tensor: TensorSpec, given: ShapeRange, what: str) -> ShapeRange:
    src = f"{what}: {given.where(tensor.name)}"
    if len(given.min) != len(tensor.shape):
        raise ManifestError(f"{src}: {len(given.min)} dims given, the model's input has {len(tensor.shape)} "
                            f"{_shape_text(tensor)}; expected {tensor.name}:{_example(tensor)}")
    for axis, dim in enumerate(tensor.shape):
        if _dynamic(dim):
            continue
        got = {given.min[axis], given.opt[axis], given.max[axis]}
        if got != {dim}:
            raise ManifestError(f"{src}: axis {axis} is fixed at {dim} in the model "
                                f"{_shape_text(tensor)}, got {'/'.join(str(g) for g in sorted(got))}")
    return given


def _from_dims(tensor: TensorSpec, *, batching: bool, batch: DimRange, dims: Mapping[str, DimRange],
               what: str) -> ShapeRange:
    low: list[int] = []
    mid: list[int] = []
    high: list[int] = []
    for axis, dim in enumerate(tensor.shape):
        if not _dynamic(dim):
            assert isinstance(dim, int)
            rng = DimRange(dim, dim, dim)
        elif batching and axis == 0:
            rng = batch
        elif isinstance(dim, str) and dim in dims:
            rng = dims[dim]
        else:
            named = f", or --dim {dim}=MIN:OPT:MAX" if isinstance(dim, str) else ""
            raise ManifestError(
                f"{what}: input {tensor.name!r} {_shape_text(tensor)} axis {axis} ({_label(dim)}) is dynamic and "
                f"has no range; expected --shapes {tensor.name}:{_example(tensor)} (or --min/--opt/--max-shapes)"
                f"{named}")
        low.append(rng.min)
        mid.append(rng.opt)
        high.append(rng.max)
    return ShapeRange(tuple(low), tuple(mid), tuple(high), "--dim")


def _check_shared_names(inputs: Sequence[TensorSpec], resolved: Mapping[str, ShapeRange], what: str) -> None:
    """A dim name used by several inputs (e.g. `sequence` of ids and mask) must get one range; names a
    single input repeats (`?`, `?`) mean nothing and are skipped."""
    seen: dict[str, tuple[str, tuple[int, int, int]]] = {}
    for tensor in inputs:
        named = [d for d in tensor.shape if isinstance(d, str)]
        rng = resolved[tensor.name]
        for axis, dim in enumerate(tensor.shape):
            if not isinstance(dim, str) or named.count(dim) > 1:
                continue
            values = (rng.min[axis], rng.opt[axis], rng.max[axis])
            if dim in seen and seen[dim][1] != values:
                other, theirs = seen[dim]
                raise ManifestError(f"{what}: dim {dim!r} is {':'.join(map(str, theirs))} in input {other!r} but "
                                    f"{':'.join(map(str, values))} in input {tensor.name!r}; "
                                    "expected one range for one named dim")
            seen.setdefault(dim, (tensor.name, values))


def check_value_ranges(inputs: Iterable[TensorSpec], ranges: Mapping[str, ValueRange], what: str) -> None:
    names = [t.name for t in inputs]
    for name in ranges:
        if name not in names:
            # The spec does not say whether the range came from the flag or models.toml: name both.
            raise ManifestError(f"{what}: --input-range {name} (input_ranges.{name}): the model has no input "
                                f"{name!r}; its inputs: {', '.join(names)}")


def for_model(spec: ModelSpec, inputs: Sequence[TensorSpec], what: str) -> ModelShapes:
    """`resolve()` with a model spec's batch, dims, shapes and --no-batch; its value ranges checked too."""
    check_value_ranges(inputs, spec.input_ranges, what)
    return resolve(inputs, batch=spec.batch, batch_given=spec.batch_given, dims=spec.dims, shapes=spec.shapes,
                   no_batch=spec.no_batch, what=what)
