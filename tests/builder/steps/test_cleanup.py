"""builder.steps.cleanup: onnxslim's rewrite is kept only when the outputs stay the same; otherwise the
exported file is left exactly as it was and the report says why."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from numpy.typing import NDArray
from onnx import TensorProto, helper, numpy_helper

from builder.runtimes.onnxruntime import OnnxRuntimeReference, run_file
from builder.steps.cleanup import SlimReport, slim


def save(path: Path, nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto],
         outputs: list[onnx.ValueInfoProto], initializers: list[onnx.TensorProto], opset: int = 17) -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    onnx.save(model, str(path))
    return path


def foldable_onnx(path: Path) -> Path:
    """y = relu(x @ (w * 2) + (b1 + b2)), with the weight scaling and the bias sum computed from
    constants at run time, an Identity, and two nodes whose outputs nothing uses."""
    rng = np.random.default_rng(0)
    consts = [numpy_helper.from_array(a, n) for a, n in (
        (rng.standard_normal((8, 6)).astype(np.float32), "w"), (np.array(2.0, np.float32), "two"),
        (rng.standard_normal(6).astype(np.float32), "b1"), (rng.standard_normal(6).astype(np.float32), "b2"))]
    nodes = [
        helper.make_node("Mul", ["w", "two"], ["w2"], name="scale_weight"),  # constant: folds
        helper.make_node("Add", ["b1", "b2"], ["b"], name="sum_bias"),  # constant: folds
        helper.make_node("MatMul", ["x", "w2"], ["h0"], name="fc"),
        helper.make_node("Identity", ["h0"], ["h1"], name="identity"),
        helper.make_node("Add", ["h1", "b"], ["h2"], name="bias"),
        helper.make_node("Relu", ["h2"], ["y"], name="relu"),
        helper.make_node("Neg", ["x"], ["unused0"], name="dead0"),  # no graph output depends on these
        helper.make_node("Exp", ["unused0"], ["unused1"], name="dead1"),
    ]
    return save(path, nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 6])], consts)


def probe(count: int = 12, shape: tuple[int, ...] = (8,)) -> dict[str, NDArray[np.float32]]:
    return {"x": np.random.default_rng(1).standard_normal((count, *shape)).astype(np.float32)}


def test_constants_are_folded_and_dead_nodes_removed_with_identical_outputs(tmp_path: Path) -> None:
    path = foldable_onnx(tmp_path / "model.onnx")
    expected = run_file(path, probe(), 5)
    report = slim(path, probe(), executor=OnnxRuntimeReference())
    assert report.applied and report.reason is None and report.tool == "onnxslim"
    assert report.nodes_before == 8
    assert report.nodes_after is not None and report.nodes_after < report.nodes_before
    slimmed = onnx.load(str(path))
    assert len(slimmed.graph.node) == report.nodes_after
    ops = [n.op_type for n in slimmed.graph.node]
    assert not {"Identity", "Neg", "Exp"} & set(ops)  # the Identity and the dead branch are gone
    assert ops.count("Mul") == 0 and ops.count("Add") <= 1  # the constant Mul and Add were folded
    assert report.max_abs_diff is not None and report.max_abs_diff <= 1e-5
    actual = run_file(path, probe(), 5)
    np.testing.assert_allclose(actual["y"], expected["y"], rtol=1e-6, atol=1e-6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]  # no candidate left behind


def misfused_pad_conv_onnx(path: Path) -> Path:
    """Pad (opset 18, with `axes` listed as N, C, W, H) → Conv. onnxslim 0.1.98 folds the Pad into the
    Conv's `pads` as if the axes were in N, C, H, W order, so the slimmed graph pads H where the
    original pads W: same output shape, different values."""
    rng = np.random.default_rng(0)
    consts = [numpy_helper.from_array(a, n) for a, n in (
        (rng.standard_normal((2, 2, 3, 3)).astype(np.float32), "w"),
        (np.array([0, 0, 1, 0, 0, 0, 0, 1], np.int64), "pads"),  # W at the start, H at the end
        (np.array(0.0, np.float32), "value"), (np.array([0, 1, 3, 2], np.int64), "axes"))]
    nodes = [helper.make_node("Pad", ["x", "pads", "value", "axes"], ["padded"], name="pad"),
             helper.make_node("Conv", ["padded", "w"], ["y"], name="conv")]
    return save(path, nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2, 5, 5])],
                [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2, "h", "w"])], consts, opset=18)


def test_a_rewrite_that_changes_outputs_is_not_kept(tmp_path: Path) -> None:
    path = misfused_pad_conv_onnx(tmp_path / "model.onnx")
    before = path.read_bytes()
    samples = probe(6, (2, 5, 5))
    report = slim(path, samples, executor=OnnxRuntimeReference())
    assert not report.applied
    assert report.max_abs_diff is not None and report.max_abs_diff > 1e-3
    assert report.reason == f"outputs changed by {report.max_abs_diff:.3g}"
    assert report.nodes_before == 2 and report.nodes_after is None
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


def test_onnxslim_failing_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    # A weight whose stored bytes are cut short (one byte for two floats): onnx.load accepts the file,
    # onnxslim cannot turn the tensor into an array and raises.
    truncated = onnx.TensorProto(name="c", data_type=TensorProto.FLOAT, dims=[2], raw_data=b"\x00")
    path = save(tmp_path / "model.onnx", [helper.make_node("Add", ["x", "c"], ["y"])],
                [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2])],
                [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])], [truncated])
    before = path.read_bytes()
    report = slim(path, probe(4, (2,)), executor=OnnxRuntimeReference())
    assert report == SlimReport(applied=False, reason=report.reason)  # no counts: nothing was compared
    assert report.reason and "buffer size" in report.reason
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


def test_a_rewrite_onnx_runtime_cannot_load_is_not_kept(tmp_path: Path) -> None:
    # Pad with axes (H, W) → Conv: onnxslim 0.1.98 gives the Conv two pads instead of four, which
    # ONNX Runtime refuses to load ("Attribute pads has incorrect size").
    rng = np.random.default_rng(0)
    consts = [numpy_helper.from_array(a, n) for a, n in (
        (rng.standard_normal((2, 2, 3, 3)).astype(np.float32), "w"), (np.array([0, 0, 1, 1], np.int64), "pads"),
        (np.array(0.0, np.float32), "value"), (np.array([2, 3], np.int64), "axes"))]
    nodes = [helper.make_node("Pad", ["x", "pads", "value", "axes"], ["padded"], name="pad"),
             helper.make_node("Conv", ["padded", "w"], ["y"], name="conv")]
    path = save(tmp_path / "model.onnx", nodes,
                [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2, 5, 5])],
                [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2, "h", "w"])], consts, opset=18)
    before = path.read_bytes()
    report = slim(path, probe(6, (2, 5, 5)), executor=OnnxRuntimeReference())
    assert not report.applied and report.reason
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


def test_a_rewrite_that_returns_another_output_shape_is_not_kept_and_does_not_crash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CTC recognizer declaring [1, seqlen] but returning (W/8, 1, classes), onnxslim's graph returned
    the output flattened ((1, W/8 * classes)) and comparing the two crashed ("operands could not be broadcast
    together"). Stand-in: onnxslim's real result with the output flattened the same way."""
    import onnxslim

    real = onnxslim.slim

    def flattening(model: onnx.ModelProto) -> onnx.ModelProto:
        slimmed = real(model)
        output = slimmed.graph.output[0]
        for node in slimmed.graph.node:
            node.output[:] = [f"{o}_pre" if o == output.name else o for o in node.output]
        slimmed.graph.initializer.append(numpy_helper.from_array(np.array([1, -1], np.int64), "flat_shape"))
        slimmed.graph.node.append(helper.make_node("Reshape", [f"{output.name}_pre", "flat_shape"], [output.name]))
        return slimmed

    monkeypatch.setattr(onnxslim, "slim", flattening)
    path = foldable_onnx(tmp_path / "model.onnx")
    before = path.read_bytes()
    # three batches of [4, 6] against three of [1, 24]
    report = slim(path, probe(), executor=OnnxRuntimeReference(), batch_size=4)
    assert not report.applied
    assert report.reason == "output 'y' changed shape: [12, 6] -> [3, 24]"
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]
