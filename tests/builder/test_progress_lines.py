"""The plain progress lines of a real guarded INT8 build: each long step has its lines, and the steps
inside a loop (a calibration per guard candidate) add none of their own."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from builder.pipeline import BuildOptions, build_all
from builder.runtimes.onnxruntime import OnnxRuntimeCPU
from builder.spec import CalibrationMethod, CalibrationSpec, DataSpec, DimRange, ModelSpec, Precision, Task, Tolerance
from tests.helpers.progress_capture import plain_progress
from tests.helpers.tiny_models import mlp_samples, outlier_mlp_onnx


@pytest.fixture
def plain_lines() -> Iterator[io.StringIO]:
    with plain_progress(interval=3600.0) as stream:
        yield stream


def test_guarded_int8_build_shows_its_steps_once_each(tmp_path: Path, plain_lines: io.StringIO) -> None:
    onnx_path = outlier_mlp_onnx(tmp_path / "outlier.onnx")
    np.savez(tmp_path / "cal.npz", **mlp_samples(64, seed=0))
    np.savez(tmp_path / "eval.npz", **mlp_samples(32, seed=1))
    spec = ModelSpec(
        name="outlier", onnx=onnx_path, task=Task.CLASSIFICATION, batch=DimRange(1, 4, 8),
        precisions=(Precision.INT8,),
        calibration=CalibrationSpec(DataSpec(str(tmp_path / "cal.npz"), 64), method=CalibrationMethod.MAX),
        evaluation=DataSpec(str(tmp_path / "eval.npz"), 32), tolerances={Precision.INT8: Tolerance(cosine_min=0.995)},
    )
    options = BuildOptions(repository=tmp_path / "repo", runtime=OnnxRuntimeCPU(), cache_dir=tmp_path / "cache")
    build_all([spec], options, None, ["pytest"])
    lines = plain_lines.getvalue().splitlines()
    starts = [line for line in lines if line.startswith("[start] ")]
    # The variant, its own calibration, the guard's sensitivity pass (counted) and its search.
    assert "[start] outlier_int8: building" in starts, lines
    assert any(s.startswith("[start] INT8 guard: sensitivity") and s.endswith(" steps)") for s in starts), lines
    assert "[start] INT8 guard: searching the fewest nodes to keep unquantized" in starts, lines
    # One calibration line pair: the plain INT8's. The guard's candidates each calibrate too, inside
    # the sensitivity pass and the search, and say so only through those loops' own lines.
    assert sum(line.startswith("[start] INT8 calibration") for line in lines) == 1, lines
