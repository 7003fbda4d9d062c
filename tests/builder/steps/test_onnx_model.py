from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import pytest

from builder.errors import OnnxModelError
from builder.repository import onnx_files
from builder.runtimes.onnxruntime import OnnxRuntimeReference
from builder.spec import DimRange
from builder.steps import onnx_model
from tests.helpers.tiny_models import mlp_onnx, sequence_onnx


def test_missing_foreign_and_truncated_files_give_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(OnnxModelError, match="file not found"):
        onnx_files.load(tmp_path / "nope.onnx")
    text = tmp_path / "notes.onnx"
    text.write_text("this is not a model\n" * 20)
    with pytest.raises(OnnxModelError, match="not"):
        onnx_files.load(text)
    full = mlp_onnx(tmp_path / "mlp.onnx")
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    with pytest.raises(OnnxModelError, match=str(cut)):
        onnx_files.load(cut)


def test_signature_reads_dtypes_and_dynamic_dims(tmp_path: Path) -> None:
    sig = onnx_model.signature(onnx_files.load(sequence_onnx(tmp_path / "seq.onnx")), "seq")
    (ids,) = sig.inputs
    assert ids.name == "ids" and ids.dtype == "int64" and ids.shape == ("batch", "seq")
    assert sig.outputs[0].shape == ("batch", 8)


def test_dims_keep_their_names_and_unnamed_ones_are_minus_one(tmp_path: Path) -> None:
    from tests.helpers.foreign_models import detector, ocr_classifier

    x = onnx_model.signature(onnx_files.load(ocr_classifier(tmp_path).onnx), "ocr").inputs[0]
    assert x.shape == (-1, 3, "?", "?")
    images = onnx_model.signature(onnx_files.load(detector(tmp_path).onnx), "det").inputs[0]
    assert images.shape == ("p2o.DynamicDimension.0", 3, "p2o.DynamicDimension.1", "p2o.DynamicDimension.2")


def test_a_model_with_external_data_is_copied_with_its_weights(tmp_path: Path) -> None:
    from tests.helpers.foreign_models import external_data

    source = external_data(tmp_path).onnx
    assert (source.parent / "model.weights").is_file()
    target = tmp_path / "elsewhere" / "copy.onnx"
    target.parent.mkdir()
    onnx_files.copy_model(source, target)
    copied = onnx_files.load(target)
    assert sum(t.ByteSize() for t in copied.graph.initializer) > 64 * 128 * 4


def test_the_fp32_graph_is_run_at_min_opt_and_max_shapes(tmp_path: Path) -> None:
    from builder.spec.shapes import ShapeRange, resolve
    from tests.helpers.foreign_models import detector

    model = detector(tmp_path)
    sig = onnx_model.signature(onnx_files.load(model.onnx), "det")
    good = resolve(sig.inputs, batch=DimRange(1, 1, 1), batch_given=False, dims={}, what="det", shapes={
        "images": ShapeRange((1, 3, 64, 64), (2, 3, 96, 96), (2, 3, 128, 128), "--opt-shapes")})
    onnx_model.check_runs_at_levels(model.onnx, sig.inputs, good, "model 'det'", executor=OnnxRuntimeReference())
    # 102 is not a multiple of 4: the upsampled map is 52 wide, the other 51, and the Concat fails.
    bad = resolve(sig.inputs, batch=DimRange(1, 1, 1), batch_given=False, dims={}, what="det", shapes={
        "images": ShapeRange((1, 3, 64, 64), (1, 3, 96, 96), (1, 3, 102, 102), "--max-shapes")})
    with pytest.raises(OnnxModelError, match=r"model 'det': the FP32 model does not run at the max shapes "
                                             r"\(images:1x3x102x102\): .*concat"):
        onnx_model.check_runs_at_levels(model.onnx, sig.inputs, bad, "model 'det'",
                                        executor=OnnxRuntimeReference())


def test_a_constant_node_s_external_value_is_copied_with_the_model(tmp_path: Path) -> None:
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    value = numpy_helper.from_array(np.arange(4096, dtype=np.float32).reshape(1, 4096), "c")
    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["c"], value=value), helper.make_node("Add", ["x", "c"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4096])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4096])])
    source = tmp_path / "src" / "const.onnx"
    source.parent.mkdir()
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(source),
              save_as_external_data=True, location="const.bin", convert_attribute=True)
    assert onnx_files.has_external_data(source)
    target = tmp_path / "copy.onnx"
    onnx_files.copy_model(source, target)
    copied = onnx_files.load(target)
    assert numpy_helper.to_array(copied.graph.node[0].attribute[0].t)[0, -1] == 4095.0


def _shared_weight_model(copies: int) -> onnx.ModelProto:
    """`copies` MatMuls, each on its own copy of one weight (what a converter leaves of a shared weight), an If
    whose branch reads one copy from the outer graph, and one copy that is also a graph output."""
    weight = np.arange(16, dtype=np.float32).reshape(4, 4)
    inits = [onnx.numpy_helper.from_array(weight, f"w_{i}") for i in range(copies)]
    inits.append(onnx.numpy_helper.from_array(weight + 1, "other"))
    nodes = [onnx.helper.make_node("MatMul", ["x", f"w_{i}"], [f"y_{i}"]) for i in range(copies)]
    nodes.append(onnx.helper.make_node("MatMul", ["x", "other"], ["z"]))
    nodes.append(onnx.helper.make_node("Sum", [f"y_{i}" for i in range(copies)] + ["z"], ["s"]))
    branch = onnx.helper.make_graph([onnx.helper.make_node("MatMul", ["s", "w_3"], ["b_out"])], "b", [],
                                    [onnx.helper.make_tensor_value_info("b_out", onnx.TensorProto.FLOAT, [2, 4])])
    nodes.append(onnx.helper.make_node("If", ["cond"], ["out"], then_branch=branch, else_branch=branch))
    graph = onnx.helper.make_graph(
        nodes, "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4]),
                     onnx.helper.make_tensor_value_info("cond", onnx.TensorProto.BOOL, [])],
        [onnx.helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, [2, 4]),
         onnx.helper.make_tensor_value_info("w_1", onnx.TensorProto.FLOAT, [4, 4])], initializer=inits)
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


def test_identical_initializers_are_kept_once_and_the_graph_computes_the_same(tmp_path: Path) -> None:
    import onnxruntime as ort

    model = _shared_weight_model(5)
    x = {"x": np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32), "cond": np.array(True)}
    before = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, x)
    saved = onnx_model.dedupe_initializers(model)
    names = [t.name for t in model.graph.initializer]
    # w_1 is also a graph output: left alone. w_2..w_4 (w_3 in the If's branch too) now read w_0; "other" differs.
    assert sorted(names) == ["other", "w_0", "w_1"] and saved == 3 * 16 * 4
    assert [n.input[1] for n in model.graph.node if n.op_type == "MatMul"] == ["w_0", "w_1", "w_0", "w_0", "w_0",
                                                                                "other"]
    onnx.checker.check_model(model)
    after = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, x)
    branch = next(n for n in model.graph.node if n.op_type == "If").attribute[0].g
    assert list(branch.node[0].input) == ["s", "w_0"]
    for b, a in zip(before, after, strict=True):
        np.testing.assert_array_equal(b, a)
    assert onnx_model.dedupe_initializers(model) == 0
