import pytest
from google.protobuf import json_format

from builder.errors import ManifestError
from builder.repository.triton_config import (
    BackendConfig,
    ConfigInputs,
    TritonBackend,
    build,
    parse,
    preferred_batch_sizes,
    to_text,
)
from builder.spec import DimRange, ServingBackend, ServingSpec, TensorSpec

PYTHON = BackendConfig(TritonBackend.PYTHON, "model.onnx")

CFG = ConfigInputs(
    name="enc_int8",
    inputs=(TensorSpec("input_ids", "int64", (-1, "seq")), TensorSpec("pixels", "float32", (-1, 3, 8, 8))),
    outputs=(TensorSpec("emb", "float32", (-1, 384)),),
    batch=DimRange(1, 8, 32),
    serving=ServingSpec(instances=2, max_queue_delay_us=500, ort_intra_op_threads=1),
    backend=PYTHON,
)


def test_config_round_trips_through_tritons_schema() -> None:
    config = build(CFG)
    text = to_text(config)
    again = parse(text)
    assert again == config
    doc = json_format.MessageToDict(again, preserving_proto_field_name=True)
    assert doc["max_batch_size"] == 32
    assert doc["backend"] == "python"
    assert doc["input"][0] == {"name": "input_ids", "data_type": "TYPE_INT64", "dims": ["-1"]}
    assert doc["input"][1]["dims"] == ["3", "8", "8"]
    assert doc["output"][0]["data_type"] == "TYPE_FP32"
    assert doc["dynamic_batching"] == {"preferred_batch_size": [8, 32], "max_queue_delay_microseconds": "500"}
    assert doc["instance_group"] == [{"count": 2, "kind": "KIND_CPU"}]
    assert doc["parameters"]["intra_op_threads"]["string_value"] == "1"


def test_native_onnxruntime_backend_and_no_batching() -> None:
    backend = BackendConfig(TritonBackend.serving(ServingBackend.ONNXRUNTIME), "model.onnx")
    cfg = ConfigInputs(**{**CFG.__dict__, "backend": backend, "serving": ServingSpec(dynamic_batching=False)})
    doc = json_format.MessageToDict(build(cfg), preserving_proto_field_name=True)
    assert doc["platform"] == "onnxruntime_onnx" and "backend" not in doc
    assert doc["default_model_filename"] == "model.onnx"
    assert "dynamic_batching" not in doc
    with pytest.raises(ManifestError, match="--serving-backend 'tensorflow': expected one of python, onnxruntime"):
        ServingBackend.parse("tensorflow", "--serving-backend", error=ManifestError)


def test_the_artifacts_own_batch_limit_bounds_max_batch_and_preferred_sizes() -> None:
    limited = BackendConfig(TritonBackend.PYTHON, "model.onnx", max_batch=6)
    doc = json_format.MessageToDict(build(ConfigInputs(**{**CFG.__dict__, "backend": limited})),
                                    preserving_proto_field_name=True)
    assert doc["max_batch_size"] == 6
    assert doc["dynamic_batching"]["preferred_batch_size"] == [6]


def test_preferred_batch_sizes_never_exceed_the_range() -> None:
    assert preferred_batch_sizes(DimRange(1, 1, 1), 1) == []
    assert preferred_batch_sizes(DimRange(1, 4, 4), 4) == [4]
    assert preferred_batch_sizes(DimRange(1, 8, 32), 4) == [4]
