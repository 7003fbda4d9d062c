import pytest
from google.protobuf import json_format

from builder.errors import BuilderError
from builder.manifest import DimRange, ServingSpec, TensorSpec
from builder.triton_config import ConfigInputs, build, parse, preferred_batch_sizes, to_text

CFG = ConfigInputs(
    name="enc_int8",
    inputs=(TensorSpec("input_ids", "int64", (-1, "seq")), TensorSpec("pixels", "float32", (-1, 3, 8, 8))),
    outputs=(TensorSpec("emb", "float32", (-1, 384)),),
    batch=DimRange(1, 8, 32),
    serving=ServingSpec(instances=2, max_queue_delay_us=500, ort_intra_op_threads=1),
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
    cfg = ConfigInputs(**{**CFG.__dict__, "backend": "onnxruntime",
                          "serving": ServingSpec(dynamic_batching=False)})
    doc = json_format.MessageToDict(build(cfg), preserving_proto_field_name=True)
    assert doc["platform"] == "onnxruntime_onnx" and "backend" not in doc
    assert "dynamic_batching" not in doc
    with pytest.raises(BuilderError, match="--serving-backend 'tensorflow'"):
        build(ConfigInputs(**{**CFG.__dict__, "backend": "tensorflow"}))


def test_preferred_batch_sizes_never_exceed_the_range() -> None:
    assert preferred_batch_sizes(DimRange(1, 1, 1)) == []
    assert preferred_batch_sizes(DimRange(1, 4, 4)) == [4]
