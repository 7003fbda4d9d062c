"""Element-type tables shared by the ONNX reader, the data checks and the Triton config writer."""

from __future__ import annotations

import numpy as np
import onnx

from builder.errors import ManifestError

# numpy dtype name -> (ONNX TensorProto type, Triton config type)
_TABLE: dict[str, tuple[int, str]] = {
    "float32": (onnx.TensorProto.FLOAT, "TYPE_FP32"),
    "float16": (onnx.TensorProto.FLOAT16, "TYPE_FP16"),
    "float64": (onnx.TensorProto.DOUBLE, "TYPE_FP64"),
    "int64": (onnx.TensorProto.INT64, "TYPE_INT64"),
    "int32": (onnx.TensorProto.INT32, "TYPE_INT32"),
    "int16": (onnx.TensorProto.INT16, "TYPE_INT16"),
    "int8": (onnx.TensorProto.INT8, "TYPE_INT8"),
    "uint8": (onnx.TensorProto.UINT8, "TYPE_UINT8"),
    "bool": (onnx.TensorProto.BOOL, "TYPE_BOOL"),
}
_BY_ONNX = {onnx_type: name for name, (onnx_type, _) in _TABLE.items()}

SUPPORTED = tuple(_TABLE)


def check_dtype(name: str, what: str) -> str:
    """Return the canonical numpy dtype name or raise naming `what` and the allowed values."""
    canonical = np.dtype(name).name if name in _TABLE or _is_numpy(name) else name
    if canonical not in _TABLE:
        raise ManifestError(f"{what}: unknown dtype {name!r}; expected one of {', '.join(SUPPORTED)}")
    return canonical


def _is_numpy(name: str) -> bool:
    try:
        np.dtype(name)
    except TypeError:
        return False
    return True


def from_onnx(elem_type: int, what: str) -> str:
    try:
        return _BY_ONNX[elem_type]
    except KeyError:
        type_name = onnx.TensorProto.DataType.Name(elem_type)
        raise ManifestError(f"{what}: ONNX element type {type_name} is not supported") from None


def to_triton(dtype: str) -> str:
    return _TABLE[dtype][1]
