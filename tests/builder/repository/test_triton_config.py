from dataclasses import replace
from pathlib import Path

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
from builder.spec.shapes import ShapeRange, resolve

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
    assert "platform" not in doc and "default_model_filename" not in doc  # the python backend's model is model.py
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


def test_per_input_shapes_give_dims_minus_one_only_where_the_range_is_dynamic() -> None:
    for ids, dims in (((1, 16), (4, 16), (4, 16)), ["16"]), (((1, 8), (4, 16), (4, 32)), ["-1"]):
        shapes = resolve(CFG.inputs, batch=DimRange(1, 8, 32), batch_given=False, dims={}, what="m",
                         shapes={"input_ids": ShapeRange(*ids)})
        doc = json_format.MessageToDict(build(ConfigInputs(**{**CFG.__dict__, "shapes": shapes})),
                                        preserving_proto_field_name=True)
        assert doc["max_batch_size"] == 4  # the shapes' axis 0, not CFG.batch
        assert doc["input"][0]["dims"] == dims and doc["input"][1]["dims"] == ["3", "8", "8"]
        assert doc["dynamic_batching"]["preferred_batch_size"] == [4]


def test_a_model_that_does_not_batch_gets_max_batch_size_0_whole_dims_and_no_batcher() -> None:
    inputs = (TensorSpec("input", "float32", ("batch", "sequence")), TensorSpec("state", "float32", (2, "batch", 128)),
              TensorSpec("sr", "int64", ()))
    outputs = (TensorSpec("output", "float32", ("batch", 1)), TensorSpec("stateN", "float32", (2, "batch", 128)))
    shapes = resolve(inputs, batch=DimRange(1, 8, 16), dims={}, what="m", shapes={
        "input": ShapeRange((1, 256), (1, 512), (1, 1024)), "state": ShapeRange.fixed((2, 1, 128))})
    assert not shapes.batching and shapes.reason is not None and "'state'" in shapes.reason
    cfg = ConfigInputs(name="vad_fp32", inputs=inputs, outputs=outputs, batch=DimRange(1, 8, 16),
                       serving=ServingSpec(), backend=PYTHON, shapes=shapes)
    config = build(cfg)
    assert parse(to_text(config)) == config
    doc = json_format.MessageToDict(config, preserving_proto_field_name=True)
    assert doc.get("max_batch_size", 0) == 0 and "dynamic_batching" not in doc
    assert [i["dims"] for i in doc["input"]] == [["1", "-1"], ["2", "1", "128"], ["1"]]
    assert "reshape" not in doc["input"][2]  # Triton refuses scalars without batching: the runner reshapes
    assert doc["parameters"]["scalar_inputs"]["string_value"] == "sr"
    assert [o["dims"] for o in doc["output"]] == [["-1", "1"], ["2", "-1", "128"]]


def test_fine_batch_buckets_reach_the_cuda_runner_only(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from builder.runtimes.onnxruntime_cuda import CudaOptions, cuda_backend_config
    from builder.spec import load_manifest

    path = tmp_path / "models.toml"
    body = '[[model]]\nname = "m"\nonnx = "m.onnx"\n[model.serving]\nbatch_buckets = "{value}"\n'
    path.write_text(body.format(value="fine"))
    (spec,) = load_manifest(path)
    cuda = cuda_backend_config(ServingBackend.PYTHON, CudaOptions())

    def params(serving: ServingSpec, backend: BackendConfig) -> dict[str, str]:
        config = build(replace(CFG, serving=serving, backend=backend))
        return {k: v.string_value for k, v in config.parameters.items()}

    assert params(spec.serving, cuda)["batch_buckets"] == "fine"
    assert "batch_buckets" not in params(ServingSpec(), cuda)  # pow2: the runner's default, nothing written
    assert not caplog.records
    assert "batch_buckets" not in params(spec.serving, PYTHON)  # the CPU runner has no buckets: said once
    assert [r.getMessage() for r in caplog.records] == [
        "enc_int8: batch_buckets = fine applies to the python runner on CUDA only; this variant runs without buckets"]
    native = cuda_backend_config(ServingBackend.ONNXRUNTIME, CudaOptions())
    assert "batch_buckets" not in params(spec.serving, native)
    for backend, platform in ((cuda, ""), (PYTHON, ""), (native, "onnxruntime_onnx")):
        config = build(replace(CFG, serving=spec.serving, backend=backend))
        assert config.platform == platform and config.backend == ("python" if not platform else "")
    path.write_text(body.format(value="fin"))
    with pytest.raises(ManifestError, match=r"model\[0\]\.serving\.batch_buckets: expected one of pow2, fine.*"
                                            r"did you mean fine\?"):
        load_manifest(path)


def test_fine_batch_buckets_change_nothing_else_in_any_backends_config(caplog: pytest.LogCaptureFixture) -> None:
    from builder.runtimes.onnxruntime_cuda import CudaOptions, cuda_backend_config

    backends = {"python-cpu": (PYTHON, "", "python"),
                "python-cuda": (cuda_backend_config(ServingBackend.PYTHON, CudaOptions()), "", "python"),
                "onnxruntime": (cuda_backend_config(ServingBackend.ONNXRUNTIME, CudaOptions()), "onnxruntime_onnx", ""),
                "tensorrt": (BackendConfig(TritonBackend.TENSORRT, "model.plan"), "tensorrt_plan", "")}
    for name, (backend, platform, python) in backends.items():
        pow2 = build(replace(CFG, backend=backend))
        fine = build(replace(CFG, backend=backend, serving=replace(CFG.serving, batch_buckets="fine")))
        assert (fine.platform, fine.backend) == (platform, python), name
        if "batch_buckets" in fine.parameters:
            assert name == "python-cuda" and fine.parameters["batch_buckets"].string_value == "fine"
            del fine.parameters["batch_buckets"]
        assert fine == pow2, name
    assert len([r for r in caplog.records if "applies to the python runner on CUDA only" in r.getMessage()]) == 3
