"""The INT8 recipe by runtime and model class (issue 22): a transformer encoder gets ONNX Runtime's dynamic
quantization on the CPU, a CNN static per-channel Q/DQ with its depthwise Conv in float, anything else and
every GPU runtime ModelOpt's Q/DQ; chosen from the graph, recorded, and part of the INT8 build key."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from numpy.typing import NDArray

from builder.cli import main
from builder.errors import ManifestError
from builder.pipeline import BuildOptions, build_all
from builder.repository.onnx_files import sha256_file
from builder.runtimes.onnxruntime import OnnxRuntimeCPU, run_file
from builder.runtimes.onnxruntime_cuda import OnnxRuntimeCUDA
from builder.runtimes.tensorrt import TensorRTRuntime
from builder.spec import CalibrationMethod, CalibrationSpec, DataSpec, DimRange, Int8Recipe, ModelSpec, Precision
from builder.spec.enums import Task
from builder.steps import accuracy, int8_recipe, precision
from builder.steps.build_key import int8_key, precision_settings
from builder.steps.guard import quantized_nodes
from builder.steps.int8_recipe import ModelClass
from builder.steps.sensitivity import node_tensors
from tests.helpers.tiny_models import cnn_onnx, cnn_samples, encoder_onnx, encoder_samples, mlp_onnx

CPU = OnnxRuntimeCPU.name
GPU_RUNTIMES = (TensorRTRuntime.name, OnnxRuntimeCUDA.name)


def auto(samples: int = 16) -> CalibrationSpec:
    return CalibrationSpec(DataSpec("unused.npz", samples), method=CalibrationMethod.MAX)


def test_a_transformer_encoder_gets_dynamic_quantization_on_the_cpu_and_modelopts_qdq_elsewhere(
        tmp_path: Path) -> None:
    model = onnx.load(str(encoder_onnx(tmp_path / "encoder.onnx")))
    cpu = int8_recipe.choose(model, Int8Recipe.AUTO, CPU)
    assert (cpu.model_class, cpu.recipe, cpu.chosen) == (ModelClass.TRANSFORMER, Int8Recipe.ONNXRUNTIME_DYNAMIC, True)
    assert "2 activation x activation MatMuls, 1 Softmax" in cpu.why, cpu.why
    for runtime in GPU_RUNTIMES:  # TensorRT needs Q/DQ
        assert int8_recipe.choose(model, Int8Recipe.AUTO, runtime).recipe is Int8Recipe.MODELOPT
    asked = int8_recipe.choose(model, Int8Recipe.MODELOPT, CPU)
    assert asked.recipe is Int8Recipe.MODELOPT and not asked.chosen
    with pytest.raises(ManifestError, match="ONNX Runtime on the CPU only"):
        int8_recipe.choose(model, Int8Recipe.ONNXRUNTIME_DYNAMIC, TensorRTRuntime.name)
    spec = int8_recipe.apply(cpu, auto())
    assert spec.recipe is Int8Recipe.ONNXRUNTIME_DYNAMIC and spec.op_types_to_quantize == ("MatMul", "Gemm")


def test_a_cnn_gets_onnx_runtimes_static_per_channel_recipe_as_asked_for_by_name(tmp_path: Path) -> None:
    # auto's CNN form is the explicit `onnxruntime` recipe's: measured faster on five of six CNNs than Conv/MatMul/
    # Gemm alone with the depthwise Conv in float (docs/results/int8_recipes.md); the user's settings stay.
    model = onnx.load(str(cnn_onnx(tmp_path / "cnn.onnx")))
    choice = int8_recipe.choose(model, Int8Recipe.AUTO, CPU)
    assert (choice.model_class, choice.recipe) == (ModelClass.CNN, Int8Recipe.ONNXRUNTIME)
    assert int8_recipe.apply(choice, auto()) == CalibrationSpec(auto().data, method=auto().method,
                                                                recipe=Int8Recipe.ONNXRUNTIME)
    mine = CalibrationSpec(DataSpec("x.npz", 4), op_types_to_quantize=("Conv",), nodes_to_exclude=("stem",))
    assert int8_recipe.apply(choice, mine) == CalibrationSpec(DataSpec("x.npz", 4), op_types_to_quantize=("Conv",),
                                                              nodes_to_exclude=("stem",), recipe=Int8Recipe.ONNXRUNTIME)
    for runtime in GPU_RUNTIMES:
        assert int8_recipe.choose(model, Int8Recipe.AUTO, runtime).recipe is Int8Recipe.MODELOPT


def test_a_graph_of_neither_class_keeps_modelopts_recipe(tmp_path: Path) -> None:
    choice = int8_recipe.choose(onnx.load(str(mlp_onnx(tmp_path / "mlp.onnx"))), Int8Recipe.AUTO, CPU)
    assert (choice.model_class, choice.recipe) == (ModelClass.OTHER, Int8Recipe.MODELOPT)
    assert "no attention" in choice.why


def test_the_gemm_rewrites_for_onnx_runtimes_quantizers_keep_the_outputs_and_the_names(tmp_path: Path) -> None:
    path = encoder_onnx(tmp_path / "encoder.onnx")
    model = onnx.load(str(path))
    assert int8_recipe.flatten_gemm_bias(model) == 1 and int8_recipe.gemm_as_matmul(model) == 1
    rewritten = tmp_path / "rewritten.onnx"
    onnx.checker.check_model(model)
    onnx.save(model, str(rewritten))
    ops = {n.name: n.op_type for n in model.graph.node}
    assert ops["output"] == "MatMul" and ops["output_bias"] == "Add" and "Gemm" not in ops.values()
    samples = encoder_samples(8)
    before, after = run_file(path, samples, 4), run_file(rewritten, samples, 4)
    np.testing.assert_allclose(after["embedding"], before["embedding"], rtol=1e-5, atol=1e-6)


def int8(path: Path, samples: dict[str, NDArray[Any]], tmp_path: Path, spec: CalibrationSpec,
         runtime: str = CPU) -> precision.CalibrationResult:
    return precision.to_int8(path, fp32_sha=sha256_file(path), calibration=samples, data_digest="t", spec=spec,
                             out_path=tmp_path / "int8.onnx", cache_dir=tmp_path / "cache", what="model 'm'",
                             runtime=runtime, log_file=None)


def test_auto_int8_of_an_encoder_on_the_cpu_is_dynamic_said_once_and_recorded(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = encoder_onnx(tmp_path / "encoder.onnx")
    with caplog.at_level(logging.INFO, logger="builder"):
        result = int8(path, encoder_samples(16), tmp_path, auto())
    said = [r.getMessage() for r in caplog.records if "INT8 recipe" in r.getMessage()]
    assert len(said) == 1 and "onnxruntime-dynamic (chosen: transformer encoder" in said[0], said
    assert result.recipe is Int8Recipe.ONNXRUNTIME_DYNAMIC and result.spec is not None
    assert result.settings["tool"] == "onnxruntime.quantization.quantize_dynamic"
    assert result.settings["recipe_choice"] == int8_recipe.choose_for(path, Int8Recipe.AUTO, CPU).record()
    ops = [n.op_type for n in onnx.load(str(tmp_path / "int8.onnx")).graph.node]
    # The four weight MatMuls (the Gemm rewritten as one) run as integer MatMuls; ORT leaves the activation x
    # activation ones in float.
    assert ops.count("MatMulInteger") == 4 and "QuantizeLinear" not in ops and "Gemm" not in ops, ops
    assert result.quantize_linear_nodes == ops.count("DynamicQuantizeLinear") > 0
    samples = encoder_samples(8, seed=1)
    metrics = accuracy.compare(run_file(path, samples, 4), run_file(tmp_path / "int8.onnx", samples, 4), Task.EMBEDDING)
    assert metrics.cosine_min is not None and metrics.cosine_min > 0.99, metrics


def test_the_int8_guard_finds_dynamic_quantizations_nodes_by_their_float_names(tmp_path: Path) -> None:
    """The guard excludes nodes by the FP32 graph's names and ranks them by the tensors both graphs have: dynamic
    quantization replaces a MatMul by MatMulInteger named `<name>_quant`, whose scale Mul writes the output."""
    path = encoder_onnx(tmp_path / "encoder.onnx")
    int8(path, encoder_samples(16), tmp_path, auto())
    quantized = onnx.load(str(tmp_path / "int8.onnx"))
    nodes = quantized_nodes(quantized)
    assert sorted(nodes) == ["key", "output", "query", "value"], nodes
    paired = node_tensors(onnx.load(str(path)), quantized, nodes)
    assert set(paired) == set(nodes) and all(t.outputs for t in paired.values())
    # Excluding one by that name leaves it in float.
    spec = int8_recipe.apply(int8_recipe.choose_for(path, Int8Recipe.AUTO, CPU), auto())
    int8(path, encoder_samples(16), tmp_path, CalibrationSpec(spec.data, recipe=spec.recipe,
                                                               op_types_to_quantize=spec.op_types_to_quantize,
                                                               nodes_to_exclude=("output",)))
    ops = {n.name: n.op_type for n in onnx.load(str(tmp_path / "int8.onnx")).graph.node}
    assert ops["output"] == "MatMul" and "output_quant" not in ops


def test_auto_int8_of_a_cnn_on_the_cpu_is_static_per_channel_qdq_on_every_conv(tmp_path: Path) -> None:
    """Also a Gemm with a [1, N] bias, on which ONNX Runtime 1.31's per-channel quantizer fails unless the bias
    is made 1-D first."""
    path = cnn_onnx(tmp_path / "cnn.onnx")
    result = int8(path, cnn_samples(16), tmp_path, auto())
    assert result.recipe is Int8Recipe.ONNXRUNTIME and "instead_of" not in result.settings, result.settings
    assert result.spec is not None and result.spec.nodes_to_exclude == ()
    graph = onnx.load(str(tmp_path / "int8.onnx")).graph
    dequantized = {n.output[0] for n in graph.node if n.op_type == "DequantizeLinear"}
    fed = {n.name for n in graph.node if n.op_type in ("Conv", "Gemm") and any(i in dequantized for i in n.input)}
    assert {"stem", "depthwise", "pointwise", "classifier"} <= fed, fed
    weights = {i.name: i.data_type for i in graph.initializer}
    assert "w2" not in weights and onnx.TensorProto.INT8 in weights.values()  # the depthwise weight quantized too


@pytest.mark.parametrize("recipe", [Int8Recipe.AUTO, Int8Recipe.ONNXRUNTIME])
def test_onnx_runtimes_per_channel_recipe_takes_a_graph_below_opset_13(tmp_path: Path, recipe: Int8Recipe) -> None:
    # DequantizeLinear's `axis` came with opset 13: ONNX Runtime's quantizer wrote it into PP-OCR's opset 11/12
    # graphs as they were, and the INT8 variant failed the ONNX checker ("Unrecognized attribute: axis").
    path = cnn_onnx(tmp_path / "cnn.onnx")
    model = onnx.load(str(path))
    del model.opset_import[:]
    model.opset_import.append(onnx.helper.make_opsetid("", 11))
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    samples = cnn_samples(16)
    result = int8(path, samples, tmp_path, replace_recipe(auto(), recipe))
    assert result.recipe is Int8Recipe.ONNXRUNTIME and "instead_of" not in result.settings, result.settings
    quantized = onnx.load(str(tmp_path / "int8.onnx"))
    onnx.checker.check_model(quantized, full_check=True)
    assert {o.domain or "ai.onnx": o.version for o in quantized.opset_import}["ai.onnx"] >= 13
    assert any(n.op_type == "DequantizeLinear" for n in quantized.graph.node)
    found = accuracy.compare(run_file(path, samples, 4), run_file(tmp_path / "int8.onnx", samples, 4),
                             Task.CLASSIFICATION)
    assert found.cosine_min > 0.9, found


def replace_recipe(spec: CalibrationSpec, recipe: Int8Recipe) -> CalibrationSpec:
    return CalibrationSpec(spec.data, method=spec.method, recipe=recipe)


def test_the_int8_build_key_holds_the_recipe_the_graph_and_runtime_decide(tmp_path: Path) -> None:
    path = encoder_onnx(tmp_path / "encoder.onnx")
    spec = ModelSpec(name="m", onnx=path, batch=DimRange(1, 4, 8), precisions=(Precision.FP32, Precision.INT8),
                     calibration=auto())
    cpu, gpu = int8_key(spec, path, CPU), int8_key(spec, path, TensorRTRuntime.name)
    assert cpu == {"recipe": "onnxruntime-dynamic", "class": "transformer", "as_given": False}
    assert gpu is not None and gpu["recipe"] == "modelopt"
    assert precision_settings(spec, Precision.INT8, cpu) != precision_settings(spec, Precision.INT8, gpu)
    assert precision_settings(spec, Precision.FP32, cpu) == precision_settings(spec, Precision.FP32, gpu)


def test_a_build_records_the_chosen_recipe_in_build_json_and_the_build_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRTBUILD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TRTBUILD_NO_SPEED", "1")
    encoder_onnx(tmp_path / "encoder.onnx")
    np.savez(tmp_path / "cal.npz", **encoder_samples(32))
    # The CPU runtime named: on a GPU host auto picks ONNX Runtime CUDA, whose recipe is ModelOpt's Q/DQ.
    code = main(["build", "-q", "--onnx", "encoder.onnx", "--name", "enc", "--precision", "fp32,int8",
                 "--calibration", "cal.npz", "--task", "embedding", "--repository", "repo", "--log", "build.log",
                 "--runtime", "onnxruntime"])
    assert code == 0
    record = json.loads((tmp_path / "repo" / "enc_int8" / "build.json").read_text())
    choice = record["precision_settings"]["recipe_choice"]
    assert choice["recipe"] == "onnxruntime-dynamic" and choice["class"] == "transformer", choice
    assert record["inputs"]["settings"]["int8_recipe"]["recipe"] == "onnxruntime-dynamic"
    logged = [ln for ln in (tmp_path / "build.log").read_text().splitlines() if "INT8 recipe" in ln]
    assert len(logged) == 1 and "transformer encoder" in logged[0], logged


@pytest.mark.parametrize(("origin", "setting"), [("build flags", "--int8-recipe"),
                                                 ("models.toml entry", "calibration.recipe")])
def test_dynamic_quantization_asked_for_a_gpu_runtime_is_refused_before_any_model_is_built(
        tmp_path: Path, origin: str, setting: str) -> None:
    # Found mid-build it stopped every variant of the model with a line naming neither; now one line up front,
    # naming the model and the setting, and nothing is written (another model in the same build included).
    path = encoder_onnx(tmp_path / "encoder.onnx")
    dynamic = CalibrationSpec(DataSpec("unused.npz", 16), recipe=Int8Recipe.ONNXRUNTIME_DYNAMIC)
    specs = [ModelSpec(name="plain", onnx=path, batch=DimRange(1, 4, 8), precisions=(Precision.FP32,)),
             ModelSpec(name="enc", onnx=path, batch=DimRange(1, 4, 8), precisions=(Precision.FP32, Precision.INT8),
                       calibration=dynamic)]
    class NamedCuda(OnnxRuntimeCPU):  # the check reads the runtime's name only; this host may have no GPU
        name = OnnxRuntimeCUDA.name

    options = BuildOptions(repository=tmp_path / "repo", runtime=NamedCuda(), cache_dir=tmp_path / "cache",
                           spec_origin=origin)
    with pytest.raises(ManifestError) as raised:
        build_all(specs, options, tmp_path / "report.json", ["pytest"])
    line = str(raised.value)
    assert "\n" not in line and line.startswith("model 'enc': ") and f"{setting} 'onnxruntime-dynamic'" in line
    assert OnnxRuntimeCUDA.name in line and "auto" in line
    assert not (tmp_path / "repo").exists() or not any((tmp_path / "repo").iterdir())
    assert not (tmp_path / "report.json").exists()


def test_a_chosen_recipe_whose_graph_the_onnx_checker_refuses_falls_back_to_modelopt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # ONNX Runtime's quantizer wrote silero VAD's If subgraphs out of order ("Nodes in a graph must be
    # topologically sorted"): the INT8 variant failed at the checker instead of trying ModelOpt's recipe.
    path = cnn_onnx(tmp_path / "cnn.onnx")

    def unsorted(fp32_path: Path, calibration: Any, spec: CalibrationSpec, tmp: Path, out: Path,
                 runtime: str) -> None:
        model = onnx.load(str(fp32_path))
        nodes = list(model.graph.node)
        del model.graph.node[:]
        model.graph.node.extend(reversed(nodes))
        onnx.save(model, str(out))

    monkeypatch.setattr(precision, "_quantize_ort", unsorted)
    with caplog.at_level(logging.WARNING, logger="builder"):
        result = int8(path, cnn_samples(16), tmp_path, auto())
    assert result.recipe is Int8Recipe.MODELOPT
    assert result.settings["instead_of"] == "onnxruntime.quantization.quantize_static"
    assert "ONNX checker refuses" in result.settings["why"] and "topologically sorted" in result.settings["why"]
    (line,) = [r.getMessage() for r in caplog.records if "instead" in r.getMessage()]
    assert "\n" not in line and "ModelOpt's recipe instead" in line, line
    onnx.checker.check_model(onnx.load(str(tmp_path / "int8.onnx")))
