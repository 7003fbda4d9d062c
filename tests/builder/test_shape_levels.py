"""Without the user's data, every variant is measured on synthetic samples at the min and max shapes as
well as the opt shape: a variant that is wrong only at the edge of its range fails the gate."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from builder.pipeline import BuildOptions, ModelStatus, build_all
from builder.runtimes.base import Outputs
from builder.runtimes.onnxruntime import OnnxRuntimeCPU
from builder.spec import DataSpec, DimRange, ModelSpec, Precision
from builder.spec.shapes import ShapeRange
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


def test_with_the_user_s_data_only_that_data_is_measured(tmp_path: Path) -> None:
    model = detector(tmp_path)
    spec = _spec(tmp_path)
    evaluation = tmp_path / "eval.npz"
    np.savez(evaluation, images=np.load(model.calibration)["images"])
    options = BuildOptions(repository=tmp_path / "repo", runtime=_WrongAtTheMaxShape(), cache_dir=tmp_path / "cache")
    (result,) = build_all([replace(spec, evaluation=DataSpec(str(evaluation), 16))], options, None, ["pytest"])
    assert not result.failures  # the user's samples are 96x96: the max shape is not among them
    record = json.loads((tmp_path / "repo" / "det_fp32" / "build.json").read_text())
    assert record["accuracy"]["samples"] == 16
