"""The INFO lines a build prints about what it rebuilds: one per model, however many variants."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from builder.pipeline import BuildOptions, build_all
from builder.runtimes.onnxruntime import OnnxRuntimeCPU
from builder.spec import DimRange, ModelSpec, Precision
from tests.helpers.tiny_models import mlp_onnx


def test_a_fresh_build_says_why_it_rebuilds_in_one_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    spec = ModelSpec(name="mlp", onnx=mlp_onnx(tmp_path / "mlp.onnx"), batch=DimRange(1, 4, 8),
                     precisions=(Precision.FP32, Precision.FP16))
    options = BuildOptions(repository=tmp_path / "repo", runtime=OnnxRuntimeCPU(), cache_dir=tmp_path / "cache")
    with caplog.at_level(logging.INFO, logger="builder.pipeline"):
        build_all([spec], options, None, ["pytest"])
    lines = [r.getMessage() for r in caplog.records if "rebuilding" in r.getMessage()]
    assert lines == ["mlp: rebuilding: mlp_fp32, mlp_fp16 not built yet"], lines
