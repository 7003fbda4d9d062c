"""Inference request bodies in Triton's wire formats, built once per payload and sent many times.

Only public pieces: the generated protobuf `tritonclient.grpc.service_pb2` for gRPC, and the KServe
v2 binary-tensor extension for HTTP (a JSON header whose inputs carry `binary_data_size`, then the
raw tensor bytes; the header's length goes in `Inference-Header-Content-Length`); and the response
decoders that only `--validate` uses (the load path never decodes). The request bytes equal
what tritonclient's own (private) builders produce; tests/client/test_wire.py pins that, so an
upgrade that changes either format fails there rather than on a server.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError
from numpy.typing import NDArray
from tritonclient.grpc import service_pb2

from common.datatypes import numpy_dtype, triton_datatype

# The gRPC method a raw (serializer-less) channel call targets.
GRPC_INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"
HTTP_HEADER_LENGTH = "Inference-Header-Content-Length"


def _contiguous(array: NDArray[Any]) -> NDArray[Any]:
    # tobytes() of a non-contiguous view copies in C order anyway; being explicit keeps shape and bytes in step.
    return np.ascontiguousarray(array)


@dataclass(frozen=True)
class ShmRef:
    """Where a tensor lies in a registered shared-memory region (`--shared-memory`)."""

    region: str  # the name the region was registered under
    byte_size: int
    offset: int = 0


@dataclass(frozen=True)
class ShmLayout:
    """A request whose tensors travel through shared memory: every input, and optionally each output."""

    inputs: Mapping[str, ShmRef]
    outputs: Mapping[str, ShmRef]


def _shm_params(ref: ShmRef) -> dict[str, Any]:
    # Triton's shared-memory extension: the same three parameters over gRPC and HTTP (offset 0 is omitted,
    # as tritonclient omits it).
    params: dict[str, Any] = {"shared_memory_region": ref.region, "shared_memory_byte_size": ref.byte_size}
    if ref.offset:
        params["shared_memory_offset"] = ref.offset
    return params


def _set_grpc_params(target: Any, params: Mapping[str, Any]) -> None:
    for key, value in params.items():
        if isinstance(value, str):
            target[key].string_param = value
        else:
            target[key].int64_param = int(value)


def grpc_infer_request(model: str, arrays: Mapping[str, NDArray[Any]], shm: ShmLayout | None = None) -> bytes:
    """A serialized ModelInferRequest: one input per array (name, datatype, shape) and its raw bytes.

    No outputs are named, so the server returns every output (as tritonclient does by default). With
    `shm`, the inputs name their region instead of carrying bytes, and the outputs in `shm.outputs` are
    asked for into their regions.
    """
    request = service_pb2.ModelInferRequest()
    request.model_name = model
    for name, array in arrays.items():
        data = _contiguous(array)
        tensor = request.inputs.add()
        tensor.name = name
        tensor.datatype = triton_datatype(data.dtype)
        tensor.shape.extend(int(d) for d in data.shape)
        if shm is None:
            request.raw_input_contents.append(data.tobytes())
        else:
            _set_grpc_params(tensor.parameters, _shm_params(shm.inputs[name]))
    for name, ref in (shm.outputs.items() if shm is not None else ()):
        output = request.outputs.add()
        output.name = name
        _set_grpc_params(output.parameters, _shm_params(ref))
    return bytes(request.SerializeToString())


def http_infer_request(arrays: Mapping[str, NDArray[Any]],
                       shm: ShmLayout | None = None) -> tuple[bytes, dict[str, str]]:
    """The body and headers of a binary-tensor HTTP request: JSON header, then each input's bytes.

    `binary_data_output` asks for binary outputs, which the server encodes fastest; only `--validate`
    decodes them (`http_infer_outputs`). With `shm`, the header alone: inputs (and the outputs named
    in `shm.outputs`) refer to their shared-memory regions.
    """
    if shm is not None:
        outputs: Sequence[dict[str, Any]] = [{"name": name, "parameters": _shm_params(ref)}
                                             for name, ref in shm.outputs.items()]
        shm_header: dict[str, Any] = {
            "inputs": [{"name": name, "shape": [int(d) for d in array.shape],
                        "datatype": triton_datatype(array.dtype), "parameters": _shm_params(shm.inputs[name])}
                       for name, array in arrays.items()],
            "parameters": {"binary_data_output": True},
        }
        if outputs:
            shm_header["outputs"] = list(outputs)
        text = json.dumps(shm_header, separators=(",", ":")).encode("ascii")
        return text, {HTTP_HEADER_LENGTH: str(len(text)), "Accept-Encoding": "identity"}
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
    # aiohttp offers gzip by default and Triton would then compress every answer: work perf_analyzer's
    # client never asks of the server, so it must not be in what perfclient measures either.
    return b"".join([text, *raw]), {HTTP_HEADER_LENGTH: str(len(text)), "Accept-Encoding": "identity"}


def http_error_message(status: int, body: bytes) -> str:
    """The server's own reason from an HTTP error body (`{"error": "..."}`), else the body's start."""
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    if isinstance(payload, dict) and isinstance(payload.get("error"), str):
        return f"HTTP {status}: {payload['error']}"
    return f"HTTP {status}: {body[:200].decode('utf-8', 'replace')}"


class ResponseFormatError(ValueError):
    """An inference response that does not parse as Triton's wire format (counted, never raised out of a run)."""


def _tensor(name: str, datatype: str, shape: list[int], data: bytes) -> NDArray[Any]:
    try:
        dtype = numpy_dtype(datatype)
    except KeyError:
        raise ResponseFormatError(f"output {name!r}: datatype {datatype} is not supported") from None
    try:
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    except ValueError as exc:
        raise ResponseFormatError(f"output {name!r}: {len(data)} bytes do not fit {datatype} {shape}") from exc


def grpc_infer_outputs(body: bytes) -> dict[str, NDArray[Any]]:
    """The outputs of a serialized ModelInferResponse (raw_output_contents, as Triton sends them)."""
    response = service_pb2.ModelInferResponse()
    try:
        response.ParseFromString(body)
    except DecodeError as exc:
        raise ResponseFormatError(f"not a ModelInferResponse: {exc}") from exc
    if len(response.raw_output_contents) != len(response.outputs):
        raise ResponseFormatError(f"{len(response.outputs)} outputs but {len(response.raw_output_contents)} "
                                  "raw contents")
    return {out.name: _tensor(out.name, out.datatype, list(out.shape), data)
            for out, data in zip(response.outputs, response.raw_output_contents, strict=True)}


def _output_fields(out: Any, index: int) -> tuple[str, str, list[int], int | None]:
    """name, datatype, shape and binary size of one output of a JSON header; a garbled field is a format
    error of the answer, never a crash of ours."""
    if not isinstance(out, dict):
        raise ResponseFormatError(f"outputs[{index}] is {type(out).__name__}, expected an object")
    name, datatype, shape = out.get("name"), out.get("datatype"), out.get("shape")
    if not isinstance(name, str) or not isinstance(datatype, str):
        raise ResponseFormatError(f"outputs[{index}]: expected string 'name' and 'datatype'")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise ResponseFormatError(f"output {name!r}: shape {shape!r}, expected a list of non-negative integers")
    params = out.get("parameters") or {}
    size = params.get("binary_data_size") if isinstance(params, dict) else None
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
        raise ResponseFormatError(f"output {name!r}: binary_data_size {size!r}, expected a non-negative integer")
    return name, datatype, shape, size


def http_infer_outputs(body: bytes, header_length: str | None) -> dict[str, NDArray[Any]]:
    """The outputs of an HTTP response: a JSON header (`header_length` bytes, the whole body when None),
    then each binary output's bytes in order (`binary_data_size`); JSON `data` lists are read too."""
    try:
        split = len(body) if header_length is None else int(header_length)
        header = json.loads(body[:split])
        outputs = header["outputs"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ResponseFormatError(f"not an inference response header: {exc}") from exc
    if not isinstance(outputs, list):
        raise ResponseFormatError(f"'outputs' is {type(outputs).__name__}, expected a list")
    arrays, offset = {}, split
    for index, out in enumerate(outputs):
        name, datatype, shape, size = _output_fields(out, index)
        if size is not None:
            if offset + size > len(body):
                raise ResponseFormatError(f"output {name!r}: {size} bytes announced, {len(body) - offset} left")
            arrays[name] = _tensor(name, datatype, shape, body[offset : offset + size])
            offset += size
        else:
            try:
                arrays[name] = np.asarray(out["data"], dtype=numpy_dtype(datatype)).reshape(shape)
            except (KeyError, ValueError, TypeError) as exc:
                raise ResponseFormatError(f"output {name!r}: no binary data and no readable data list") from exc
    return arrays


def grpc_sequence_parameters(sequence_id: int, *, start: bool, end: bool) -> bytes:
    """The serialized `parameters` of a ModelInferRequest that carry a sequence's correlation id and flags.

    Appended to a serialized request they merge into it (protobuf parses concatenated messages as one, map
    entries added), so a payload serialized once is sent as any step of any sequence.
    """
    request = service_pb2.ModelInferRequest()
    request.parameters["sequence_id"].int64_param = sequence_id
    request.parameters["sequence_start"].bool_param = start
    request.parameters["sequence_end"].bool_param = end
    return bytes(request.SerializeToString())


def http_sequence_header(header: bytes, sequence_id: int, *, start: bool, end: bool) -> bytes:
    """A binary-tensor request's JSON header with the sequence's correlation id and flags in its parameters."""
    document = json.loads(header)
    parameters = document.setdefault("parameters", {})
    parameters.update(sequence_id=sequence_id, sequence_start=start, sequence_end=end)
    return json.dumps(document, separators=(",", ":")).encode("ascii")
