"""Each variant step alone over a hand-made context, and the Runtime seam carrying what is
runtime-specific (artifact name, Triton backend, the artifact's own batch limit) into the config."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from builder.errors import AccuracyError
from builder.repository import onnx_files
from builder.repository.triton_config import BackendConfig, TritonBackend, parse
from builder.runtimes.base import CompileTarget
from builder.runtimes.onnxruntime import OnnxRuntimeCPU, OnnxRuntimeReference, run_file
from builder.spec import DimRange, ModelSpec, Precision, Task, Tolerance
from builder.steps import onnx_model
from builder.steps.accuracy import Metrics
from builder.steps.context import ModelContext, VariantContext
from builder.steps.results import VariantResult
from builder.steps.variant import Compile, Gate, MakePrecision, Measure, WriteModelFolder, build_variant
from tests.helpers.tiny_models import mlp_onnx, mlp_samples


def model_context(tmp_path: Path, tolerances: dict[Precision, Tolerance] | None = None) -> ModelContext:
    fp32 = mlp_onnx(tmp_path / "reference.onnx")
    spec = ModelSpec(name="m", onnx=fp32, task=Task.CLASSIFICATION, batch=DimRange(1, 4, 8),
                     precisions=(Precision.FP32, Precision.FP16), tolerances=tolerances or {})
    evaluation = mlp_samples(16, seed=3)
    return ModelContext(
        spec=spec, fp32_path=fp32, fp32_sha=onnx_files.sha256_file(fp32),
        signature=onnx_model.signature(onnx_files.load(fp32), "m"), evaluation=evaluation, calibration=None,
        calibration_digest=None, reference=run_file(fp32, evaluation, 8), build_key="k" * 64,
        inputs_record={"tools": {"builder": "test"}}, work=tmp_path, cache_dir=tmp_path / "cache",
        repository=tmp_path / "repository", executor=OnnxRuntimeReference(),
    )


def variant(tmp_path: Path, precision: Precision, runtime: OnnxRuntimeCPU | None = None,
            tolerances: dict[Precision, Tolerance] | None = None) -> VariantContext:
    return VariantContext(model_context(tmp_path, tolerances), precision, runtime or OnnxRuntimeCPU(),
                          tmp_path / "staged" / f"m_{precision.value}")


def test_make_precision_fp16_computes_in_half_with_float_inputs_and_outputs(tmp_path: Path) -> None:
    ctx = variant(tmp_path, Precision.FP16)
    MakePrecision().run(ctx)
    graph = onnx.load(str(ctx.variant_onnx)).graph
    assert ctx.variant_onnx.name == "fp16.onnx" and ctx.settings["keep_io_types"] is True
    assert graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert any(init.data_type == onnx.TensorProto.FLOAT16 for init in graph.initializer)


def test_compile_then_measure_an_fp32_variant_matches_the_reference_exactly(tmp_path: Path) -> None:
    ctx = variant(tmp_path, Precision.FP32)
    MakePrecision().run(ctx)
    Compile().run(ctx)
    assert ctx.artifact == ctx.version_dir / "model.onnx"
    assert ctx.artifact.read_bytes() == ctx.variant_onnx.read_bytes()
    assert ctx.variant_sha == onnx_files.sha256_file(ctx.variant_onnx)
    Measure().run(ctx)
    assert ctx.metrics is not None and ctx.metrics.max_abs == 0.0 and ctx.metrics.top1_agreement == 1.0


def test_gate_passes_within_the_tolerance_and_names_the_metric_outside_it(tmp_path: Path) -> None:
    ctx = variant(tmp_path, Precision.FP32, tolerances={Precision.FP32: Tolerance(max_abs=1e-9)})
    ctx.metrics = Metrics(max_abs=1e-3, max_rel=1e-4, cosine_min=0.9999, cosine_mean=0.9999, samples=16,
                          top1_agreement=1.0)
    with pytest.raises(AccuracyError, match=r"m_fp32: max_abs = 0.001 is above the limit max_abs = 1e-09") as caught:
        Gate().run(ctx)
    assert ctx.guard is None and ctx.fp16_guard is None  # only FP16 and INT8 variants are guarded
    found = caught.value.violation
    assert found is not None and (found.metric, found.value, found.limit) == ("max_abs", 1e-3, 1e-9)
    Gate().run(_with_metrics(ctx, max_abs=0.0))  # within every limit: no error


def test_gate_does_not_guard_a_limit_on_a_metric_the_task_does_not_give(tmp_path: Path) -> None:
    # top1_agreement needs a classifier: no FP16 mix can meet it, so no guard search runs.
    ctx = variant(tmp_path, Precision.FP16, tolerances={Precision.FP16: Tolerance(top1_agreement_min=0.9)})
    ctx.metrics = Metrics(max_abs=1e-3, max_rel=1e-4, cosine_min=0.9999, cosine_mean=0.9999, samples=16)
    with pytest.raises(AccuracyError, match=r"m_fp16: tolerance top1_agreement_min needs metric top1_agreement"):
        Gate().run(ctx)
    assert ctx.fp16_guard is None and not (tmp_path / "fp16_guard").exists()


def _with_metrics(ctx: VariantContext, *, max_abs: float) -> VariantContext:
    ctx.metrics = Metrics(max_abs=max_abs, max_rel=0.0, cosine_min=1.0, cosine_mean=1.0, samples=16)
    return ctx


def test_write_model_folder_writes_config_runner_and_record(tmp_path: Path) -> None:
    ctx = variant(tmp_path, Precision.FP32)
    for step in (MakePrecision(), Compile(), Measure()):
        step.run(ctx)
    result = VariantResult.of(ctx)
    WriteModelFolder(result).run(ctx)
    config = parse((ctx.model_dir / "config.pbtxt").read_text())
    assert config.name == "m_fp32" and config.backend == "python" and config.max_batch_size == 8
    assert (ctx.version_dir / "model.py").read_text().startswith('"""Triton python-backend model')
    record = json.loads((ctx.model_dir / "build.json").read_text())
    assert record["build_key"] == "k" * 64 and record["precision"] == "fp32"
    assert record["sha256"] == onnx_files.sha256_file(ctx.artifact) and record["accuracy"]["max_abs"] == 0.0
    assert record["accuracy"]["top1_agreement"] == 1.0


class NativeBackendRuntime(OnnxRuntimeCPU):
    """A runtime whose artifact has another name and a batch limit of its own."""

    artifact = "graph.onnx"

    def backend_config(self, target: CompileTarget, version_dir: Path) -> BackendConfig:
        return BackendConfig(TritonBackend.ONNXRUNTIME, self.artifact, max_batch=4)


def test_what_is_runtime_specific_reaches_the_config_only_through_the_runtime(tmp_path: Path) -> None:
    ctx = variant(tmp_path, Precision.FP32, runtime=NativeBackendRuntime())
    result = build_variant(ctx)
    assert result.artifact == "m_fp32/1/graph.onnx" and (ctx.version_dir / "graph.onnx").is_file()
    config = parse((ctx.model_dir / "config.pbtxt").read_text())
    assert config.platform == "onnxruntime_onnx" and config.default_model_filename == "graph.onnx"
    assert config.max_batch_size == 4  # the artifact's limit, below the spec's batch max of 8
    assert list(config.dynamic_batching.preferred_batch_size) == [4]
    assert not (ctx.version_dir / "model.py").exists()  # no python runner for a native backend
    assert np.isclose(result.accuracy.cosine_min, 1.0)
