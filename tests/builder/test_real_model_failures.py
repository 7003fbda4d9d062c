"""Issue 22: the classes of third-party ONNX that broke `trtbuild build` with a traceback or without a
fallback, as generated look-alikes (tests/helpers/foreign_models.py):

- a CTC recognizer whose declared output [1, seqlen] contradicts the (W/8, 1, classes) it returns: one
  warning line, outputs compared and served as returned;
- a model with If subgraphs on which ModelOpt autocast fails its sanity check: FP16 by onnxconverter-common;
- a Split detector whose converted graph carries stale shape annotations: dropped and inferred again;
- a converted graph ONNX Runtime cannot run: one line naming the model, the variant and the step, the
  traceback in the build log, the other variants written.

Where ModelOpt's own failure on the real model is not reproduced by a small graph, a stand-in makes the tool
fail the same way (its sanity check rejecting the converted graph; annotations at sizes the graph contradicts).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from builder.cli import main
from builder.errors import BuilderError, OnnxModelError, ToolError
from builder.pipeline import BuildOptions, ModelStatus, build_all
from builder.repository import onnx_files
from builder.runtimes.base import CompileTarget
from builder.runtimes.onnxruntime import OnnxRuntimeCPU, run_file
from builder.spec import DataSpec, DimRange, ModelSpec, Precision
from builder.spec.shapes import ShapeRange
from builder.steps import variant
from builder.steps.fp16_fallback import to_fp16_onnxconverter
from tests.builder.test_build_failures import contrib_gelu_onnx
from tests.helpers.foreign_models import control_flow, ctc_recognizer, float_cast, prequantized, split_detector


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRTBUILD_CACHE", str(tmp_path / "cache"))
    return tmp_path


def _output_dims(config: str) -> list[int]:
    block = config[config.index("output {"):]
    block = block[: block.index("}")]
    return [int(line.split(":")[1]) for line in block.splitlines() if line.strip().startswith("dims:")]


def test_a_declared_output_shape_the_graph_contradicts_is_one_warning_line(
        workdir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    model = ctc_recognizer(workdir)
    code = main([*model.build_args(workdir / "repo"), "--precision", "fp32,fp16"])
    err = capfd.readouterr().err
    assert code == 0, err
    notes = [ln for ln in err.splitlines() if "declared" in ln]
    assert notes == ["WARNING builder.pipeline: ctc: output 'probs' is declared [1, 'seqlen'] but the graph returns "
                     "[20, 1, 40]; the build compares and serves what it returns"], err
    assert "Traceback" not in err
    for precision in ("fp32", "fp16"):
        config = (workdir / "repo" / f"ctc_{precision}" / "config.pbtxt").read_text()
        assert _output_dims(config) == [-1, -1, -1]  # rank 3 as returned; no size known for every width
        record = json.loads((workdir / "repo" / f"ctc_{precision}" / "build.json").read_text())
        assert record["accuracy"]["cosine_min"] > 0.99


def _sanity_check_fails_on_converted_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """ModelOpt's autocast checks its converted graph with onnx's checker and, where that fails, raises
    "Sanity Check Failed" (what it did on a voice-activity model with If subgraphs): its checker made to
    reject any graph holding a Cast, i.e. every converted one, and only those."""
    from modelopt.onnx.autocast import precisionconverter

    real = precisionconverter.onnx_utils.check_model

    def check(model: onnx.ModelProto) -> None:
        if any(n.op_type == "Cast" for n in model.graph.node):
            raise onnx.checker.ValidationError("Graph attribute inferencing failed: If subgraph 'wide'")
        real(model)

    monkeypatch.setattr(precisionconverter.onnx_utils, "check_model", check)


def test_autocast_failing_on_if_subgraphs_falls_back_to_onnxconverter_common(
        workdir: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    _sanity_check_fails_on_converted_graphs(monkeypatch)
    model = control_flow(workdir)
    code = main([*model.build_args(workdir / "repo"), "--precision", "fp32,fp16", "--log", "build.log"])
    err = capfd.readouterr().err
    assert code == 0, err
    warned = [ln for ln in err.splitlines() if "onnxconverter-common's instead" in ln]
    assert len(warned) == 1 and "Sanity Check Failed" in warned[0], err
    record = json.loads((workdir / "repo" / "vad_if_fp16" / "build.json").read_text())
    settings = record["precision_settings"]
    assert settings["tool"] == "onnxconverter_common.float16" and settings["keep_io_types"] is True
    assert settings["instead_of"] == "modelopt.onnx.autocast" and "Sanity Check Failed" in settings["why"]
    assert {"If", "Loop", "Scan"} <= set(settings["op_block_list"])
    assert record["accuracy"]["cosine_min"] >= 0.999
    served = onnx.load(str(workdir / "repo" / "vad_if_fp16" / "1" / "model.onnx"))
    assert any(n.op_type == "Cast" for n in served.graph.node)  # FP16 outside the If, FP32 inside


def test_a_fallback_fp16_that_misses_its_tolerance_says_why_no_guard_ran(
        workdir: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """The FP16 guard converts with autocast, which failed on this model: one line saying so, not autocast's
    failure again as if it were the step that failed."""
    _sanity_check_fails_on_converted_graphs(monkeypatch)
    model = control_flow(workdir)
    code = main([*model.build_args(workdir / "repo"), "--precision", "fp32,fp16", "--tolerance", "fp16:max_abs=1e-9"])
    lines = capfd.readouterr().err.splitlines()
    assert code == 1
    assert lines[-1].startswith("trtbuild: error: vad_if_fp16 not written: max_abs = "), lines
    assert lines[-1].endswith("is above the limit max_abs = 1e-09 (no FP16 guard: it converts with ModelOpt "
                              "autocast, which failed on this model)"), lines
    assert (workdir / "repo" / "vad_if_fp32" / "config.pbtxt").is_file()


def test_onnxconverter_common_keeps_if_subgraphs_in_fp32_and_feeds_them_fp32(tmp_path: Path) -> None:
    """Without the FP32 copies of the outer values the subgraphs read, ONNX Runtime refuses the graph
    ("Type parameter (T) of Optype (MatMul) bound to different types")."""
    model = control_flow(tmp_path)
    out = tmp_path / "fp16.onnx"
    to_fp16_onnxconverter(model.onnx, out, what="model 'vad_if'", log_file=None)
    with np.load(model.calibration) as data:
        samples = {k: data[k][:4] for k in data.files}
    reference = run_file(model.onnx, samples, None)
    converted = run_file(out, samples, None)
    for name, value in reference.items():
        assert np.allclose(value, converted[name], atol=2e-2), name
    half = onnx.TensorProto.FLOAT16
    graph = onnx.load(str(out)).graph
    assert any(init.data_type == half for init in graph.initializer) or any(
        n.op_type == "Cast" and n.attribute[0].i == half for n in graph.node)


def _stale(model: onnx.ModelProto, size: int = 7) -> onnx.ModelProto:
    """The converted graph with every shape annotation's dynamic dims fixed at `size`: annotations a tool took
    at one size, which the graph contradicts (ONNX Runtime refuses such a graph: "Can't merge shape info")."""
    for value in model.graph.value_info:
        for dim in value.type.tensor_type.shape.dim:
            if not dim.HasField("dim_value"):
                dim.Clear()
                dim.dim_value = size
    return model


def test_stale_shape_annotations_of_the_fp16_graph_are_dropped_and_inferred_again(
        workdir: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    import modelopt.onnx.autocast as autocast

    real: Callable[..., onnx.ModelProto] = autocast.convert_to_mixed_precision

    def annotating(*args: Any, **kwargs: Any) -> onnx.ModelProto:
        return _stale(real(*args, **kwargs))

    monkeypatch.setattr(autocast, "convert_to_mixed_precision", annotating)
    model = split_detector(workdir)
    code = main([*model.build_args(workdir / "repo"), "--precision", "fp32,fp16"])
    err = capfd.readouterr().err
    assert code == 0, err
    served = onnx.load(str(workdir / "repo" / "split_detector_fp16" / "1" / "model.onnx"))
    fixed = [v.name for v in served.graph.value_info
             if [d.dim_value for d in v.type.tensor_type.shape.dim][:1] == [7]]
    assert not fixed  # none of the stale annotations is left
    for shapes in ((1, 3, 32, 32), (4, 3, 128, 128), (3, 3, 96, 64)):  # min, max, and one between
        feed = {"images": np.random.default_rng(0).uniform(0, 1, shapes).astype(np.float32)}
        preds = run_file(workdir / "repo" / "split_detector_fp16" / "1" / "model.onnx", feed, shapes[0])["preds"]
        assert preds.shape == (shapes[0], 22, shapes[2] * shapes[3] // 16)


class _StaleFp16Artifact(OnnxRuntimeCPU):
    """ONNX Runtime, except that the FP16 artifact is written with stale shape annotations: a converted graph
    ONNX Runtime cannot load (the failure is ONNX Runtime's, inside the accuracy check)."""

    def compile(self, onnx_path: Path, out_path: Path, target: CompileTarget) -> None:
        model = onnx.load(str(onnx_path))
        if not any(n.op_type == "Cast" for n in model.graph.node):
            super().compile(onnx_path, out_path, target)
            return
        onnx_files.save(_stale(onnx.shape_inference.infer_shapes(model)), out_path)


def test_a_converted_graph_onnx_runtime_cannot_run_is_one_line_naming_model_variant_and_step(
        tmp_path: Path) -> None:
    model = split_detector(tmp_path)
    spec = ModelSpec(name="det", onnx=model.onnx, batch=DimRange(1, 2, 4), precisions=(Precision.FP32, Precision.FP16),
                     evaluation=DataSpec(str(model.calibration), 16),
                     shapes={"images": ShapeRange((1, 3, 32, 32), (2, 3, 64, 64), (4, 3, 128, 128))}).check()
    options = BuildOptions(repository=tmp_path / "repo", runtime=_StaleFp16Artifact(), cache_dir=tmp_path / "cache")
    (result,) = build_all([spec], options, None, ["pytest"])
    assert result.status is ModelStatus.BUILT
    assert [v.name for v in result.variants] == ["det_fp32"]
    (failure,) = result.failures
    line = failure.line()
    assert line.startswith("det_fp16 not written: model 'det': det_fp16: accuracy check (running the variant) "
                           "failed: "), line
    assert "\n" not in line and "(full output: " in line
    log_file = Path(line.rsplit("(full output: ", 1)[1].rstrip(")"))
    assert "Traceback" in log_file.read_text()
    assert (tmp_path / "repo" / "det_fp32" / "config.pbtxt").is_file()
    assert not (tmp_path / "repo" / "det_fp16").exists()


class _RenamedFp16Input(OnnxRuntimeCPU):
    """ONNX Runtime, except that the FP16 artifact's input is renamed (as a converter that renamed it would
    leave it): ONNX Runtime's Python layer refuses the feed with a ValueError ("Required inputs ... are
    missing from input feed"), raised inside onnxruntime, not by ONNX Runtime's engine."""

    def compile(self, onnx_path: Path, out_path: Path, target: CompileTarget) -> None:
        model = onnx.load(str(onnx_path))
        if not any(n.op_type == "Cast" for n in model.graph.node):
            super().compile(onnx_path, out_path, target)
            return
        old = model.graph.input[0].name
        model.graph.input[0].name = f"{old}_renamed"
        for node in model.graph.node:
            node.input[:] = [f"{old}_renamed" if name == old else name for name in node.input]
        onnx_files.save(model, out_path)


def test_an_exception_onnx_runtime_raises_in_python_is_one_line_too(tmp_path: Path) -> None:
    model = split_detector(tmp_path)
    spec = ModelSpec(name="det", onnx=model.onnx, batch=DimRange(1, 2, 4), precisions=(Precision.FP32, Precision.FP16),
                     evaluation=DataSpec(str(model.calibration), 16),
                     shapes={"images": ShapeRange((1, 3, 32, 32), (2, 3, 64, 64), (4, 3, 128, 128))}).check()
    options = BuildOptions(repository=tmp_path / "repo", runtime=_RenamedFp16Input(), cache_dir=tmp_path / "cache")
    (result,) = build_all([spec], options, None, ["pytest"])
    assert [v.name for v in result.variants] == ["det_fp32"]
    (failure,) = result.failures
    line = failure.line()
    assert line.startswith("det_fp16 not written: model 'det': det_fp16: accuracy check (running the variant) "
                           "failed: Required inputs (['images_renamed']) are missing"), line


def test_onnxconverter_common_keeps_in_fp32_the_node_onnx_runtime_refuses_mixed(tmp_path: Path) -> None:
    """An exporter's Cast to float before an Add with a weight: the converter makes the weight FP16 and keeps
    the Cast's float, so ONNX Runtime refused the Add ("bound to different types"); the repair keeps that one
    node in FP32 and the graph runs, within FP16's error of the FP32 graph."""
    model = float_cast(tmp_path)
    out = tmp_path / "fp16.onnx"
    settings = to_fp16_onnxconverter(model.onnx, out, what="model 'float_cast'", log_file=None)
    assert settings["node_block_list"] == ["/Add"], settings
    assert settings["fp16_compute_nodes"] == 1  # the MatMul runs in FP16
    with np.load(model.calibration) as data:
        samples = {k: data[k][:4] for k in data.files}
    reference, converted = run_file(model.onnx, samples, 4), run_file(out, samples, 4)
    assert np.allclose(reference["y"], converted["y"], atol=2e-2)
    half = onnx.TensorProto.FLOAT16
    assert any(init.data_type == half for init in onnx.load(str(out)).graph.initializer)  # FP16 is left elsewhere


def test_an_already_quantized_model_keeps_its_own_int8_and_gets_an_fp16_that_runs(
        workdir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A model its exporter quantized (DynamicQuantizeLinear + MatMulInteger, a com.microsoft Gelu): nothing is
    left to calibrate, so the INT8 variant is the model as given, said in one line and recorded; the FP16
    fallback keeps the FP32-only DynamicQuantizeLinear and the custom op in FP32 instead of failing."""
    model = prequantized(workdir)
    code = main([*model.build_args(workdir / "repo"), "--log", "build.log"])
    err = capfd.readouterr().err
    assert code == 0, err
    assert "Traceback" not in err
    said = [ln for ln in err.splitlines() if "already quantized" in ln]
    assert len(said) == 1 and "1 MatMulInteger" in said[0], err
    int8 = json.loads((workdir / "repo" / "prequantized_int8" / "build.json").read_text())
    assert int8["precision_settings"]["as_given"] is True
    fp16 = json.loads((workdir / "repo" / "prequantized_fp16" / "build.json").read_text())["precision_settings"]
    assert {"DynamicQuantizeLinear", "Gelu"} <= set(fp16["op_block_list"]), fp16
    assert fp16["tool"] == "onnxconverter_common.float16"


@pytest.mark.parametrize(("error", "float_head"), [(ToolError, False), (OnnxModelError, False), (OnnxModelError, True)])
def test_an_already_quantized_model_both_fp16_converters_refuse_gets_the_model_as_given_under_the_fp16_name(
        workdir: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        error: type[BuilderError], float_head: bool) -> None:
    """Kokoro's Japanese TTS voice (MatMulInteger, DynamicQuantizeLSTM): autocast and onnxconverter-common both
    failed and the FP16 variant was not written; for a graph its exporter quantized, FP16 is the model as given,
    like its INT8, said in one line and recorded. The last converter's failure is a ToolError, or, where its graph
    converted but does not run (kokoro: "Type parameter (T) of Optype (Mul) bound to different types"), an
    OnnxModelError, which the first fix missed; and a graph quantized only in part (kokoro keeps 26 float MatMul
    beside 148 MatMulInteger), which the second missed."""
    def refused(*_: Any, **__: Any) -> dict[str, object]:
        raise error("model 'prequantized': FP16 conversion (ModelOpt autocast) failed: no; onnxconverter-common's "
                    "FP16 neither: the FP16 graph (fp16.onnx) does not run at the min shapes")

    monkeypatch.setattr(variant, "to_fp16_checked", refused)
    model = prequantized(workdir, float_head=float_head)
    code = main([*model.build_args(workdir / "repo"), "--log", "build.log"])
    err = capfd.readouterr().err
    assert code == 0, err
    said = [ln for ln in err.splitlines() if "FP16 variant is the model as given" in ln]
    assert len(said) == 1 and "already quantized" in said[0], err
    record = json.loads((workdir / "repo" / "prequantized_fp16" / "build.json").read_text())
    assert record["precision_settings"]["as_given"] is True and record["precision_settings"]["fallback"] == "fp32"
    # The same graph as FP32's: FP32 is the one to serve, marked so without measuring the same graph twice.
    assert record["speed"]["worth_serving"] is False and "the model as given" in record["speed"]["reason"]
    assert record["speed"]["throughput"] is None
    assert record["variant_onnx_sha256"] == record["fp32_onnx_sha256"]


def test_fp16_as_given_is_marked_not_worth_serving_where_no_throughput_is_measured(
        workdir: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The mark is the graph's, not a measurement's: on a GPU runtime (whose speed the build does not measure) the
    FP16 variant that is FP32's graph was listed as worth serving (the H200's make test found it). Here the
    measurement is switched off as a GPU runtime leaves it."""
    def refused(*_: Any, **__: Any) -> dict[str, object]:
        raise ToolError("model 'prequantized': FP16 conversion (ModelOpt autocast) failed: no")

    monkeypatch.setattr(variant, "to_fp16_checked", refused)
    monkeypatch.setenv("TRTBUILD_NO_SPEED", "1")
    model = prequantized(workdir, float_head=False)
    code = main([*model.build_args(workdir / "repo"), "--log", "build.log"])
    err = capfd.readouterr().err
    assert code == 0, err
    fp16 = json.loads((workdir / "repo" / "prequantized_fp16" / "build.json").read_text())
    assert fp16["speed"]["worth_serving"] is False and "the model as given" in fp16["speed"]["reason"]
    assert fp16["speed"]["throughput"] is None and fp16["speed"]["ratio"] is None
    assert "prequantized_fp16 not worth serving: the model as given" in err
    fp32 = json.loads((workdir / "repo" / "prequantized_fp32" / "build.json").read_text())
    assert fp32["speed"] is None  # nothing to mark, nothing measured


def test_a_float_model_both_fp16_converters_refuse_still_fails_in_one_line(
        workdir: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*_: Any, **__: Any) -> dict[str, object]:
        raise ToolError("model 'gelu': FP16 conversion (ModelOpt autocast) failed: no; onnxconverter-common's FP16 "
                        "neither: no")

    monkeypatch.setattr(variant, "to_fp16_checked", refused)
    contrib_gelu_onnx(workdir / "gelu.onnx")
    code = main(["build", "-q", "--onnx", "gelu.onnx", "--name", "gelu", "--precision", "fp32,fp16",
                 "--repository", "repo", "--log", "build.log"])
    err = capfd.readouterr().err
    assert code == 1 and "gelu_fp16 not written: model 'gelu': FP16 conversion" in err and "Traceback" not in err
    assert not (workdir / "repo" / "gelu_fp16").exists()


def test_the_fp16_fallback_repairs_an_op_that_takes_no_fp16(workdir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """MatMul → com.microsoft Gelu → MatMul → Celu: autocast fails on the Gelu; onnxconverter-common's graph
    mixes the FP32 Gelu's output with FP16 weights, which ONNX Runtime refuses; the repair keeps the refused
    nodes in FP32, round by round, until the graph loads, and the variant is written with what was kept
    recorded (with no repair round, tests/builder/test_build_failures.py shows the one-line failure)."""
    contrib_gelu_onnx(workdir / "gelu.onnx")
    code = main(["build", "-q", "--onnx", "gelu.onnx", "--name", "gelu", "--precision", "fp32,fp16",
                 "--repository", "repo", "--log", "build.log"])
    assert code == 0, capfd.readouterr().err
    settings = json.loads((workdir / "repo" / "gelu_fp16" / "build.json").read_text())["precision_settings"]
    assert "Gelu" in settings["op_block_list"] and settings["node_block_list"] == ["fc", "fc2"], settings
    # Both MatMuls ended in FP32: said and recorded, not passed off as FP16 compute.
    assert settings["fp16_compute_nodes"] == 0 and settings["compute_nodes"] == 2
    assert "computes in FP32" in capfd.readouterr().err
    assert settings["instead_of"] == "modelopt.onnx.autocast"


def test_the_fp16_repair_names_unnamed_nodes_before_blocking_one(tmp_path: Path) -> None:
    """Exporters leave nodes unnamed; ONNX Runtime then names the refused node '' ("in node ()"), and blocking
    '' made onnxconverter-common fail with an AttributeError (a traceback). The repair names them first."""
    model = float_cast(tmp_path)
    graph = onnx.load(str(model.onnx))
    for node in graph.graph.node:
        node.name = ""
    unnamed = tmp_path / "unnamed.onnx"
    onnx.save(graph, str(unnamed))
    out = tmp_path / "fp16.onnx"
    settings = to_fp16_onnxconverter(unnamed, out, what="model 'float_cast'", log_file=None)
    assert settings["named_nodes"] == 4 and settings["node_block_list"] == ["Add_2"], settings
    with np.load(model.calibration) as data:
        samples = {k: data[k][:4] for k in data.files}
    assert np.allclose(run_file(unnamed, samples, 4)["y"], run_file(out, samples, 4)["y"], atol=2e-2)
