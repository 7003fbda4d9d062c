"""The reference-executor seam (runtimes.base.ReferenceExecutor): the steps run the FP32 reference and the
candidates they compare with it through the executor the build is given, not ONNX Runtime directly."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from builder.errors import OnnxModelError
from builder.pipeline import BuildOptions, build_all
from builder.repository import onnx_files
from builder.runtimes.base import Outputs
from builder.runtimes.onnxruntime import OnnxRuntimeCPU, OnnxRuntimeReference
from builder.spec import DataSpec, DimRange, ModelSpec, Precision, Task, Tolerance
from builder.spec.shapes import for_model
from builder.steps import onnx_model
from tests.helpers.tiny_models import mlp_onnx, mlp_samples

SHIFT = 0.25


class ShiftedReference:
    """ONNX Runtime's outputs plus SHIFT, and the files it was asked to run: a reference the served variant
    (run by the runtime, not by this) can only match within SHIFT."""

    name = "shifted"
    errors = OnnxRuntimeReference.errors

    def __init__(self) -> None:
        self.ran: list[str] = []

    def run(self, path: Path, samples: Mapping[str, NDArray[Any]], batch_size: int | None) -> Outputs:
        self.ran.append(path.name)
        return {k: v + SHIFT for k, v in OnnxRuntimeReference().run(path, samples, batch_size).items()}

    def throughput(self, path: Path, feed: Mapping[str, NDArray[Any]], *, seconds: float = 1.0) -> float:
        raise AssertionError("no guard runs here")


def test_the_gate_measures_the_variant_against_the_executors_reference(tmp_path: Path) -> None:
    np.savez(tmp_path / "eval.npz", **mlp_samples(16, seed=1))
    spec = ModelSpec(name="m", onnx=mlp_onnx(tmp_path / "m.onnx"), task=Task.CLASSIFICATION, batch=DimRange(1, 4, 8),
                     precisions=(Precision.FP32,), evaluation=DataSpec(str(tmp_path / "eval.npz"), 16),
                     tolerances={Precision.FP32: Tolerance(max_abs=1.0)})
    executor = ShiftedReference()
    options = BuildOptions(repository=tmp_path / "repo", runtime=OnnxRuntimeCPU(), cache_dir=tmp_path / "cache",
                           executor=executor, speed_meter=None)
    (result,) = build_all([spec], options, None, ["pytest"])
    (variant,) = result.variants
    # The served FP32 artifact is the reference graph itself: every difference is the fake's shift.
    assert variant.accuracy.max_abs == pytest.approx(SHIFT, rel=1e-5)
    assert variant.accuracy.top1_agreement == 1.0  # a shift of every logit keeps the argmax
    # The reference and the clean-up's comparison both ran through it.
    assert "reference.onnx" in executor.ran and "reference.slim.onnx" in executor.ran


class Refusing:
    """An executor that refuses every graph with its own error type."""

    class Refused(Exception):
        pass

    name = "refusing"
    errors: tuple[type[Exception], ...] = (Refused,)

    def run(self, path: Path, samples: Mapping[str, NDArray[Any]], batch_size: int | None) -> Outputs:
        raise self.Refused(f"cannot run {path.name}")

    def throughput(self, path: Path, feed: Mapping[str, NDArray[Any]], *, seconds: float = 1.0) -> float:
        raise self.Refused(f"cannot run {path.name}")


def test_a_graph_the_executor_refuses_is_one_line_naming_the_shapes(tmp_path: Path) -> None:
    # The executor's own error types are what the steps take as "the user's graph does not run".
    path = mlp_onnx(tmp_path / "m.onnx")
    spec = ModelSpec(name="m", onnx=path, batch=DimRange(1, 4, 8), precisions=(Precision.FP32,))
    sig = onnx_model.signature(onnx_files.load(path), "m")
    shapes = for_model(spec, sig.inputs, "model 'm'")
    with pytest.raises(OnnxModelError, match=r"model 'm': the FP32 model does not run at the min shapes .*cannot"):
        onnx_model.check_runs_at_levels(path, sig.inputs, shapes, "model 'm'", executor=Refusing())
    with pytest.raises(OnnxModelError, match=r"does not run on the evaluation samples \(x \[2, 4, 32\]\)"):
        onnx_model.run_fp32(path, mlp_samples(2), 2, "model 'm'", executor=Refusing())
