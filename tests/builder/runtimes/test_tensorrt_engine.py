"""Real TensorRT engines for every precision (run only where TensorRT and an NVIDIA GPU exist)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from builder.pipeline import BuildOptions, build_all
from builder.repository.triton_config import parse
from builder.runtimes import select
from builder.runtimes.tensorrt_plan import TrtBuildOptions
from builder.spec import RuntimeChoice
from tests.helpers.tiny_models import tiny_specs

pytestmark = [pytest.mark.tensorrt, pytest.mark.gpu]


def test_every_precision_builds_serializes_deserializes_and_matches(tmp_path: Path) -> None:
    mlp = tiny_specs(tmp_path)[0]
    runtime = select(RuntimeChoice.TENSORRT, trt_options=TrtBuildOptions(workspace_mib=512),
                     cache_dir=tmp_path / "cache")
    options = BuildOptions(repository=tmp_path / "repo", runtime=runtime, cache_dir=tmp_path / "cache")
    (result,) = build_all([mlp], options, tmp_path / "report.json", ["pytest"])
    assert [v.precision for v in result.variants] == ["fp32", "fp16", "int8"]
    for variant in result.variants:
        folder = tmp_path / "repo" / variant.name
        plan = folder / "1" / runtime.artifact
        assert plan.is_file() and plan.stat().st_size > 0
        meta = json.loads((plan.parent / (plan.name + ".json")).read_text())
        assert meta["onnx_sha256"] and meta["tensorrt_version"]
        config = parse((folder / "config.pbtxt").read_text())
        assert config.platform == "tensorrt_plan" and config.max_batch_size <= mlp.batch.max
        assert variant.accuracy.cosine_min > 0.95  # the engine ran and agrees with FP32 under ORT
    # Same inputs, same GPU and TensorRT: nothing is rebuilt.
    (again,) = build_all([mlp], options, None, ["pytest"])
    assert again.status == "unchanged"
    assert list((tmp_path / "cache" / "tensorrt").glob("timing-*.cache"))
