"""TensorRT decisions that need no TensorRT: profiles, plan names, caches, staleness, configs."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from google.protobuf import json_format

from builder.errors import ManifestError, RuntimeUnavailableError
from builder.repository.triton_config import (
    BackendConfig,
    ConfigInputs,
    InstanceKind,
    TritonBackend,
    build,
    parse,
    to_text,
)
from builder.runtimes import cuda_available, select, tensorrt_available
from builder.runtimes.tensorrt_plan import (
    HardwareCompatibility,
    PlanMetadata,
    TrtBuildOptions,
    cc_model_filenames,
    plan_filename,
    profile_shapes,
    stale_reasons,
    timing_cache_name,
    warmup_inputs,
)
from builder.spec import DimRange, RuntimeChoice, ServingSpec, TensorSpec
from builder.spec.shapes import ModelShapes, ShapeRange, resolve

INPUTS = (TensorSpec("input_ids", "int64", (-1, "seq")), TensorSpec("pixels", "float32", (-1, 3, 8, 8)))


def _shapes(dims: dict[str, DimRange], **given: ShapeRange) -> ModelShapes:
    return resolve(INPUTS, batch=DimRange(1, 8, 32), batch_given=not given, dims=dims, shapes=given, what="m")


def test_profile_takes_the_batch_range_and_named_dim_ranges() -> None:
    profile = profile_shapes(_shapes({"seq": DimRange(4, 64, 128)}))
    assert profile.shapes["input_ids"] == ((1, 4), (8, 64), (32, 128))
    assert profile.shapes["pixels"] == ((1, 3, 8, 8), (8, 3, 8, 8), (32, 3, 8, 8))
    assert profile.max_batch == 32
    with pytest.raises(ManifestError, match=r"input 'input_ids' \[\?, 'seq'\] axis 1 \('seq'\) is dynamic and has "
                                            r"no range; expected --shapes input_ids:DxD"):
        _shapes({})


def test_profile_takes_per_input_shapes_as_given() -> None:
    ids = ShapeRange((2, 4), (4, 16), (8, 32), "--opt-shapes")
    profile = profile_shapes(_shapes({}, input_ids=ids))
    assert profile.shapes["input_ids"] == ((2, 4), (4, 16), (8, 32))
    assert profile.shapes["pixels"] == ((2, 3, 8, 8), (4, 3, 8, 8), (8, 3, 8, 8))  # the batch follows the shapes
    assert profile.max_batch == 8


def test_a_model_that_does_not_batch_has_whole_shapes_and_no_max_batch() -> None:
    inputs = (TensorSpec("state", "float32", (2, "batch", 128)), TensorSpec("sr", "int64", ()))
    shapes = resolve(inputs, batch=DimRange(1, 8, 16), dims={"batch": DimRange(1, 1, 1)}, shapes={}, what="m")
    profile = profile_shapes(shapes)
    assert profile.shapes == {"state": ((2, 1, 128),) * 3, "sr": ((), (), ())}
    assert profile.max_batch is None
    (warm,) = warmup_inputs(inputs, profile)
    assert warm["batch_size"] == 1
    assert warm["inputs"]["state"]["dims"] == [2, 1, 128] and warm["inputs"]["sr"]["dims"] == [1]


def test_plan_names_per_compute_capability_and_cc_model_filenames() -> None:
    assert plan_filename(9, 0) == "model.sm90.plan"
    assert plan_filename(8, 9) == "model.sm89.plan"
    files = ["model.sm90.plan", "model.sm90.plan.json", "model.sm80.plan", "model.sm120.plan", "notes.txt"]
    assert cc_model_filenames(files) == {"8.0": "model.sm80.plan", "9.0": "model.sm90.plan",
                                         "12.0": "model.sm120.plan"}


def test_timing_cache_is_keyed_by_gpu_capability_and_tensorrt_version() -> None:
    h100 = timing_cache_name("NVIDIA H100 80GB HBM3", 9, 0, "10.13.0.35")
    assert h100 == "timing-NVIDIA-H100-80GB-HBM3-sm90-trt10.13.0.35.cache"
    assert timing_cache_name("NVIDIA H200", 9, 0, "10.13.0.35") != h100
    assert timing_cache_name("NVIDIA H100 80GB HBM3", 9, 0, "11.0.0") != h100


def metadata(**changes: Any) -> PlanMetadata:
    base = PlanMetadata("10.13.0", "NVIDIA H200", "9.0", "580.159.04", "a" * 64,
                        {"workspace_mib": 4096, "optimization_level": 3}, {"x": [[1, 4], [8, 4], [16, 4]]})
    return replace(base, **changes)


def test_staleness_names_every_difference_and_nothing_when_equal() -> None:
    assert stale_reasons(metadata(), metadata()) == []
    assert stale_reasons(None, metadata()) == ["no plan with metadata present"]
    assert stale_reasons(metadata(tensorrt_version="10.8.0"), metadata()) == ["TensorRT version 10.8.0 -> 10.13.0"]
    assert stale_reasons(metadata(gpu_name="NVIDIA H100"), metadata()) == ["GPU NVIDIA H100 -> NVIDIA H200"]
    assert stale_reasons(metadata(driver="570.1"), metadata()) == ["driver 570.1 -> 580.159.04"]
    assert stale_reasons(metadata(compute_capability="8.0"), metadata()) == ["compute capability 8.0 -> 9.0"]
    changed = ["input ONNX changed (bbbbbbbbbbbb -> aaaaaaaaaaaa)"]
    assert stale_reasons(metadata(onnx_sha256="b" * 64), metadata()) == changed
    opts = metadata(build_options={"workspace_mib": 1024, "optimization_level": 3})
    assert stale_reasons(opts, metadata()) == ["build options changed (workspace_mib)"]
    both = stale_reasons(metadata(tensorrt_version="10.8.0", driver="570.1"), metadata())
    assert len(both) == 2
    assert PlanMetadata.from_json(json.loads(json.dumps(metadata().to_json()))) == metadata()
    assert PlanMetadata.from_json({"tensorrt_version": "x"}) is None


def test_build_options_are_validated() -> None:
    TrtBuildOptions().check()
    with pytest.raises(ManifestError, match="--trt-optimization-level 7"):
        TrtBuildOptions(optimization_level=7).check()
    with pytest.raises(ManifestError, match="--trt-hardware-compatibility 'turing': expected one of none, "):
        HardwareCompatibility.parse("turing", "--trt-hardware-compatibility", error=ManifestError)
    assert TrtBuildOptions(hardware_compatibility=HardwareCompatibility.AMPERE_PLUS).to_json()[
        "hardware_compatibility"] == "ampere_plus"
    with pytest.raises(ManifestError, match="--trt-workspace-mib 0"):
        TrtBuildOptions(workspace_mib=0).check()


def test_tensorrt_config_round_trips_with_graphs_warmup_and_per_gpu_plans() -> None:
    profile = profile_shapes(_shapes({"seq": DimRange(4, 64, 128)}))
    cfg = ConfigInputs(
        name="enc_int8", inputs=INPUTS, outputs=(TensorSpec("emb", "float32", (-1, 384)),),
        batch=DimRange(1, 8, 32), serving=ServingSpec(max_queue_delay_us=100),
        backend=BackendConfig(
            TritonBackend.TENSORRT, "model.sm90.plan", InstanceKind.GPU, max_batch=profile.max_batch,
            cuda_graphs=True, warmup=tuple(warmup_inputs(INPUTS, profile)),
            cc_model_filenames=(("8.0", "model.sm80.plan"), ("9.0", "model.sm90.plan")),
        ),
    )
    config = build(cfg)
    assert parse(to_text(config)) == config
    doc = json_format.MessageToDict(config, preserving_proto_field_name=True)
    assert doc["platform"] == "tensorrt_plan" and "backend" not in doc
    assert doc["default_model_filename"] == "model.sm90.plan"
    assert doc["cc_model_filenames"] == {"8.0": "model.sm80.plan", "9.0": "model.sm90.plan"}
    assert doc["instance_group"][0]["kind"] == "KIND_GPU"
    assert doc["optimization"]["cuda"]["graphs"] is True
    assert doc["max_batch_size"] == 32 and doc["dynamic_batching"]["preferred_batch_size"] == [8, 32]
    (warm,) = doc["model_warmup"]
    assert warm["batch_size"] == 8
    assert warm["inputs"]["input_ids"] == {"data_type": "TYPE_INT64", "dims": ["64"], "random_data": True}
    assert "parameters" not in doc


def test_asking_for_tensorrt_where_it_is_missing_says_how_to_install_it() -> None:
    if tensorrt_available():
        pytest.skip("TensorRT is available here")
    with pytest.raises(RuntimeUnavailableError, match=r"pip install '\.\[tensorrt\]'.*NGC Triton container"):
        select(RuntimeChoice.TENSORRT)
    # auto falls back to ONNX Runtime: its CUDA provider on a GPU host, else the CPU
    assert select(RuntimeChoice.AUTO).name == ("onnxruntime-cuda" if cuda_available() else "onnxruntime")
