"""Intermediate tensors fetched a bounded group at a time: sizes from shape inference match what a run returns,
groups keep to their budget and to graph order, and each group's session exposes that group alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from builder.steps import fetch_groups
from tests.helpers.tiny_models import cnn_onnx, cnn_samples


def _all_exposed(model: onnx.ModelProto) -> onnx.ModelProto:
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    present = {o.name for o in exposed.graph.output}
    for node in exposed.graph.node:
        for name in node.output:
            if name and name not in present:
                exposed.graph.output.add().name = name
    return exposed


def _session(model: onnx.ModelProto) -> Any:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_sizes_by_shape_inference_are_the_bytes_a_run_returns(tmp_path: Path) -> None:
    model = _all_exposed(onnx.load(str(cnn_onnx(tmp_path / "cnn.onnx"))))
    feed = {k: v[:3] for k, v in cnn_samples(3).items()}
    session = _session(model)
    names = [o.name for o in session.get_outputs()]
    actual = {n: np.asarray(v).nbytes for n, v in zip(names, session.run(names, feed), strict=True)}
    sizes = fetch_groups.tensor_bytes(model, feed)
    assert actual and {n: sizes.get(n) for n in actual} == actual
    # At another batch the sizes follow the feed, not the shapes the graph declares.
    bigger = fetch_groups.tensor_bytes(model, {k: np.concatenate([v] * 4) for k, v in feed.items()})
    assert all(bigger[n] == 4 * b for n, b in actual.items())


def test_a_data_dependent_shape_is_unknown_not_guessed() -> None:
    graph = helper.make_graph(
        [helper.make_node("NonZero", ["x"], ["nz"]), helper.make_node("Relu", ["x"], ["r"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("nz", TensorProto.INT64, None),
         helper.make_tensor_value_info("r", TensorProto.FLOAT, None)])
    sizes = fetch_groups.tensor_bytes(helper.make_model(graph), {"x": np.ones(5, np.float32)})
    assert sizes["r"] == 20 and "nz" not in sizes


def test_groups_keep_the_budget_and_the_graph_order_and_unknown_sizes_ride_along() -> None:
    order = {f"t{i}": i for i in range(40)}
    sizes = {f"t{i}": 100 for i in range(0, 40, 2)}  # the odd ones: unknown size
    names = list(reversed(order))  # asked in any order
    cut = fetch_groups.groups(names, sizes, budget=250, order=order)
    assert [n for group in cut for n in group] == sorted(order, key=order.__getitem__)  # each once, graph order
    assert all(sum(sizes.get(n, 0) for n in group) <= 250 for group in cut)
    assert len(cut) == 10  # two known tensors per group, the unknown ones beside them
    # All unknown (shape inference could not size a data-dependent graph): one group, as before grouping.
    assert fetch_groups.groups(names, {}, budget=250, order=order) == [sorted(order, key=order.__getitem__)]
    # A tensor larger than the budget is a group of its own, never dropped.
    assert fetch_groups.groups(["a", "b"], {"a": 10, "b": 1000}, budget=100) == [["a"], ["b"]]
    assert fetch_groups.groups([], {}, budget=100) == []


def test_each_group_session_exposes_its_group_only_and_the_model_is_left_as_it_was(tmp_path: Path) -> None:
    model = _all_exposed(onnx.load(str(cnn_onnx(tmp_path / "cnn.onnx"))))
    before = model.SerializeToString()
    feed = {k: v[:2] for k, v in cnn_samples(2).items()}
    whole = _session(model)
    names = [o.name for o in whole.get_outputs()]
    expected = dict(zip(names, whole.run(names, feed), strict=True))
    inputs = list(feed)
    cut = fetch_groups.groups([*inputs, *names], fetch_groups.tensor_bytes(model, feed), budget=1,
                              order=fetch_groups.graph_order(model))
    seen: dict[str, Any] = {}
    for group, session in fetch_groups.group_sessions(model, cut, _session):
        if session is not None:
            assert sorted(o.name for o in session.get_outputs()) == sorted(n for n in group if n not in inputs)
        seen.update(fetch_groups.run_group(session, feed, group))
    assert set(seen) == {*inputs, *names}
    for name, value in expected.items():
        np.testing.assert_array_equal(seen[name], value)
    assert model.SerializeToString() == before


def test_initializer_values_stay_out_of_shape_inference_except_small_ones() -> None:
    weight = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    shape = numpy_helper.from_array(np.array([-1, 64], np.int64), "shape")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Reshape", ["y", "shape"], ["z"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)], [weight, shape])
    model = helper.make_model(graph)
    light = fetch_groups._shape_only(model)
    assert [t.name for t in light.graph.initializer] == ["shape"]  # a Reshape target keeps its values
    assert fetch_groups.tensor_bytes(model, {"x": np.ones((3, 64), np.float32)}) == {
        "x": 3 * 64 * 4, "y": 3 * 64 * 4, "z": 3 * 64 * 4, "w": 64 * 64 * 4}


def test_a_group_graph_holds_only_what_its_tensors_depend_on() -> None:
    """ONNX Runtime runs every node of a graph, asked for or not: a group before a node that cannot run (here a
    Reshape to an impossible shape) must not contain it, and an early group costs only a prefix."""
    bad = numpy_helper.from_array(np.array([7, 7], np.int64), "bad")
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Neg", ["a"], ["b"]),
         helper.make_node("Reshape", ["b", "bad"], ["c"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, None)], [bad])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    first = fetch_groups.pruned(model, ["a"])
    assert [n.op_type for n in first.graph.node] == ["Relu"] and not first.graph.initializer
    assert [o.name for o in first.graph.output] == ["a"] and [i.name for i in first.graph.input] == ["x"]
    feed = {"x": np.array([[-1, 2, -3], [4, -5, 6]], np.float32)}
    values = {}
    for group, session in fetch_groups.group_sessions(model, [["x", "a"], ["b"]], _session):
        values.update(fetch_groups.run_group(session, feed, group))
    np.testing.assert_array_equal(values["b"], -np.maximum(feed["x"], 0))
    assert len(fetch_groups.pruned(model, ["c"]).graph.node) == 3


def test_an_if_branch_keeps_what_it_reads_from_outside() -> None:
    then = helper.make_graph([helper.make_node("Neg", ["a"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2])])
    other = helper.make_graph([helper.make_node("Identity", ["a"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2])])
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Abs", ["x"], ["unused"]),
         helper.make_node("If", ["flag"], ["y"], then_branch=then, else_branch=other)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    kept = fetch_groups.pruned(model, ["y"])
    assert [n.op_type for n in kept.graph.node] == ["Relu", "If"]
    out = _session(kept).run(["y"], {"x": np.array([-1, 2], np.float32), "flag": np.array(True)})[0]
    np.testing.assert_array_equal(out, [0, -2])


def test_sizes_for_an_input_declared_without_a_shape_and_small_weights_stored_outside(tmp_path: Path) -> None:
    shape = numpy_helper.from_array(np.array([-1, 4], np.int64), "shape")
    weight = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("MatMul", ["r", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [shape, weight])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path),
              save_as_external_data=True, all_tensors_to_one_file=True, location="m.data", size_threshold=0)
    model = onnx.load(str(path), load_external_data=False)
    feed = {"x": np.ones((2, 8), np.float32)}
    assert fetch_groups.tensor_bytes(model, feed, path.parent)["y"] == 4 * 4 * 4  # [4, 4] float32
    assert "y" not in fetch_groups.tensor_bytes(model, feed)  # the Reshape's target unread: unknown, not guessed


def test_a_weight_listed_as_an_input_too_is_no_required_feed() -> None:
    """IR 3 lists initializers as graph inputs (and some exports keep them there): a group graph must not keep one
    as an input without its value, which ONNX Runtime would then require in the feed."""
    weight = numpy_helper.from_array(np.eye(3, dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("MatMul", ["a", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, [3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)], ir_version=3)
    feed = {"x": np.array([[-1, 2, 3], [4, -5, 6]], np.float32)}
    values: dict[str, Any] = {}
    for group, session in fetch_groups.group_sessions(model, [["a"], ["y"]], _session):
        values.update(fetch_groups.run_group(session, feed, group))
    np.testing.assert_array_equal(values["y"], np.maximum(feed["x"], 0))
