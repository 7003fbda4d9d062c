"""Typed, self-validating specifications of one model build (from models.toml or `trtbuild build`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from builder.errors import ManifestError
from builder.spec.enums import CalibrationMethod, Int8Recipe, Precision, Task
from builder.spec.keys import Keys, Loc, TomlKeys
from builder.spec.shapes import DimRange as DimRange
from builder.spec.shapes import ShapeRange, ValueRange


@dataclass(frozen=True)
class TensorSpec:
    """An input or output: name, numpy dtype name and shape. Dims are sizes, names of dynamic dims, or
    -1 (dynamic, unnamed); in models.toml shape[0] is the batch axis (-1)."""

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
    method: CalibrationMethod = CalibrationMethod.ENTROPY
    recipe: Int8Recipe = Int8Recipe.AUTO
    op_types_to_quantize: tuple[str, ...] = ()
    nodes_to_exclude: tuple[str, ...] = ()
    nodes_to_quantize: tuple[str, ...] = ()  # set by the accuracy guard's per-node sensitivity runs

    def __post_init__(self) -> None:
        # Library callers may pass plain strings; store the members (a wrong value fails here, named).
        object.__setattr__(self, "method", CalibrationMethod.parse(self.method, "calibration.method",
                                                                   error=ManifestError))
        object.__setattr__(self, "recipe", Int8Recipe.parse(self.recipe, "calibration.recipe", error=ManifestError))


@dataclass(frozen=True)
class Tolerance:
    """Limits a variant must meet against the FP32 reference; None means not checked."""

    max_abs: float | None = None
    max_rel: float | None = None
    cosine_min: float | None = None
    cosine_mean_min: float | None = None
    top1_agreement_min: float | None = None
    detection_agreement_min: float | None = None


# Applied when models.toml gives no tolerance for a precision.
DEFAULT_TOLERANCES: Mapping[Precision, Tolerance] = {
    Precision.FP32: Tolerance(max_rel=1e-4),
    Precision.FP16: Tolerance(cosine_min=0.999),
    Precision.INT8: Tolerance(cosine_min=0.97),
}
# A detector's (Task.DETECTION): its top-K rows reorder when a score moves in the last digits, so an element-wise
# cosine says little; the share of detections matched as sets says what a user sees.
DETECTION_TOLERANCES: Mapping[Precision, Tolerance] = {
    Precision.FP32: Tolerance(detection_agreement_min=0.99),
    Precision.FP16: Tolerance(detection_agreement_min=0.97),
    Precision.INT8: Tolerance(detection_agreement_min=0.9),
}


@dataclass(frozen=True)
class ServingSpec:
    # None: the serving backend's default (BackendConfig.default_instances: 1, or 4 per GPU for the python runner
    # on CUDA, where one instance leaves the GPU idle while Python handles a batch).
    instances: int | None = None
    dynamic_batching: bool = True
    max_queue_delay_us: int = 0
    ort_intra_op_threads: int = 0
    # GPUs (device ids as Triton's process sees them) a GPU variant serves on: `instances` on each of them,
    # one KIND_GPU instance group; empty: Triton's default (every GPU it sees).
    gpus: tuple[int, ...] = ()
    # The python runner on CUDA: the batch sizes it keeps one session each for (python_model.buckets).
    batch_buckets: Literal["pow2", "fine"] = "pow2"

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpus", tuple(dict.fromkeys(self.gpus)))  # a list from TOML, in order, once each


@dataclass(frozen=True)
class ModelSpec:
    name: str
    batch: DimRange
    precisions: tuple[Precision, ...]
    source: str | None = None
    onnx: Path | None = None
    task: Task = Task.GENERIC
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[str, ...] = ()
    dims: Mapping[str, DimRange] = field(default_factory=dict)
    calibration: CalibrationSpec | None = None
    evaluation: DataSpec | None = None
    tolerances: Mapping[Precision, Tolerance] = field(default_factory=dict)
    serving: ServingSpec = ServingSpec()
    opset: int = 17
    shapes: Mapping[str, ShapeRange] = field(default_factory=dict)  # per input, full shape (trtexec style)
    input_ranges: Mapping[str, ValueRange] = field(default_factory=dict)  # values of synthetic samples
    no_batch: bool = False  # serve with max_batch_size 0 even where axis 0 could batch
    batch_given: bool = True  # False: `batch` is a default the shapes' axis 0 may replace
    # An FP16 or INT8 variant missing its tolerance runs its accuracy guard (False: --no-guard).
    guard: bool = True

    def __post_init__(self) -> None:
        # Library callers may pass plain strings; store the members (a wrong value fails here, named).
        object.__setattr__(self, "task", Task.parse(self.task, f"model {self.name!r}: task", error=ManifestError))
        object.__setattr__(self, "precisions", tuple(
            Precision.parse(p, f"model {self.name!r}: precision", error=ManifestError) for p in self.precisions))
        object.__setattr__(self, "tolerances", {
            Precision.parse(p, f"model {self.name!r}: tolerances.", error=ManifestError): t
            for p, t in self.tolerances.items()})

    def tolerance(self, precision: Precision) -> Tolerance:
        defaults = DETECTION_TOLERANCES if self.task is Task.DETECTION else DEFAULT_TOLERANCES
        return self.tolerances.get(precision, defaults[precision])

    def problems(self, keys: Keys | None = None) -> list[tuple[Loc, str]]:
        """Every inconsistency between the fields, as (key, what is wrong); empty when the spec is sound.
        Keys are models.toml's (("inputs", 0, "shape")); `keys` says how a line asks for another key (models.toml's
        table, or `trtbuild build`'s flag), so both entry points get one text."""
        keys = keys if keys is not None else TomlKeys()
        found: list[tuple[Loc, str]] = []
        if (self.source is None) == (self.onnx is None):
            found.append((("source",), "give exactly one of source (module:function) or onnx (a file)"))
        if self.source is not None and not self.inputs:
            found.append((("inputs",), "a source model needs inputs (name, dtype, shape)"))
        if self.source is not None and ":" not in self.source:
            found.append((("source",), f"{self.source!r} is not of the form module:function"))
        for i, tensor in enumerate(self.inputs):
            key: Loc = ("inputs", i, "shape")
            if tensor.shape and tensor.shape[0] != -1:
                found.append((key, f"input {tensor.name!r}: shape[0] must be -1 (the batch axis)"))
            for dim in tensor.sample_shape:
                if isinstance(dim, str) and dim not in self.dims and tensor.name not in self.shapes:
                    found.append((key, f"input {tensor.name!r}: dynamic dim {dim!r} has no range; "
                                       f"add {keys.give(('dims', dim))} or {keys.give(('shapes', tensor.name))}"))
                if isinstance(dim, int) and dim < 1:
                    found.append((key, f"input {tensor.name!r}: non-batch dims must be >= 1 or a named range, "
                                       f"got {dim}"))
        declared = [t.name for t in self.inputs]
        for table, names in (("shapes", self.shapes), ("input_ranges", self.input_ranges)):
            for name in names:
                if declared and name not in declared:
                    found.append(((table, name), f"no input {name!r} in inputs ({', '.join(declared)})"))
        if Precision.INT8 in self.precisions and self.calibration is None:
            found.append((("precisions",), f"int8 needs {keys.give(('calibration',))}"))
        if self.opset < 17:
            found.append((("opset",), f"must be >= 17, got {self.opset}"))
        return found

    def check(self, keys: Keys | None = None) -> ModelSpec:
        """The spec itself, or ManifestError listing every problem, one line each."""
        keys = keys if keys is not None else TomlKeys()
        found = self.problems(keys)
        if found:
            raise ManifestError("\n".join(f"model {self.name!r}: {keys.at(key)}: {what}" for key, what in found))
        return self
