"""What the INT8 guard tells the user when no INT8 mix meets the tolerance."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from builder.pipeline import BuildOptions, build_all
from builder.runtimes.onnxruntime import OnnxRuntimeCPU
from builder.spec import CalibrationSpec, DataSpec, DimRange, ModelSpec, Precision, Task, Tolerance
from tests.helpers.tiny_models import mlp_samples, outlier_mlp_onnx


def test_the_fallback_warning_names_the_model_not_a_temporary_file(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    onnx_path = outlier_mlp_onnx(tmp_path / "outlier.onnx")
    np.savez(tmp_path / "cal.npz", **mlp_samples(64, seed=0))
    np.savez(tmp_path / "eval.npz", **mlp_samples(32, seed=1))
    spec = ModelSpec(
        name="outlier", onnx=onnx_path, task=Task.CLASSIFICATION, batch=DimRange(1, 4, 8),
        precisions=(Precision.INT8,), calibration=CalibrationSpec(DataSpec(str(tmp_path / "cal.npz"), 64)),
        evaluation=DataSpec(str(tmp_path / "eval.npz"), 32),
        tolerances={Precision.INT8: Tolerance(cosine_min=0.9999)},  # no INT8 mix gets there: FP16 is served
    )
    options = BuildOptions(repository=tmp_path / "repo", runtime=OnnxRuntimeCPU(), cache_dir=tmp_path / "cache")
    with caplog.at_level(logging.WARNING, logger="builder"):
        build_all([spec], options, None, ["pytest"])
    (line,) = [r.getMessage() for r in caplog.records if "serving the FP16 model" in r.getMessage()]
    assert line.startswith("model 'outlier': no INT8 mix meets the tolerance"), line
    assert ".onnx" not in line, line
