"""The orchestrator hands each model one context and gets its result back: following a spec through build_all
enters pipeline.py once (build_all) and comes back into it from the steps once (the model's result); the steps
never call back into it (tests/test_layers.py also forbids the import)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

import builder.pipeline
from builder.pipeline import BuildOptions, ModelStatus, build_all
from builder.runtimes.onnxruntime import OnnxRuntimeCPU
from builder.spec import DataSpec, DimRange, ModelSpec, Precision, Task
from tests.helpers.tiny_models import mlp_onnx, mlp_samples

PIPELINE = builder.pipeline.__file__
STEPS = str(Path(PIPELINE).parent / "steps")


def test_each_spec_goes_down_from_the_orchestrator_once_and_comes_back_once(tmp_path: Path) -> None:
    np.savez(tmp_path / "eval.npz", **mlp_samples(8, seed=1))
    specs = [ModelSpec(name=name, onnx=mlp_onnx(tmp_path / f"{name}.onnx"), task=Task.CLASSIFICATION,
                       batch=DimRange(1, 4, 8), precisions=(Precision.FP32,),
                       evaluation=DataSpec(str(tmp_path / "eval.npz"), 8)) for name in ("a", "b")]
    entered: list[str] = []  # pipeline.py functions called from outside pipeline.py
    back_from_steps = 0  # returns from a steps frame straight into a pipeline.py frame

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        nonlocal back_from_steps
        caller = frame.f_back
        if event == "call" and frame.f_code.co_filename == PIPELINE and (
                caller is None or caller.f_code.co_filename != PIPELINE):
            entered.append(frame.f_code.co_name)
        elif (event == "return" and frame.f_code.co_filename.startswith(STEPS) and caller is not None
              and caller.f_code.co_filename == PIPELINE):
            back_from_steps += 1

    options = BuildOptions(repository=tmp_path / "repo", runtime=OnnxRuntimeCPU(), cache_dir=tmp_path / "cache",
                           speed_meter=None)
    sys.setprofile(profile)
    try:
        results = build_all(specs, options, tmp_path / "report.json", ["pytest"])
    finally:
        sys.setprofile(None)
    assert [r.status for r in results] == [ModelStatus.BUILT, ModelStatus.BUILT]
    assert entered == ["build_all"]
    # Each model's result, and once per build the report's tool versions (steps/build_key.tool_versions).
    assert back_from_steps == len(specs) + 1
