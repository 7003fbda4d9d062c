"""Triton's tensor datatypes ("FP32", "INT64", ...) and their numpy dtypes: the one table both
packages use (the builder adds the ONNX element types and the config's "TYPE_" prefix on top)."""

from __future__ import annotations

import numpy as np

# numpy dtype name -> Triton datatype name (the wire protocol's; config.pbtxt writes "TYPE_" + it)
_TRITON = {
    "float32": "FP32", "float16": "FP16", "float64": "FP64", "int64": "INT64", "int32": "INT32",
    "int16": "INT16", "int8": "INT8", "uint8": "UINT8", "bool": "BOOL",
}
_NUMPY = {triton: name for name, triton in _TRITON.items()}

NUMPY_NAMES = tuple(_TRITON)
TRITON_NAMES = tuple(_NUMPY)


def triton_datatype(dtype: np.dtype[np.generic] | str) -> str:
    """"FP32" for float32; KeyError for a dtype Triton's tensors cannot carry here."""
    return _TRITON[np.dtype(dtype).name]


def numpy_dtype(datatype: str) -> np.dtype[np.generic]:
    """np.dtype('float32') for "FP32"; KeyError for an unsupported datatype (e.g. BYTES)."""
    return np.dtype(_NUMPY[datatype])
