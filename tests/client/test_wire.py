"""client.wire: the request bytes we send, pinned against Triton's schema and tritonclient's own builders.

If a tritonclient upgrade changes either wire format (or removes the private builders compared
against here), these tests fail, not a benchmark on a server.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray
from tritonclient.grpc import service_pb2

from client.wire import (
    HTTP_HEADER_LENGTH,
    ResponseFormatError,
    ShmLayout,
    ShmRef,
    grpc_infer_request,
    http_error_message,
    http_infer_outputs,
    http_infer_request,
)

RNG = np.random.default_rng(0)
CASES: dict[str, dict[str, NDArray[Any]]] = {
    "one fp32": {"x": RNG.standard_normal((2, 4, 32)).astype(np.float32)},
    "mixed dtypes": {
        "ids": RNG.integers(0, 50, size=(3, 12)).astype(np.int64),
        "mask": RNG.random((3, 12)) < 0.5,
        "half": RNG.standard_normal((3, 5)).astype(np.float16),
        "small": RNG.integers(-128, 127, size=(3, 1)).astype(np.int8),
    },
    "non-contiguous view": {"x": RNG.standard_normal((8, 6)).astype(np.float32)[:, ::2]},
    "scalar per sample": {"x": np.arange(4, dtype=np.int32)},
}


@pytest.mark.parametrize("arrays", CASES.values(), ids=CASES.keys())
def test_grpc_bytes_parse_back_as_the_request_we_mean(arrays: dict[str, NDArray[Any]]) -> None:
    request = service_pb2.ModelInferRequest.FromString(grpc_infer_request("m", arrays))
    assert request.model_name == "m" and request.model_version == "" and not request.outputs
    assert [t.name for t in request.inputs] == list(arrays)
    for tensor, raw, (name, array) in zip(request.inputs, request.raw_input_contents, arrays.items(), strict=True):
        assert list(tensor.shape) == list(array.shape)
        decoded = np.frombuffer(raw, dtype=array.dtype).reshape(array.shape)
        np.testing.assert_array_equal(decoded, array, err_msg=name)
    assert {t.datatype for t in request.inputs} <= {"FP32", "INT64", "BOOL", "FP16", "INT8", "INT32"}


@pytest.mark.parametrize("arrays", CASES.values(), ids=CASES.keys())
def test_grpc_bytes_equal_tritonclients_own(arrays: dict[str, NDArray[Any]]) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.grpc._utils import _get_inference_request  # private: compared against here only

    inputs = []
    for name, array in arrays.items():
        item = grpcclient.InferInput(name, list(array.shape), _datatype(array))
        item.set_data_from_numpy(np.ascontiguousarray(array))
        inputs.append(item)
    theirs = _get_inference_request("m", inputs, "", "", None, 0, False, False, 0, None, None)
    assert grpc_infer_request("m", arrays) == theirs.SerializeToString()


@pytest.mark.parametrize("arrays", CASES.values(), ids=CASES.keys())
def test_http_body_is_a_json_header_then_each_tensors_bytes(arrays: dict[str, NDArray[Any]]) -> None:
    body, headers = http_infer_request(arrays)
    size = int(headers[HTTP_HEADER_LENGTH])
    header = json.loads(body[:size])
    assert header["parameters"] == {"binary_data_output": True}
    offset = size
    for tensor, (name, array) in zip(header["inputs"], arrays.items(), strict=True):
        assert tensor["name"] == name and tensor["shape"] == list(array.shape)
        length = tensor["parameters"]["binary_data_size"]
        decoded = np.frombuffer(body[offset : offset + length], dtype=array.dtype).reshape(array.shape)
        np.testing.assert_array_equal(decoded, array)
        offset += length
    assert offset == len(body)


@pytest.mark.parametrize("arrays", CASES.values(), ids=CASES.keys())
def test_http_body_equals_tritonclients_own(arrays: dict[str, NDArray[Any]]) -> None:
    import tritonclient.http as httpclient
    from tritonclient.http._utils import _get_inference_request  # private: compared against here only

    inputs = []
    for name, array in arrays.items():
        item = httpclient.InferInput(name, list(array.shape), _datatype(array))
        item.set_data_from_numpy(np.ascontiguousarray(array), binary_data=True)
        inputs.append(item)
    body, json_size = _get_inference_request(inputs, "", None, 0, False, False, 0, None, None)
    ours, headers = http_infer_request(arrays)
    assert ours == body and headers[HTTP_HEADER_LENGTH] == str(json_size)


def test_http_error_message_is_the_servers_reason() -> None:
    assert http_error_message(400, b'{"error":"unexpected shape for input \'x\'"}') == \
        "HTTP 400: unexpected shape for input 'x'"
    assert http_error_message(502, b"<html>bad gateway</html>") == "HTTP 502: <html>bad gateway</html>"


def _datatype(array: NDArray[Any]) -> str:
    from tritonclient.utils import np_to_triton_dtype  # tritonclient's own table, independent of ours

    return str(np_to_triton_dtype(array.dtype))


def test_http_requests_ask_for_uncompressed_answers() -> None:
    # Triton gzips its answers when asked (aiohttp asks by default): work perf_analyzer never requests.
    _, headers = http_infer_request({"x": np.zeros((1, 4), np.float32)})
    assert headers["Accept-Encoding"] == "identity"


SHM_ARRAYS = CASES["mixed dtypes"]
SHM_LAYOUT = ShmLayout(
    inputs={name: ShmRef(f"in_{name}", array.nbytes, offset=64 if name == "half" else 0)
            for name, array in SHM_ARRAYS.items()},
    outputs={"y": ShmRef("out_y", 4096), "z": ShmRef("out_z", 128, offset=16)},
)


def _tritonclient_shm_io(client: Any) -> tuple[list[Any], list[Any]]:
    """SHM_LAYOUT's inputs and requested outputs built with tritonclient's own classes (its grpc or http
    module: both have InferInput/InferRequestedOutput with set_shared_memory)."""
    inputs = []
    for name, array in SHM_ARRAYS.items():
        item = client.InferInput(name, list(array.shape), _datatype(array))
        ref = SHM_LAYOUT.inputs[name]
        item.set_shared_memory(ref.region, ref.byte_size, ref.offset)
        inputs.append(item)
    outputs = []
    for name, ref in SHM_LAYOUT.outputs.items():
        output = client.InferRequestedOutput(name)
        output.set_shared_memory(ref.region, ref.byte_size, ref.offset)
        outputs.append(output)
    return inputs, outputs


def test_grpc_shared_memory_request_equals_tritonclients_own() -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.grpc._utils import _get_inference_request  # private: compared against here only

    inputs, outputs = _tritonclient_shm_io(grpcclient)
    theirs = _get_inference_request("m", inputs, "", "", outputs, 0, False, False, 0, None, None)
    ours = service_pb2.ModelInferRequest.FromString(grpc_infer_request("m", SHM_ARRAYS, SHM_LAYOUT))
    assert not ours.raw_input_contents  # no tensor bytes travel with the request
    assert ours == theirs


def test_http_shared_memory_request_equals_tritonclients_own() -> None:
    import tritonclient.http as httpclient
    from tritonclient.http._utils import _get_inference_request  # private: compared against here only

    inputs, outputs = _tritonclient_shm_io(httpclient)
    body, _ = _get_inference_request(inputs, "", outputs, 0, False, False, 0, None, None)
    ours, headers = http_infer_request(SHM_ARRAYS, SHM_LAYOUT)
    assert int(headers[HTTP_HEADER_LENGTH]) == len(ours)  # the JSON header is the whole body
    mine, theirs = json.loads(ours), json.loads(body)
    # tritonclient asks for binary outputs per output; outputs in shared memory carry no data either way.
    assert mine["inputs"] == theirs["inputs"]
    assert [(o["name"], o["parameters"]) for o in mine["outputs"]] == \
        [(o["name"], {k: v for k, v in o["parameters"].items() if k != "binary_data"}) for o in theirs["outputs"]]


def _answer(outputs: Any, tail: bytes = b"") -> tuple[bytes, str]:
    header = json.dumps({"model_name": "m", "outputs": outputs}).encode()
    return header + tail, str(len(header))


def test_an_http_answer_decodes_into_its_outputs() -> None:
    data = np.arange(6, dtype=np.float32)
    body, length = _answer([{"name": "y", "datatype": "FP32", "shape": [2, 3],
                             "parameters": {"binary_data_size": data.nbytes}},
                            {"name": "z", "datatype": "INT64", "shape": [2], "data": [7, 8]}], data.tobytes())
    got = http_infer_outputs(body, length)
    np.testing.assert_array_equal(got["y"], data.reshape(2, 3))
    np.testing.assert_array_equal(got["z"], np.array([7, 8]))


@pytest.mark.parametrize(("outputs", "tail", "message"), [
    ({"y": 1}, b"", "expected a list"),
    (["y"], b"", r"outputs\[0\] is str"),
    ([{"datatype": "FP32", "shape": [1]}], b"", "expected string 'name'"),
    ([{"name": "y", "datatype": "FP32", "shape": "1"}], b"", "shape '1'"),
    ([{"name": "y", "datatype": "FP32", "shape": [-1]}], b"", "non-negative"),
    ([{"name": "y", "datatype": "FP32", "shape": [1], "parameters": {"binary_data_size": "4"}}], b"\0" * 4,
     "binary_data_size '4'"),
    ([{"name": "y", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}}], b"\0" * 4,
     "8 bytes announced, 4 left"),
    ([{"name": "y", "datatype": "FP32", "shape": [2], "data": [[1], "x"]}], b"", "no readable data list"),
])
def test_a_garbled_http_answer_is_a_format_error_naming_what_is_wrong(outputs: Any, tail: bytes, message: str) -> None:
    body, length = _answer(outputs, tail)
    with pytest.raises(ResponseFormatError, match=message):
        http_infer_outputs(body, length)
