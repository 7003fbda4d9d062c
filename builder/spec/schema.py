"""models.toml's schema: pydantic models of the file, its JSON Schema, and one-line error messages.

The models check what one key can check on its own (types, ranges, names, known keys); what needs
several keys at once (int8 needs calibration, every named dim has a range) is `ModelSpec.problems()`.
Validation is strict: TOML's `"false"` is not a bool and `"fp32"` is not a list.
"""

from __future__ import annotations

import difflib
import functools
import json
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, cast

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    Strict,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaMode, JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError, core_schema

from builder.spec.dtypes import SUPPORTED
from builder.spec.enums import CalibrationMethod, Int8Recipe, Precision, Task
from builder.spec.keys import Keys as Keys
from builder.spec.keys import Loc, Namer, key_path
from builder.spec.keys import TomlKeys as TomlKeys
from builder.spec.names import NAME_PATTERN, NAME_RULE
from builder.spec.shapes import MAX_DIM

# Error types raised by the validators below; their message is already the whole "expected ..." text.
_OWN = "manifest_"


class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# The closed sets come from TOML as strings: accept a member's value (strict mode wants a member).
PrecisionName = Annotated[Precision, Strict(False)]
TaskName = Annotated[Task, Strict(False)]
MethodName = Annotated[CalibrationMethod, Strict(False)]
RecipeName = Annotated[Int8Recipe, Strict(False)]
NonEmpty = Annotated[str, Field(min_length=1)]
Count = Annotated[int, Field(ge=1)]
NonNegative = Annotated[int, Field(ge=0)]
Limit = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Similarity = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]  # cosine, top-1 agreement: at most 1
ShapeSize = Annotated[int, Field(ge=1, le=MAX_DIM)]


class DimTable(_Table):
    """min/opt/max of one dynamic dimension; also written [min, opt, max]."""

    model_config = ConfigDict(title="dim range")
    min: Count
    opt: Count
    max: Count

    @model_validator(mode="after")
    def _ordered(self) -> DimTable:
        if not self.min <= self.opt <= self.max:
            raise PydanticCustomError(_OWN + "dim_order", "expected min <= opt <= max")
        return self


def _dim_range_input(value: Any) -> Any:
    if isinstance(value, list) and len(value) == 3:
        return {"min": value[0], "opt": value[1], "max": value[2]}
    if isinstance(value, dict):
        return value
    raise PydanticCustomError(_OWN + "dim_range", "expected [min, opt, max] or { min = …, opt = …, max = … }")


class _ListOrTable:
    """JSON Schema of a dim range: both spellings the validator accepts."""

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        positive = {"type": "integer", "minimum": 1}
        return {"anyOf": [{"type": "array", "items": positive, "minItems": 3, "maxItems": 3}, handler(schema)]}


DimRangeValue = Annotated[DimTable, BeforeValidator(_dim_range_input), _ListOrTable()]


def _one_error(expected: str) -> Callable[[Any, ValidatorFunctionWrapHandler], Any]:
    """Collapse a union's per-branch errors into one line."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError(_OWN + "union", expected) from None

    return validate


ShapeDim = Annotated[int | str, WrapValidator(_one_error("expected an integer or the name of a dim in dims"))]


# The same rules as JSON Schema patterns, for editors.
MODULE_FUNCTION = r"^[^:]+:.+$"
DATA_SOURCE = r"^[^:]+:.+$|\.npz$"


def _module_function(value: str) -> str:
    module, sep, function = value.partition(":")
    if not (sep and module and function):
        raise PydanticCustomError(_OWN + "source", "expected module:function")
    return value


def _data_source(value: str) -> str:
    if not value.endswith(".npz"):
        try:
            _module_function(value)
        except PydanticCustomError:
            raise PydanticCustomError(_OWN + "data_source", "expected module:function or a .npz file") from None
    return value


class InputTable(_Table):
    """One model input; shape[0] is the batch axis (-1), other dims are sizes or names of dims."""

    model_config = ConfigDict(title="input")
    name: NonEmpty
    dtype: Annotated[str, Field(json_schema_extra={"enum": list(SUPPORTED)})]
    shape: Annotated[list[ShapeDim], Field(min_length=1, description='e.g. [-1, 3, 224, 224] or [-1, "sequence"]')]

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str) -> str:
        if value not in SUPPORTED:
            raise PydanticCustomError(_OWN + "dtype", "expected one of {allowed}", {"allowed": ", ".join(SUPPORTED)})
        return value

    @field_validator("shape")
    @classmethod
    def _batch_first(cls, value: list[int | str]) -> list[int | str]:
        if value[0] != -1:
            raise PydanticCustomError(_OWN + "batch_axis", "expected -1 (the batch axis) first")
        if any(isinstance(d, int) and d < 1 for d in value[1:]):
            raise PydanticCustomError(_OWN + "dims", "expected sizes >= 1 or dim names after the batch axis")
        return value


class ShapeTable(_Table):
    """min/opt/max of one input's whole shape (the batch first for batching models); a missing min or
    max is the opt, as in trtexec. Also written as one list: a fixed shape."""

    model_config = ConfigDict(title="shape range")
    min: list[ShapeSize] | None = None
    opt: list[ShapeSize]
    max: list[ShapeSize] | None = None

    @model_validator(mode="after")
    def _ordered(self) -> ShapeTable:
        low, high = self.min or self.opt, self.max or self.opt
        if not len(low) == len(self.opt) == len(high):
            raise PydanticCustomError(_OWN + "shape_rank", "expected min, opt and max of the same rank")
        for axis, (a, b, c) in enumerate(zip(low, self.opt, high, strict=True)):
            if not a <= b <= c:  # which axis: a long shape's table does not show it at a glance
                raise PydanticCustomError(_OWN + "shape_order", "axis {axis} has min {min}, opt {opt}, max {max}; "
                                          "expected min <= opt <= max on every axis",
                                          {"axis": axis, "min": a, "opt": b, "max": c})
        return self


def _shape_range_input(value: Any) -> Any:
    if isinstance(value, list):
        return {"opt": value}
    if isinstance(value, dict):
        return value
    raise PydanticCustomError(_OWN + "shape_range", "expected [D, D, …] (fixed) or { min = […], opt = […], max = […] }")


class _ShapeListOrTable:
    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        size = {"type": "integer", "minimum": 1, "maximum": MAX_DIM}
        return {"anyOf": [{"type": "array", "items": size}, handler(schema)]}


ShapeRangeValue = Annotated[ShapeTable, BeforeValidator(_shape_range_input), _ShapeListOrTable()]


def _value_range_input(value: Any) -> Any:
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                          for v in value) and value[0] <= value[1]:
        return value
    raise PydanticCustomError(_OWN + "value_range", "expected [LOW, HIGH] integers with LOW <= HIGH")


ValueRangeValue = Annotated[list[int], BeforeValidator(_value_range_input),
                            Field(min_length=2, max_length=2)]


class DataTable(_Table):
    """Samples from `module:function(count, seed)` or an .npz keyed by input name."""

    model_config = ConfigDict(title="data")
    source: Annotated[str, AfterValidator(_data_source),
                      Field(description="module:function or a .npz file (relative to models.toml)",
                            json_schema_extra={"pattern": DATA_SOURCE})]
    samples: Count = 64
    seed: NonNegative = 0


class CalibrationTable(DataTable):
    """INT8 calibration: its samples and how the quantizer uses them."""

    model_config = ConfigDict(title="[model.calibration]")
    method: MethodName = CalibrationMethod.ENTROPY
    recipe: Annotated[RecipeName, Field(description=(
        "auto: by runtime and model class; modelopt: TensorRT's Q/DQ; onnxruntime: ORT's static Q/DQ; "
        "onnxruntime-dynamic: ORT CPU's dynamic quantization"))] = Int8Recipe.AUTO
    op_types_to_quantize: list[NonEmpty] = []
    nodes_to_exclude: list[NonEmpty] = []


class ToleranceTable(_Table):
    """Limits a variant must meet against the FP32 model; a missing key is not checked."""

    model_config = ConfigDict(title="tolerance")
    max_abs: Limit | None = None
    max_rel: Limit | None = None
    cosine_min: Similarity | None = None
    cosine_mean_min: Similarity | None = None
    top1_agreement_min: Similarity | None = None
    detection_agreement_min: Similarity | None = None


class TolerancesTable(_Table):
    """Tolerances per precision (built-in defaults where a precision has none)."""

    model_config = ConfigDict(title="[model.tolerances]")
    fp32: ToleranceTable | None = None
    fp16: ToleranceTable | None = None
    int8: ToleranceTable | None = None


class ServingTable(_Table):
    """How Triton serves each variant."""

    model_config = ConfigDict(title="[model.serving]")
    instances: Annotated[Count | None, Field(description="model instances (per GPU for a GPU variant); default: 1, "
                                                         "or 4 per GPU for the python runner on CUDA")] = None
    dynamic_batching: bool = True
    max_queue_delay_us: NonNegative = 0
    ort_intra_op_threads: Annotated[NonNegative, Field(description="0: ONNX Runtime's default")] = 0
    gpus: Annotated[list[NonNegative], Field(description="GPU variants: serve `instances` instances on each of "
                                                         "these GPUs (device ids); empty: every GPU")] = []
    batch_buckets: Annotated[Literal["pow2", "fine"], Field(
        description="the python runner on CUDA pads each batch up to the next of its batch sizes, one session "
                    "each: pow2 (1, 2, 4 ... max) or fine (powers of two, then steps of the power of two at or above "
                    "max/8, at least 8: less padding, more sessions and device memory)")] = "pow2"


class ModelTable(_Table):
    """One model to build: where it comes from, its inputs and batch range, precisions, data, checks."""

    model_config = ConfigDict(title="[[model]]")
    name: Annotated[str, Field(pattern=NAME_PATTERN, description="Triton model name; variants are NAME_<precision>")]
    source: Annotated[Annotated[str, AfterValidator(_module_function)] | None,
                      Field(description="module:function returning a torch.nn.Module",
                            json_schema_extra={"pattern": MODULE_FUNCTION})] = None
    onnx: Annotated[NonEmpty | None, Field(description="an ONNX file (relative to models.toml)")] = None
    task: TaskName = Task.GENERIC
    inputs: list[InputTable] = []
    outputs: list[NonEmpty] = []
    batch: Annotated[DimRangeValue | None,
                     Field(description="batch sizes the engines take: min, opt, max (default: the shapes' "
                                       "axis 0, else [1, 8, 16])")] = None
    dims: Annotated[dict[str, DimRangeValue], Field(description="range of every named non-batch dim")] = {}
    shapes: Annotated[dict[str, ShapeRangeValue],
                      Field(description="per input: its whole shape's min/opt/max (batch first), trtexec style")] = {}
    input_ranges: Annotated[dict[str, ValueRangeValue],
                            Field(description="per input: [LOW, HIGH] of synthetic integer values")] = {}
    no_batch: Annotated[bool, Field(description="serve with max_batch_size 0 and full shapes")] = False
    precisions: Annotated[list[PrecisionName], Field(min_length=1, description="variants to build")] = [
        Precision.FP32]
    calibration: CalibrationTable | None = None
    evaluation: Annotated[DataTable | None, Field(description="held-out samples for the accuracy check")] = None
    tolerances: TolerancesTable = Field(default_factory=TolerancesTable)
    serving: ServingTable = ServingTable()
    opset: Annotated[int, Field(ge=17)] = 17


class ManifestFile(_Table):
    """models.toml: the models `trtbuild engines` builds."""

    model_config = ConfigDict(title="models.toml")
    model: Annotated[list[ModelTable], Field(min_length=1)]


assert set(TolerancesTable.model_fields) == set(Precision.values()), "a tolerance table per precision"

# taplo (Even Better TOML) implements Draft 4; the schema keeps to its keywords.
JSON_SCHEMA_DIALECT = "http://json-schema.org/draft-04/schema#"


class _TomlJsonSchema(GenerateJsonSchema):
    """TOML has no null: optional keys are simply absent. Definitions go under Draft 4's `definitions`;
    field titles would only repeat the keys."""

    DEFINITIONS: ClassVar[str] = "#/definitions/{model}"

    def nullable_schema(self, schema: core_schema.NullableSchema) -> JsonSchemaValue:
        return self.generate_inner(schema["schema"])

    def default_schema(self, schema: core_schema.WithDefaultSchema) -> JsonSchemaValue:
        if schema.get("default", ...) is None:
            return self.generate_inner(schema["schema"])
        return super().default_schema(schema)

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False

    def generate(self, schema: CoreSchema, mode: JsonSchemaMode = "validation") -> JsonSchemaValue:
        generated = super().generate(schema, mode)
        definitions = generated.pop("$defs", {})
        return {"$schema": JSON_SCHEMA_DIALECT, **generated, "definitions": definitions}


@functools.cache
def _json_schema() -> str:
    return json.dumps(ManifestFile.model_json_schema(ref_template=_TomlJsonSchema.DEFINITIONS,
                                                     schema_generator=_TomlJsonSchema))


def json_schema() -> dict[str, Any]:
    """models.toml's JSON Schema (what `trtbuild schema` prints; a fresh copy each call)."""
    return cast(dict[str, Any], json.loads(_json_schema()))


# ---- one line per error -------------------------------------------------------------------------

def did_you_mean(value: object, choices: Any) -> str:
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    return f"; did you mean {close[0]}?" if close else ""


def error_lines(exc: ValidationError, at: Namer | None = None, inside: Loc = ()) -> list[tuple[Loc, str]]:
    """(where, `key.path: what is wrong`) for each error pydantic found, in the schema's key order. `inside`
    is where the validated table sits in models.toml (("model", 0) for one [[model]] table), for the
    schema's description of each key; `at` names a location within it (default: its TOML key path)."""
    root = json_schema()
    name = at or key_path
    return [(tuple(error["loc"]), _line(root, error, name, inside)) for error in exc.errors(include_url=False)]


def toml_value(value: Any, limit: int = 60) -> str:
    """A value as it would be written in TOML, shortened."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
    elif isinstance(value, list):
        text = "[" + ", ".join(toml_value(v, limit) for v in value) + "]"
    elif isinstance(value, dict):
        text = "{ " + ", ".join(f"{key_path((k,))} = {toml_value(v, limit)}" for k, v in value.items()) + " }"
    else:
        text = str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _line(root: dict[str, Any], error: Any, at: Namer, inside: Loc) -> str:
    loc: Loc = tuple(error["loc"])
    where = inside + loc  # in the whole file: the schema's node
    kind: str = error["type"]
    got = toml_value(error["input"])
    if kind == "extra_forbidden":
        parent = _node_at(root, where[:-1])
        keys = _keys(root, parent) if parent else []
        hint = did_you_mean(loc[-1], keys) or (f"; expected one of {', '.join(keys)}" if keys else "")
        return f"{at(loc)}: unknown key{hint}"
    if where == ("model",) and kind in ("missing", "too_short", "list_type"):
        return "model: expected at least one [[model]] table" + ("" if kind == "missing" else f", got {got}")
    node = _node_at(root, where)
    expected = _describe(root, node) if node else "a valid value"
    if kind == "missing":
        return f"{at(loc)}: missing; expected {expected}"
    if kind == "finite_number":  # TOML's inf and nan: "a number >= 0" alone would admit inf
        text = f"expected a finite {expected.removeprefix('a ')}"
    elif kind.startswith(_OWN):
        text = str(error["msg"])
    elif kind == "too_short" and node and node.get("type") == "array":
        n = error["ctx"]["min_length"]
        text = f"expected at least {n} item{'s' if n > 1 else ''} ({_describe(root, node['items'], plural=True)})"
    elif kind == "value_error":
        text = str(error["ctx"]["error"])
    else:
        text = f"expected {expected}"
    hint = did_you_mean(error["input"], node["enum"]) if node and "enum" in node else ""
    return f"{at(loc)}: {text}, got {got}{hint}"


_PATTERNS = {
    NAME_PATTERN: (f"a name of {NAME_RULE}", f"names of {NAME_RULE}"),
    MODULE_FUNCTION: ("module:function", "module:function strings"),
    DATA_SOURCE: ("module:function or a .npz file", "module:function strings or .npz files"),
}


def _resolve(root: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = cast(dict[str, Any], root["definitions"][node["$ref"].rsplit("/", 1)[-1]])
    return node


def _keys(root: dict[str, Any], node: dict[str, Any]) -> list[str]:
    """The keys a table at `node` may have (of every alternative, for a dim range)."""
    node = _resolve(root, node)
    keys = list(node.get("properties", {}))
    for alternative in node.get("anyOf", []):
        keys += _keys(root, alternative)
    return keys


def _child(root: dict[str, Any], node: dict[str, Any], part: str | int) -> dict[str, Any] | None:
    node = _resolve(root, node)
    if "anyOf" in node:
        found = (_child(root, alternative, part) for alternative in node["anyOf"])
        return next((c for c in found if c is not None), None)
    if isinstance(part, int):
        return cast(dict[str, Any], node["items"]) if node.get("type") == "array" else None
    properties = node.get("properties", {})
    if part in properties:
        return cast(dict[str, Any], properties[part])
    extra = node.get("additionalProperties")
    return extra if isinstance(extra, dict) else None


def _node_at(root: dict[str, Any], loc: Loc) -> dict[str, Any] | None:
    node: dict[str, Any] | None = root
    for part in loc:
        node = _child(root, node, part) if node is not None else None
    return _resolve(root, node) if node is not None else None


def _describe(root: dict[str, Any], node: dict[str, Any], plural: bool = False) -> str:
    node = _resolve(root, node)
    if "anyOf" in node:
        return " or ".join(_describe(root, alternative, plural) for alternative in node["anyOf"])
    if "enum" in node:
        return ", ".join(map(str, node["enum"])) if plural else "one of " + ", ".join(map(str, node["enum"]))
    kind = node.get("type")
    if kind == "boolean":
        return "true or false values" if plural else "true or false"
    if kind in ("integer", "number"):
        word = {"integer": ("an integer", "integers"), "number": ("a number", "numbers")}[kind][plural]
        if "minimum" in node and "maximum" in node:
            return f"{word} from {node['minimum']} to {node['maximum']}"
        return word + (f" >= {node['minimum']}" if "minimum" in node else "")
    if kind == "string":
        if node.get("pattern") in _PATTERNS:
            return _PATTERNS[node["pattern"]][plural]
        if plural:
            return "non-empty strings" if node.get("minLength") else "strings"
        return "a non-empty string" if node.get("minLength") else "a string"
    if kind == "array":
        items = _describe(root, node.get("items", {}), plural=True)
        if node.get("minItems") is not None and node.get("minItems") == node.get("maxItems"):
            return f"a list of {node['minItems']} {items}"
        return f"lists of {items}" if plural else f"a list of {items}"
    if kind == "object":
        return "tables" if plural else "a table"
    return "values" if plural else "a value"
