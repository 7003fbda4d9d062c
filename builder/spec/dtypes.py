"""Element types: numpy names (what models.toml and the data use), ONNX element types, and Triton's
datatypes (from `common.datatypes`, the one table of Triton names)."""

from __future__ import annotations

import numpy as np
import onnx

from builder.errors import ManifestError
from common.datatypes import NUMPY_NAMES, triton_datatype

_ONNX: dict[str, int] = {
    "float32": onnx.TensorProto.FLOAT,
    "float16": onnx.TensorProto.FLOAT16,
    "float64": onnx.TensorProto.DOUBLE,
    "int64": onnx.TensorProto.INT64,
    "int32": onnx.TensorProto.INT32,
    "int16": onnx.TensorProto.INT16,
    "int8": onnx.TensorProto.INT8,
    "uint8": onnx.TensorProto.UINT8,
    "bool": onnx.TensorProto.BOOL,
}
_BY_ONNX = {onnx_type: name for name, onnx_type in _ONNX.items()}
assert set(_ONNX) == set(NUMPY_NAMES), "the ONNX and Triton tables must cover the same dtypes"

SUPPORTED = NUMPY_NAMES


def check_dtype(name: str, what: str) -> str:
    """Return the canonical numpy dtype name or raise naming `what` and the allowed values."""
    try:
        canonical = np.dtype(name).name
    except TypeError:
        canonical = name
    if canonical not in _ONNX:
        raise ManifestError(f"{what}: unknown dtype {name!r}; expected one of {', '.join(SUPPORTED)}")
    return canonical


def from_onnx(elem_type: int, what: str) -> str:
    try:
        return _BY_ONNX[elem_type]
    except KeyError:
        type_name = onnx.TensorProto.DataType.Name(elem_type)
        raise ManifestError(f"{what}: ONNX element type {type_name} is not supported") from None


def to_triton_config(dtype: str) -> str:
    """config.pbtxt's data type ("TYPE_FP32") for a numpy dtype name."""
    return "TYPE_" + triton_datatype(dtype)
