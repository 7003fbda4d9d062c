"""Without the user's data, every variant is measured on synthetic samples at the min and max shapes as
well as the opt shape: a variant that is wrong only at the edge of its range fails the gate."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from numpy.typing import NDArray
from onnx import TensorProto, helper, numpy_helper

from builder.pipeline import BuildOptions, ModelStatus, build_all
from builder.runtimes.base import Outputs
from builder.runtimes.onnxruntime import OnnxRuntimeCPU
from builder.spec import DataSpec, DimRange, ModelSpec, Precision
from builder.spec.model import TensorSpec
from builder.spec.shapes import ShapeRange
from builder.steps import samples
from tests.helpers.foreign_models import detector


class _WrongAtTheMaxShape(OnnxRuntimeCPU):
    """ONNX Runtime, except that the artifact's outputs are off by half for 128x128 images (the max shape),
    as a runtime's kernel chosen for one shape might be."""

    def run(self, artifact: Path, samples: Mapping[str, NDArray[Any]], batch_size: int | None) -> Outputs:
        outputs = super().run(artifact, samples, batch_size)
        if samples["images"].shape[-1] == 128:
            return {name: value * 1.5 for name, value in outputs.items()}
        return outputs


def _spec(tmp_path: Path) -> ModelSpec:
    return ModelSpec(name="det", onnx=detector(tmp_path).onnx, batch=DimRange(1, 2, 4), batch_given=False,
                     precisions=(Precision.FP32,),
                     shapes={"images": ShapeRange((1, 3, 64, 64), (2, 3, 96, 96), (4, 3, 128, 128))})


def test_without_data_the_gate_measures_at_the_min_opt_and_max_shapes(tmp_path: Path) -> None:
    options = BuildOptions(repository=tmp_path / "repo", runtime=OnnxRuntimeCPU(), cache_dir=tmp_path / "cache")
    (result,) = build_all([_spec(tmp_path)], options, None, ["pytest"])
    assert result.status is ModelStatus.BUILT and not result.failures
    record = json.loads((tmp_path / "repo" / "det_fp32" / "build.json").read_text())
    assert record["accuracy"]["samples"] == 16 + 4 + 4  # opt, then min and max

    wrong = BuildOptions(repository=tmp_path / "repo2", runtime=_WrongAtTheMaxShape(), cache_dir=tmp_path / "cache")
    (result,) = build_all([_spec(tmp_path)], wrong, None, ["pytest"])
    (failure,) = result.failures
    assert failure.variant == "det_fp32" and failure.metric == "max_rel"
    assert failure.value is not None and failure.value > 0.3
    assert not (tmp_path / "repo2" / "det_fp32").exists()


def test_with_the_user_s_data_at_one_size_the_gate_measures_it_at_the_min_and_max_shapes_too(tmp_path: Path) -> None:
    """The user's 96x96 images (the opt shape) are resized to 64x64 and 128x128: the runtime wrong only at
    the max shape fails the gate, and each level's figures are recorded."""
    model = detector(tmp_path)
    spec = _spec(tmp_path)
    evaluation = tmp_path / "eval.npz"
    np.savez(evaluation, images=np.load(model.calibration)["images"])
    spec = replace(spec, evaluation=DataSpec(str(evaluation), 16))
    options = BuildOptions(repository=tmp_path / "repo", runtime=OnnxRuntimeCPU(), cache_dir=tmp_path / "cache")
    (result,) = build_all([spec], options, None, ["pytest"])
    assert not result.failures
    record = json.loads((tmp_path / "repo" / "det_fp32" / "build.json").read_text())
    assert record["accuracy"]["samples"] == 16 + 4 + 4
    assert {level: figures["samples"] for level, figures in record["accuracy_levels"].items()} == {
        "evaluation": 16, "min": 4, "max": 4}

    wrong = BuildOptions(repository=tmp_path / "repo2", runtime=_WrongAtTheMaxShape(), cache_dir=tmp_path / "cache")
    (result,) = build_all([spec], wrong, None, ["pytest"])
    (failure,) = result.failures
    assert failure.variant == "det_fp32" and failure.metric == "max_rel"


def test_user_images_are_resized_and_other_dims_cropped_or_tiled() -> None:
    images = np.linspace(0, 1, 2 * 3 * 4 * 4, dtype=np.float32).reshape(2, 3, 4, 4)
    tokens = np.array([[5, 9, 7]], dtype=np.int64).repeat(2, axis=0)
    inputs = (TensorSpec("images", "float32", ("b", 3, "h", "w")), TensorSpec("ids", "int64", ("b", "seq")))
    out = samples.at_shapes({"images": images, "ids": tokens}, inputs,
                            {"images": (3, 8, 2), "ids": (6,)}, count=2, seed=0)
    assert out["images"].shape == (2, 3, 8, 2) and out["images"].dtype == np.float32
    assert out["images"].min() >= images.min() and out["images"].max() <= images.max()
    assert np.allclose(out["images"].mean(axis=(2, 3)), images.mean(axis=(2, 3)), atol=0.05)
    assert out["ids"].shape == (2, 6) and out["ids"].dtype == np.int64
    assert out["ids"].tolist() == [[5, 9, 7, 5, 9, 7]] * 2  # tiled: the user's tokens, not random ones
    # Cropped, and every input sharing the dim alike: token ids and their mask stay paired.
    mask = np.array([[1, 1, 0]], dtype=np.int64).repeat(2, axis=0)
    inputs2 = (TensorSpec("ids", "int64", ("b", "seq")), TensorSpec("mask", "int64", ("b", "seq")))
    short = samples.at_shapes({"ids": tokens, "mask": mask}, inputs2, {"ids": (2,), "mask": (2,)}, count=2, seed=0)
    assert short["ids"].tolist() == [[5, 9]] * 2 and short["mask"].tolist() == [[1, 1]] * 2


def _positional(folder: Path) -> Path:
    """x[b, 1, h, w] → x * P[:h, :w] - x * Q[:h, :w]: positional tables that FP16 holds exactly within 16x16
    (1.25 and 0) and not beyond (1000.25 and 1000 both round to 1000): its FP16 error grows with the size."""
    p = np.full((1, 1, 256, 256), 1000.25, np.float32)
    q = np.full((1, 1, 256, 256), 1000.0, np.float32)
    p[..., :16, :16], q[..., :16, :16] = 1.25, 0.0
    ints = {"two": [2], "four": [4], "zeros": [0, 0], "axes": [2, 3]}
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Slice", ["shape", "two", "four"], ["hw"]),
             helper.make_node("Slice", ["p", "zeros", "hw", "axes"], ["ps"]),
             helper.make_node("Slice", ["q", "zeros", "hw", "axes"], ["qs"]),
             helper.make_node("Mul", ["x", "ps"], ["a"]),
             helper.make_node("Mul", ["x", "qs"], ["b"]),
             helper.make_node("Sub", ["a", "b"], ["out"])]
    graph = helper.make_graph(
        nodes, "positional", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 1, "h", "w"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["b", 1, "h", "w"])],
        initializer=[numpy_helper.from_array(p, "p"), numpy_helper.from_array(q, "q"),
                     *(numpy_helper.from_array(np.array(v, np.int64), k) for k, v in ints.items())])
    path = folder / "positional.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return path


def test_an_fp16_error_that_grows_with_the_size_fails_the_gate_at_the_max_shape(tmp_path: Path) -> None:
    """Evaluation data at 16x16 only: FP16 is exact there, wrong at the max shape (256x256). Before the gate
    measured the min and max shapes with the user's data, this FP16 variant was built and served."""
    evaluation = tmp_path / "eval.npz"
    np.savez(evaluation, x=np.random.default_rng(0).uniform(0, 1, (16, 1, 16, 16)).astype(np.float32))
    spec = ModelSpec(name="pos", onnx=_positional(tmp_path), batch=DimRange(1, 2, 4), batch_given=False,
                     precisions=(Precision.FP32, Precision.FP16), guard=False,
                     shapes={"x": ShapeRange((1, 1, 8, 8), (2, 1, 16, 16), (4, 1, 256, 256))},
                     evaluation=DataSpec(str(evaluation), 16))
    options = BuildOptions(repository=tmp_path / "repo", runtime=OnnxRuntimeCPU(), cache_dir=tmp_path / "cache")
    (result,) = build_all([spec], options, None, ["pytest"])
    (failure,) = result.failures
    assert failure.variant == "pos_fp16" and failure.metric == "cosine_min"
    assert failure.value is not None and failure.value < 0.9
    assert not (tmp_path / "repo" / "pos_fp16").exists()
    record = json.loads((tmp_path / "repo" / "pos_fp32" / "build.json").read_text())
    assert set(record["accuracy_levels"]) == {"evaluation", "min", "max"}
