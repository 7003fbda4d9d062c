"""Inference request bodies in Triton's wire formats, built once per payload and sent many times.

Only public pieces: the generated protobuf `tritonclient.grpc.service_pb2` for gRPC, and the KServe
v2 binary-tensor extension for HTTP (a JSON header whose inputs carry `binary_data_size`, then the
raw tensor bytes; the header's length goes in `Inference-Header-Content-Length`). The bytes equal
what tritonclient's own (private) builders produce; tests/client/test_wire.py pins that, so an
upgrade that changes either format fails there rather than on a server.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray
from tritonclient.grpc import service_pb2

from client.datatypes import triton_datatype

# The gRPC method a raw (serializer-less) channel call targets.
GRPC_INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"
HTTP_HEADER_LENGTH = "Inference-Header-Content-Length"


def _contiguous(array: NDArray[Any]) -> NDArray[Any]:
    # tobytes() of a non-contiguous view copies in C order anyway; being explicit keeps shape and bytes in step.
    return np.ascontiguousarray(array)


def grpc_infer_request(model: str, arrays: Mapping[str, NDArray[Any]]) -> bytes:
    """A serialized ModelInferRequest: one input per array (name, datatype, shape) and its raw bytes.

    No outputs are named, so the server returns every output (as tritonclient does by default).
    """
    request = service_pb2.ModelInferRequest()
    request.model_name = model
    for name, array in arrays.items():
        data = _contiguous(array)
        tensor = request.inputs.add()
        tensor.name = name
        tensor.datatype = triton_datatype(data.dtype)
        tensor.shape.extend(int(d) for d in data.shape)
        request.raw_input_contents.append(data.tobytes())
    return bytes(request.SerializeToString())


def http_infer_request(arrays: Mapping[str, NDArray[Any]]) -> tuple[bytes, dict[str, str]]:
    """The body and headers of a binary-tensor HTTP request: JSON header, then each input's bytes.

    `binary_data_output` asks for binary outputs, which the server encodes fastest and we never decode.
    """
    raw = [_contiguous(array).tobytes() for array in arrays.values()]
    header = {
        "inputs": [
            {"name": name, "shape": [int(d) for d in array.shape], "datatype": triton_datatype(array.dtype),
             "parameters": {"binary_data_size": len(data)}}
            for (name, array), data in zip(arrays.items(), raw, strict=True)
        ],
        "parameters": {"binary_data_output": True},
    }
    # Compact, as tritonclient's rapidjson writes it; ASCII-escaped, so the length in bytes is unambiguous.
    text = json.dumps(header, separators=(",", ":")).encode("ascii")
    return b"".join([text, *raw]), {HTTP_HEADER_LENGTH: str(len(text))}


def http_error_message(status: int, body: bytes) -> str:
    """The server's own reason from an HTTP error body (`{"error": "..."}`), else the body's start."""
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    if isinstance(payload, dict) and isinstance(payload.get("error"), str):
        return f"HTTP {status}: {payload['error']}"
    return f"HTTP {status}: {body[:200].decode('utf-8', 'replace')}"
