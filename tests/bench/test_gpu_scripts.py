"""bench/gpu/validate_gpu.py's CPU-side parts: the GPU configs `prepare` writes, and an exit status that
counts every step of a check (a check whose perfclient loads all failed exited 0)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from builder.repository import triton_config
from tests.helpers.scripts import loaded_script
from tests.helpers.tiny_models import mlp_onnx

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "gpu" / "results"


@pytest.fixture(scope="module")
def validate_gpu() -> Iterator[ModuleType]:
    with loaded_script("validate_gpu", ROOT / "bench" / "gpu" / "validate_gpu.py") as module:
        yield module


CPU_CONFIG = """name: "m"
backend: "python"
max_batch_size: 8
input { name: "x" data_type: TYPE_FP32 dims: [4, 32] }
output { name: "logits" data_type: TYPE_FP32 dims: [16] }
instance_group { kind: KIND_CPU count: 2 }
parameters { key: "provider" value { string_value: "cpu" } }
"""


def test_prepare_writes_the_config_the_cuda_runtime_writes(validate_gpu: ModuleType, tmp_path: Path) -> None:
    source = tmp_path / "source"
    (source / "m" / "1").mkdir(parents=True)
    mlp_onnx(source / "m" / "1" / "model.onnx")
    (source / "m" / "config.pbtxt").write_text(CPU_CONFIG)
    validate_gpu.prepare(source, ["m"], tmp_path / "out")
    config = triton_config.parse((tmp_path / "out" / "m" / "config.pbtxt").read_text())
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert [(g.kind, g.count) for g in config.instance_group] == [(config.instance_group[0].KIND_GPU, 2)]
    assert params["provider"] == "cuda" and params["FORCE_CPU_ONLY_INPUT_TENSORS"] == "no"
    assert params["prefer_nhwc"] == "auto" and params["cudnn_conv_algo_search"] == "HEURISTIC"
    runner = (ROOT / "builder" / "repository" / "python_model.py").read_text()
    assert (tmp_path / "out" / "m" / "1" / "model.py").read_text() == runner


def test_a_check_whose_loads_failed_does_not_exit_0(validate_gpu: ModuleType) -> None:
    """The committed H200 check: every answer matched, both perfclient loads died on an import error."""
    doc = json.loads((RESULTS / "2026-11-22-h200-validate-cudashm.json").read_text())
    assert all(r["ok"] for r in doc["answers"]) and [r["rc"] for r in doc["perfclient"]] == [1, 1]
    assert validate_gpu.exit_status(doc) == 2
    assert validate_gpu.exit_status({**doc, "perfclient": []}) == 0
    assert validate_gpu.exit_status({**doc, "perfclient": [], "answers": []}) == 2  # nothing compared
    broken_runner = [{"model": "m", "error": "RuntimeError()"}]
    assert validate_gpu.exit_status({**doc, "perfclient": [], "in_process_runner": broken_runner}) == 2


def test_a_load_without_its_shared_memory_kind_is_refused(validate_gpu: ModuleType) -> None:
    assert validate_gpu.load_arg("efficientnet_lite0_fp16:cuda") == ("efficientnet_lite0_fp16", "cuda")
    for bad in ("efficientnet_lite0_fp16", "m:gpu", ":cuda"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected MODEL:SHM with SHM none, system or cuda"):
            validate_gpu.load_arg(bad)
