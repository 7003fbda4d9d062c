"""The precision step's error contract: a tool's anticipated failure is one line naming a log file
with its full output; anything else keeps its traceback; ModelOpt's logging is left as it was."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from builder.errors import BuilderError, ToolError, tool_cause
from builder.repository.onnx_files import sha256_file
from builder.runtimes.onnxruntime import OnnxRuntimeCPU
from builder.runtimes.onnxruntime_cuda import OnnxRuntimeCUDA
from builder.runtimes.tensorrt import TensorRTRuntime
from builder.spec import CalibrationMethod, CalibrationSpec, DataSpec, Int8Recipe
from builder.steps import precision
from common.logs import active_log_file
from tests.helpers.tiny_models import mlp_onnx, mlp_samples


def concat_with_fixed_tile(path: Path) -> Path:
    """x[batch, 3, H, W] concatenated with a constant [1, 3, 4, 4]: runs only where H = W = 4."""
    tile = numpy_helper.from_array(np.ones((1, 3, 4, 4), np.float32), "tile")
    graph = helper.make_graph(
        [helper.make_node("Concat", ["x", "tile"], ["y"], axis=0)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, "height", "width"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", 3, "height", "width"])],
        initializer=[tile],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def feeds_at(height: int, width: int) -> list[precision.Feed]:
    x = np.random.default_rng(0).standard_normal((8, 3, height, width)).astype(np.float32)
    return precision.autocast_feeds([{"x": x}], 4)


def test_autocast_runs_the_graph_on_the_feeds_given_not_on_its_own_guesses(tmp_path: Path) -> None:
    # Autocast's own random inputs set dynamic dims to 1: this graph runs only where H = W = 4.
    model = concat_with_fixed_tile(tmp_path / "detector.onnx")
    settings = precision.to_fp16(model, tmp_path / "fp16.onnx", feeds=feeds_at(4, 4), what="model 'det'", log_file=None)
    assert settings["data_max"] == precision.FP16_DATA_MAX and settings["nodes_to_exclude"] == []
    assert onnx.load(str(tmp_path / "fp16.onnx")).graph.node


def test_autocast_feeds_are_batches_spread_over_every_set_or_whole_samples() -> None:
    low = {"x": np.zeros((32, 3, 2, 2), np.float32)}
    high = {"x": np.ones((32, 3, 8, 8), np.float32)}
    feeds = precision.autocast_feeds([low, high], 8, limit=4)
    assert [f["x"].shape for f in feeds] == [(8, 3, 2, 2)] * 2 + [(8, 3, 8, 8)] * 2
    whole = precision.autocast_feeds([low], None, limit=3)
    assert [f["x"].shape for f in whole] == [(3, 2, 2)] * 3


def test_a_tool_failure_is_one_line_naming_the_model_the_step_and_a_log(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRTBUILD_CACHE", str(tmp_path / "cache"))
    model = concat_with_fixed_tile(tmp_path / "detector.onnx")
    with pytest.raises(ToolError) as caught:
        precision.to_fp16(model, tmp_path / "fp16.onnx", feeds=feeds_at(8, 8), what="model 'det'", log_file=None)
    message = str(caught.value)
    assert message.startswith("model 'det': FP16 conversion (ModelOpt autocast) failed: Concat node ")
    assert "dimensions must match" in message and "\n" not in message
    assert "\x1b[" not in message  # ONNX Runtime's colour codes stay out of the line
    assert str(model) not in message and "trtbuild-fp16-" not in message  # nor the paths of our files
    log_path = Path(message.rsplit("(full output: ", 1)[1].rstrip(")"))
    assert log_path.parent == tmp_path / "cache" / "logs" and log_path.is_file()
    assert "Traceback" in log_path.read_text()


def test_a_tool_failure_goes_to_the_build_log_it_is_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The build log comes as an argument (BuildOptions -> ModelContext -> the step), not from a global the CLI
    # sets: none is set here, and the output still goes to the given file, which the line names.
    monkeypatch.setenv("TRTBUILD_CACHE", str(tmp_path / "cache"))
    assert active_log_file() is None
    build_log = tmp_path / "build.log"
    build_log.write_text("earlier lines\n", encoding="utf-8")
    model = concat_with_fixed_tile(tmp_path / "detector.onnx")
    with pytest.raises(ToolError) as caught:
        precision.to_fp16(model, tmp_path / "fp16.onnx", feeds=feeds_at(8, 8), what="model 'det'", log_file=build_log)
    assert str(caught.value).endswith(f"(full output: {build_log})")
    text = build_log.read_text(encoding="utf-8")
    assert text.startswith("earlier lines\n") and "fp16 model 'det'" in text and "Traceback" in text
    assert not (tmp_path / "cache" / "logs").exists()  # no file of its own beside it


def test_an_unexpected_exception_keeps_its_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import modelopt.onnx.autocast as autocast

    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("a bug, not a bad model")

    monkeypatch.setattr(autocast, "convert_to_mixed_precision", broken)
    with pytest.raises(KeyError, match="a bug"):
        precision.to_fp16(mlp_onnx(tmp_path / "m.onnx"), tmp_path / "fp16.onnx", feeds=[mlp_samples(4)], what="m",
                          log_file=None)


def test_modelopt_logging_is_restored_after_a_step(tmp_path: Path) -> None:
    import modelopt.onnx  # noqa: F401

    mo_log = logging.getLogger("modelopt.onnx")
    before = (mo_log.propagate, list(mo_log.handlers))
    precision.to_fp16(mlp_onnx(tmp_path / "m.onnx"), tmp_path / "fp16.onnx", feeds=[mlp_samples(4)], what="m",
                      log_file=None)
    assert (mo_log.propagate, list(mo_log.handlers)) == before


def test_a_stuck_quantizer_subprocess_is_stopped_by_its_timeout(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRTBUILD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(precision, "QUANTIZER_TIMEOUT_S", 0.05)
    model = mlp_onnx(tmp_path / "m.onnx")
    spec = CalibrationSpec(DataSpec("x.npz", 8), method=CalibrationMethod.MAX, recipe=Int8Recipe.ONNXRUNTIME)
    with pytest.raises(BuilderError, match=r"did not finish within 0.05 s \(TRTBUILD_QUANTIZER_TIMEOUT_S\)"):
        precision.to_int8(model, fp32_sha=sha256_file(model), calibration=mlp_samples(8), data_digest="d",
                          spec=spec, out_path=tmp_path / "int8.onnx", cache_dir=tmp_path / "cache", log_file=None)
    assert not list(tmp_path.glob("cache/calibration/*.onnx"))  # nothing cached from a failed calibration


def test_onnx_runtime_reasons_keep_their_continuation_lines_and_lose_our_temporary_paths() -> None:
    exc = RuntimeError(
        "\x1b[1;31m[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Got invalid dimensions for input: x for the "
        "following indices\n index: 1 Got: 2 Expected: 8\n Please fix either the inputs/outputs or the model.\x1b[m")
    assert tool_cause(exc) == ("Got invalid dimensions for input: x for the following indices; "
                               "index: 1 Got: 2 Expected: 8")
    temp = Path(tempfile.gettempdir()) / "trtbuild-m-abc" / "reference.onnx"
    assert tool_cause(ValueError(f"Load model from {temp} failed"), hide={temp: "the model"}) == \
        "Load model from the model failed"
    assert tool_cause(ValueError(f"cannot read {temp.parent / 'feeds' / '00001.npz'}")) == "cannot read 00001.npz"


def test_a_value_error_of_our_own_code_is_no_tool_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ValueError, RuntimeError, AssertionError are the tools' way of refusing a model: only when a tool raised
    them. Raised by our code around the call, they are bugs and keep their traceback."""
    monkeypatch.setenv("TRTBUILD_CACHE", str(tmp_path / "cache"))

    def broken(*args: object) -> bool:
        raise ValueError("a bug of ours, not a bad model")

    monkeypatch.setattr(precision, "_whole_samples", broken)
    model = mlp_onnx(tmp_path / "m.onnx")
    spec = CalibrationSpec(DataSpec("x.npz", 8), method=CalibrationMethod.MAX, recipe=Int8Recipe.MODELOPT)
    with pytest.raises(ValueError, match="a bug of ours"):
        precision.to_int8(model, fp32_sha=sha256_file(model), calibration=mlp_samples(8), data_digest="d",
                          spec=spec, out_path=tmp_path / "int8.onnx", cache_dir=tmp_path / "cache", log_file=None)


def test_the_quantizer_subprocess_reports_a_bug_of_its_own_as_a_crash_not_a_tool_failure(tmp_path: Path) -> None:
    job = tmp_path / "job.json"
    job.write_text("not json")  # json's ValueError, raised by our worker's own code: a bug
    proc = subprocess.run([sys.executable, "-m", "builder.steps.precision", str(job)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode not in (0, precision._TOOL_FAILED), proc.stderr
    assert "Traceback" in proc.stderr and "JSONDecodeError" in proc.stderr


_QUANTIZE_STATIC = """
import sys
import numpy as np
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

data = np.load(sys.argv[2])["x"]


class Reader(CalibrationDataReader):
    def __init__(self):
        self.rows = iter([data[i:i + 1] for i in range(len(data))])

    def get_next(self):
        row = next(self.rows, None)
        return None if row is None else {"x": row}


quantize_static(sys.argv[1], sys.argv[3], Reader(), quant_format=QuantFormat.QDQ)
"""


def qdq_onnx(tmp_path: Path) -> Path:
    """The tiny float MLP quantized by onnxruntime.quantization.quantize_static (Q/DQ pairs around its weights and
    activations), in a fresh interpreter: ModelOpt, once another test imported it, patches ORT's quantizer here."""
    float_model, samples, out = mlp_onnx(tmp_path / "float.onnx"), tmp_path / "samples.npz", tmp_path / "qdq.onnx"
    np.savez(samples, **mlp_samples(8))
    subprocess.run([sys.executable, "-c", _QUANTIZE_STATIC, str(float_model), str(samples), str(out)], check=True,
                   capture_output=True, timeout=300)
    return out


def test_a_qdq_model_is_its_own_int8_variant_said_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("TRTBUILD_CACHE", str(tmp_path / "cache"))
    model = qdq_onnx(tmp_path)
    assert precision.already_quantized(tmp_path / "float.onnx") is None
    why = precision.already_quantized(model)
    assert why is not None and why.startswith("Q/DQ: ") and "2 of 2 MatMul take dequantized inputs" in why, why
    spec = CalibrationSpec(DataSpec("x.npz", 8), method=CalibrationMethod.MAX)  # recipe "auto"
    with caplog.at_level(logging.INFO, logger="builder"):
        result = precision.to_int8(model, fp32_sha=sha256_file(model), calibration=mlp_samples(8), data_digest="d",
                                   spec=spec, out_path=tmp_path / "int8.onnx", cache_dir=tmp_path / "cache",
                                   what="model 'qdq'", log_file=None)
    said = [r.getMessage() for r in caplog.records if r.name.startswith("builder")]
    assert len(said) == 1 and "already quantized (Q/DQ: " in said[0] and "as given" in said[0], said
    assert result.settings["as_given"] is True and result.quantize_linear_nodes == 0
    given, written = onnx.load(str(model)).graph, onnx.load(str(tmp_path / "int8.onnx")).graph
    assert [n.op_type for n in written.node] == [n.op_type for n in given.node]


def integer_matmul_onnx(path: Path, float_op: str | None) -> Path:
    """x → DynamicQuantizeLinear → MatMulInteger → Cast, then `float_op` (a float compute op left) or nothing."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             helper.make_node("MatMulInteger", ["xq", "wq", "xz", "wz"], ["yi"], name="mm"),
             helper.make_node("Cast", ["yi"], ["y" if float_op is None else "yf"], to=TensorProto.FLOAT)]
    if float_op == "Einsum":
        nodes.append(helper.make_node("Einsum", ["yf", "w2"], ["y"], equation="ij,jk->ik", name="tail"))
    elif float_op == "FusedMatMul":
        nodes.append(helper.make_node("FusedMatMul", ["yf", "w2"], ["y"], domain="com.microsoft", name="tail"))
    graph = helper.make_graph(
        nodes, "integer",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        initializer=[numpy_helper.from_array(rng.integers(0, 255, (4, 4)).astype(np.uint8), "wq"),
                     numpy_helper.from_array(np.array(128, np.uint8), "wz"),
                     numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "w2")])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    onnx.save(helper.make_model(graph, opset_imports=opsets, ir_version=8), str(path))
    return path


@pytest.mark.parametrize("float_op", ["Einsum", "FusedMatMul"])
def test_an_integer_model_with_a_float_einsum_or_fused_matmul_left_is_not_already_quantized(
        tmp_path: Path, float_op: str) -> None:
    assert precision.already_quantized(integer_matmul_onnx(tmp_path / "int.onnx", None)) == \
        "1 MatMulInteger, no float Conv/MatMul/Gemm left"
    assert precision.already_quantized(integer_matmul_onnx(tmp_path / "mixed.onnx", float_op)) is None


def zero_points(path: Path) -> tuple[set[int], set[int], set[int]]:
    """The data types of the zero points of the activations (QuantizeLinear) and of the MatMul weights
    (DequantizeLinear of an initializer feeding a MatMul), and every zero point's values."""
    graph = onnx.load(str(path)).graph
    inits = {i.name: i for i in graph.initializer}
    activations = {inits[n.input[2]].data_type for n in graph.node if n.op_type == "QuantizeLinear"}
    matmul_inputs = {i for n in graph.node if n.op_type == "MatMul" for i in n.input}
    weights = {inits[n.input[2]].data_type for n in graph.node
               if n.op_type == "DequantizeLinear" and n.input[0] in inits and n.output[0] in matmul_inputs}
    values = {int(v) for n in graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")
              for v in numpy_helper.to_array(inits[n.input[2]]).ravel()}
    return activations, weights, values


@pytest.mark.parametrize(("runtime", "activations"), [
    (OnnxRuntimeCPU.name, TensorProto.UINT8), (TensorRTRuntime.name, TensorProto.INT8),
    (OnnxRuntimeCUDA.name, TensorProto.INT8)])
def test_onnx_runtimes_static_recipe_writes_the_integer_types_the_runtime_takes(
        tmp_path: Path, runtime: str, activations: int) -> None:
    """U8S8 for ONNX Runtime on the CPU; symmetric int8 activations and weights (zero points 0) for TensorRT and
    for ONNX Runtime on a GPU (whose TensorRT provider builds the same graph)."""
    model = mlp_onnx(tmp_path / "m.onnx")
    spec = CalibrationSpec(DataSpec("x.npz", 8), method=CalibrationMethod.MAX, recipe=Int8Recipe.ONNXRUNTIME)
    result = precision.to_int8(model, fp32_sha=sha256_file(model), calibration=mlp_samples(8), data_digest="d",
                               spec=spec, out_path=tmp_path / "int8.onnx", cache_dir=tmp_path / "cache",
                               runtime=runtime, log_file=None)
    found, weights, values = zero_points(tmp_path / "int8.onnx")
    assert found == {activations} and weights == {TensorProto.INT8}, (found, weights)
    if activations == TensorProto.INT8:
        assert values == {0} and result.settings["activations"] == "QInt8 (symmetric)"
    assert precision.calibration_key("s", "d", spec, runtime) != precision.calibration_key(
        "s", "d", spec, OnnxRuntimeCPU.name if runtime != OnnxRuntimeCPU.name else TensorRTRuntime.name)


def test_where_modelopt_fails_for_tensorrt_onnx_runtimes_fallback_is_symmetric_int8(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_modelopt(*args: object, **kwargs: object) -> None:
        onnx.checker.check_model(onnx.ModelProto())  # raises inside onnx: a tool's failure

    monkeypatch.setattr(precision, "_quantize_modelopt", failing_modelopt)
    model = mlp_onnx(tmp_path / "m.onnx")
    spec = CalibrationSpec(DataSpec("x.npz", 8), method=CalibrationMethod.MAX)  # "auto": ModelOpt's for TensorRT
    result = precision.to_int8(model, fp32_sha=sha256_file(model), calibration=mlp_samples(8), data_digest="d",
                               spec=spec, out_path=tmp_path / "int8.onnx", cache_dir=tmp_path / "cache",
                               runtime=TensorRTRuntime.name, log_file=None)
    assert result.recipe is Int8Recipe.ONNXRUNTIME and result.settings["instead_of"] == "modelopt.onnx.quantization"
    assert zero_points(tmp_path / "int8.onnx") == ({TensorProto.INT8}, {TensorProto.INT8}, {0})


def test_calibration_data_with_no_finite_value_is_the_quantizers_failure_not_a_crash(tmp_path: Path) -> None:
    """The streamed entropy calibration is our code; samples that give a tensor no finite range (NaN
    throughout) fail it as they fail ONNX Runtime's own calibrator: a tool failure (one line, the recipe's
    fallback can follow), not a crash with a traceback."""
    model = mlp_onnx(tmp_path / "m.onnx")
    samples = mlp_samples(4)
    samples["x"][:] = np.nan
    spec = CalibrationSpec(DataSpec("x.npz", 4), method=CalibrationMethod.ENTROPY, recipe=Int8Recipe.ONNXRUNTIME)
    with pytest.raises(precision.QuantizerFailed) as caught:
        precision._quantize_ort(model, samples, spec, tmp_path, tmp_path / "int8.onnx", "onnxruntime")
    assert str(caught.value).startswith("CalibrationFailed: tensor '")
    assert "no finite range over the calibration samples" in str(caught.value)


def test_what_the_quantizer_subprocess_noted_of_its_calibration_is_said_and_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The subprocess's own logging goes nowhere and its stderr is not read on success: what it has to say of a
    calibration that succeeded (values beyond the first pass's range) comes back as a file. It is logged once
    the tools' output is no longer redirected (so it reaches the terminal), kept in the variant's settings
    (build.json), and said again when a rebuild reuses the cached calibration."""
    model = mlp_onnx(tmp_path / "m.onnx")

    def quantizer(command: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        job = json.loads(Path(command[-1]).read_text())
        Path(job["out"]).write_bytes(model.read_bytes())
        (Path(job["tmp"]) / precision._NOTES).write_text("1 calibrated tensor had values beyond ...\n")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(precision.subprocess, "run", quantizer)
    monkeypatch.setattr(precision, "_quiet", lambda: _redirected_stderr(caplog))
    spec = CalibrationSpec(DataSpec("x.npz", 4), method=CalibrationMethod.ENTROPY, recipe=Int8Recipe.ONNXRUNTIME)
    said = "INT8 calibration (ONNX Runtime): 1 calibrated tensor had values beyond ..."
    for cached in (False, True):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=precision.__name__):
            result = precision.to_int8(model, fp32_sha=sha256_file(model), calibration=mlp_samples(4),
                                       data_digest="d", spec=spec, out_path=tmp_path / f"int8-{cached}.onnx",
                                       cache_dir=tmp_path / "cache", log_file=None)
        assert result.cached is cached
        assert result.settings["calibration_note"] == "1 calibrated tensor had values beyond ..."
        assert [getattr(r, "redirected", False) for r in caplog.records if r.getMessage() == said] == [False]


@contextlib.contextmanager
def _redirected_stderr(caplog: pytest.LogCaptureFixture) -> Iterator[io.StringIO]:
    """Stands in for precision._quiet: marks what is logged while the tools' output is redirected."""
    sink = io.StringIO()
    factory = logging.getLogRecordFactory()

    def record(*args: Any, **kwargs: Any) -> logging.LogRecord:
        made = factory(*args, **kwargs)
        made.redirected = True
        return made

    logging.setLogRecordFactory(record)
    try:
        yield sink
    finally:
        logging.setLogRecordFactory(factory)


def _shared_weight_chain(path: Path) -> Path:
    """x @ W, Relu, @ W, Relu, @ W: one 64x64 weight read three times (an unrolled recurrence's shape)."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array((rng.normal(size=(64, 64)) / 8).astype(np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m0"], name="mm0"), helper.make_node("Relu", ["m0"], ["r0"]),
             helper.make_node("MatMul", ["r0", "w"], ["m1"], name="mm1"), helper.make_node("Relu", ["m1"], ["r1"]),
             helper.make_node("MatMul", ["r1", "w"], ["y"], name="mm2")]
    # [batch, 16, 64]: ModelOpt leaves GEMV-shaped MatMuls (one row) unquantized.
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16, 64])], [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def _graph_facts(path: Path) -> tuple[list[str], list[bytes], Any]:
    from onnxruntime import InferenceSession

    model = onnx.load(str(path))
    x = np.random.default_rng(1).normal(size=(4, 16, 64)).astype(np.float32)
    out = InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    return (sorted(n.op_type for n in model.graph.node),
            sorted(numpy_helper.to_array(t).tobytes() for t in model.graph.initializer), out)


def test_shared_constants_that_would_outgrow_the_model_stay_shared_and_give_the_same_graphs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ModelOpt copies a shared initializer per consumer before converting (captcha_crnn: 19 MB became 270 MB, and
    the conversions peaked at 2.2 and 3.2 GB). Past DUPLICATION_LIMIT and the model's own size the copies are not
    made, and FP16 and INT8 come out as the same graphs."""
    import modelopt.onnx.quantization  # noqa: F401 (its package exports a function of the module's name)
    import modelopt.onnx.utils as modelopt_utils

    modelopt_quantize = sys.modules["modelopt.onnx.quantization.quantize"]

    model = _shared_weight_chain(tmp_path / "chain.onnx")
    assert onnx_model_growth(model) == 2 * 64 * 64 * 4
    copies: list[str] = []

    def spy(real: Any) -> Any:
        def duplicate(onnx_model: Any, *args: Any, **kwargs: Any) -> Any:
            copies.append("made")
            return real(onnx_model, *args, **kwargs)
        return duplicate

    monkeypatch.setattr(modelopt_utils, "duplicate_shared_constants", spy(modelopt_utils.duplicate_shared_constants))
    monkeypatch.setattr(modelopt_quantize, "duplicate_shared_constants",
                        spy(modelopt_quantize.duplicate_shared_constants))
    feeds = [{"x": np.random.default_rng(i).normal(size=(4, 16, 64)).astype(np.float32)} for i in range(4)]
    spec = CalibrationSpec(DataSpec("unused.npz", 16), method=CalibrationMethod.MAX, recipe=Int8Recipe.MODELOPT)
    facts = {}
    for limit in (1 << 40, 0):  # copies allowed, then past the limit (the model is 16 KB, copies add 32 KB)
        monkeypatch.setattr(precision, "DUPLICATION_LIMIT", limit)
        copies.clear()
        assert precision.duplicates_shared_constants(model) is (limit > 0)
        fp16, int8 = tmp_path / f"fp16-{limit}.onnx", tmp_path / f"int8-{limit}.onnx"
        precision.to_fp16(model, fp16, feeds=feeds, what="chain", log_file=None)
        calibration = {"x": np.concatenate([f["x"] for f in feeds])}
        precision.to_int8(model, fp32_sha=sha256_file(model), calibration=calibration, data_digest="d", spec=spec,
                          out_path=int8, cache_dir=tmp_path / f"cache-{limit}", log_file=None)
        assert len(copies) == (2 if limit else 0)  # autocast's sanitizer and the quantizer, or neither
        facts[limit] = (_graph_facts(fp16), _graph_facts(int8))
    for allowed, kept in zip(facts[1 << 40], facts[0], strict=True):
        assert allowed[:2] == kept[:2]
        np.testing.assert_array_equal(allowed[2], kept[2])
    # Not vacuous: the INT8 graph quantizes each MatMul's weight through a Q/DQ pair of its own.
    assert facts[0][1][0].count("DequantizeLinear") >= 6 and facts[0][1][0].count("MatMul") == 3


def onnx_model_growth(path: Path) -> int:
    from builder.steps import onnx_model

    return onnx_model.shared_constant_growth(onnx.load(str(path)))


def test_a_node_kept_unquantized_reads_its_shared_weight_in_float(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Past DUPLICATION_LIMIT, but with node choices (the guard's candidates): ONNX Runtime's quantizer points every
    reader of a shared weight at its quantized form, so a node the guard excludes would read INT8-rounded weights
    without ModelOpt's per-consumer copies; they are made."""
    model = _shared_weight_chain(tmp_path / "chain.onnx")
    monkeypatch.setattr(precision, "DUPLICATION_LIMIT", 0)
    assert not precision.duplicates_shared_constants(model)
    spec = CalibrationSpec(DataSpec("unused.npz", 16), method=CalibrationMethod.MAX, recipe=Int8Recipe.MODELOPT,
                           nodes_to_exclude=("mm1",))
    out = tmp_path / "int8.onnx"
    calibration = {"x": np.random.default_rng(0).normal(size=(16, 16, 64)).astype(np.float32)}
    precision.to_int8(model, fp32_sha=sha256_file(model), calibration=calibration, data_digest="d", spec=spec,
                      out_path=out, cache_dir=tmp_path / "cache", log_file=None)
    graph = onnx.load(str(out)).graph
    made_by = {o: n for n in graph.node for o in n.output}
    mm = {n.name: n for n in graph.node if n.op_type == "MatMul"}
    assert set(mm) == {"mm0", "mm1", "mm2"}
    weight = mm["mm1"].input[1]
    assert weight not in made_by or made_by[weight].op_type != "DequantizeLinear", "mm1 reads a quantized weight"
    assert made_by[mm["mm0"].input[1]].op_type == "DequantizeLinear"  # the others are quantized
    assert precision.shared_weight_leak(out, ["mm1"]) is None


def test_a_shared_quantized_weight_read_by_an_unquantized_node_is_found(tmp_path: Path) -> None:
    weight = numpy_helper.from_array(np.ones((4, 4), np.int8), "w_q")
    scale = numpy_helper.from_array(np.array(0.1, np.float32), "s")
    nodes = [helper.make_node("DequantizeLinear", ["w_q", "s"], ["w_dq"], name="dq_w"),
             helper.make_node("QuantizeLinear", ["x", "s"], ["x_q"], name="q_x"),
             helper.make_node("DequantizeLinear", ["x_q", "s"], ["x_dq"], name="dq_x"),
             helper.make_node("MatMul", ["x_dq", "w_dq"], ["a"], name="quantized"),
             helper.make_node("MatMul", ["a", "w_dq"], ["y"], name="plain")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [weight, scale])
    path = tmp_path / "qdq.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]), str(path))
    assert "'plain'" in str(precision.shared_weight_leak(path))
    assert "'quantized'" in str(precision.shared_weight_leak(path, ["quantized"]))


def test_a_leak_through_a_transposed_shared_weight_is_found(tmp_path: Path) -> None:
    weight = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    scale = numpy_helper.from_array(np.array(0.1, np.float32), "s")
    zero = numpy_helper.from_array(np.array(0, np.int8), "z")
    nodes = [helper.make_node("QuantizeLinear", ["w", "s", "z"], ["w_q"], name="q_w"),
             helper.make_node("DequantizeLinear", ["w_q", "s", "z"], ["w_dq"], name="dq_w"),
             helper.make_node("QuantizeLinear", ["x", "s", "z"], ["x_q"], name="q_x"),
             helper.make_node("DequantizeLinear", ["x_q", "s", "z"], ["x_dq"], name="dq_x"),
             helper.make_node("MatMul", ["x_dq", "w_dq"], ["a"], name="quantized"),
             helper.make_node("Transpose", ["w_dq"], ["w_t"], name="t", perm=[1, 0]),
             helper.make_node("MatMul", ["a", "w_t"], ["y"], name="tied")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [weight, scale, zero])
    path = tmp_path / "tied.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]), str(path))
    assert "'tied'" in str(precision.shared_weight_leak(path))


def test_shared_qdq_pairs_are_split_per_reader_only_where_they_read_initializers(tmp_path: Path) -> None:
    weight = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    scale = numpy_helper.from_array(np.array(0.1, np.float32), "s")
    zero = numpy_helper.from_array(np.array(0, np.int8), "z")

    def saved(scale_from_node: bool) -> Path:
        nodes = [helper.make_node("QuantizeLinear", ["w", "sc", "z"], ["w_q"], name="q_w"),
                 helper.make_node("DequantizeLinear", ["w_q", "sc", "z"], ["w_dq"], name="dq_w"),
                 helper.make_node("MatMul", ["x", "w_dq"], ["a"], name="first"),
                 helper.make_node("Add", ["w_dq", "w_dq"], ["b"], name="twice"),  # reads it twice: one reader
                 helper.make_node("MatMul", ["a", "b"], ["y"], name="last")]
        inits = [weight, zero]
        if scale_from_node:
            nodes.insert(0, helper.make_node("Constant", [], ["sc"], value=scale))
        else:
            inits.append(numpy_helper.from_array(np.array(0.1, np.float32), "sc"))
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], inits)
        path = tmp_path / f"split-{scale_from_node}.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]), str(path))
        return path

    from onnxruntime import InferenceSession

    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    for from_node, pairs in ((False, 1), (True, 0)):
        path = saved(from_node)
        before = InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        assert precision.split_shared_qdq(path) == pairs
        model = onnx.load(str(path))
        onnx.checker.check_model(model, full_check=True)  # still in topological order
        readers = [n.name for n in model.graph.node for i in n.input if i.startswith("w_dq")]
        assert sorted(readers) == ["first", "twice", "twice"]
        after = InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        np.testing.assert_array_equal(before, after)
