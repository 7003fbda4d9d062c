"""Autocast's reference ranges collected one feed at a time give ModelOpt the same figures its own runner gives
(so the same nodes stay in FP32), and the FP16 conversion built on them is the same graph."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from numpy.typing import NDArray
from onnx import TensorProto, helper, numpy_helper

from builder.steps import fp16_ranges, precision
from builder.steps.precision import Fp16Settings
from tests.helpers.foreign_models import SAMPLES, detector
from tests.helpers.tiny_models import cnn_onnx, cnn_samples


def _feed_folder(tmp_path: Path, feeds: list[dict[str, NDArray[np.float32]]]) -> Path:
    folder = tmp_path / "feeds"
    folder.mkdir()
    for index, feed in enumerate(feeds):
        np.savez(folder / f"{index:05d}.npz", **feed)
    return folder


def _streamed(model: onnx.ModelProto, folder: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The streaming runner's figures, with ModelOpt's own run made to fail: they are the stand-in's own."""
    from modelopt.onnx.autocast.referencerunner import ReferenceRunner

    runner = fp16_ranges._streaming_runner(ReferenceRunner)(model)
    with monkeypatch.context() as patched:
        patched.setattr(ReferenceRunner, "run", lambda self, inputs=None: pytest.fail("ModelOpt's own run"))
        return runner.run(folder)


def _same(ours: Any, theirs: Any) -> None:
    from modelopt.onnx.autocast.referencerunner import TensorStats

    assert list(ours) and set(ours) == set(theirs)
    for name, stats in theirs.items():
        mine = ours[name]
        assert isinstance(mine, TensorStats) and mine.shape == stats.shape, name
        for field in ("absmax", "min_val", "max_val"):
            assert math.isclose(getattr(mine, field), float(getattr(stats, field)), rel_tol=1e-6, abs_tol=1e-9), \
                (name, field)


def test_the_streaming_ranges_equal_modelopts_over_several_feeds(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from modelopt.onnx.autocast.referencerunner import ReferenceRunner

    model = onnx.load(str(cnn_onnx(tmp_path / "cnn.onnx")))
    samples = cnn_samples(6)
    feeds = [{k: v[i:i + 2] for k, v in samples.items()} for i in range(0, 6, 2)]
    folder = str(_feed_folder(tmp_path, feeds))
    _same(_streamed(model, folder, monkeypatch), ReferenceRunner(model).run(folder))


def _constant_and_sqrt() -> onnx.ModelProto:
    """y = Sqrt(x) * Constant(1000): a large constant (not a tensor ModelOpt measures) and a NaN where x < 0."""
    nodes = [helper.make_node("Constant", [], ["big"], value=numpy_helper.from_array(np.array(1000.0, np.float32))),
             helper.make_node("Sqrt", ["x"], ["root"], name="sqrt"),
             helper.make_node("Mul", ["root", "big"], ["y"], name="mul")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_constant_node_is_not_measured_and_a_nan_feed_hides_no_other_range(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from modelopt.onnx.autocast.referencerunner import ReferenceRunner

    model = _constant_and_sqrt()
    # The first feed's root is NaN (Sqrt of -1); the last one's is 400.
    feeds = [{"x": np.array([[-1.0, 1e-8, 1e-8, 1e-8]], np.float32)},
             {"x": np.array([[1e-8, 1e-8, 1e-8, 1e-8]], np.float32)},
             {"x": np.array([[160000.0, 1e-8, 1e-8, 1e-8]], np.float32)}]
    folder = str(_feed_folder(tmp_path, feeds))
    ours, theirs = _streamed(model, folder, monkeypatch), ReferenceRunner(model).run(folder)
    assert "big" not in ours and "big" not in theirs  # before: measured, and 1000 kept the Mul in FP32
    assert ours["root"].absmax == pytest.approx(400.0)  # before: NaN, and the Mul went to FP16
    _same(ours, theirs)


def test_other_feeds_keep_modelopts_own_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from modelopt.onnx.autocast.referencerunner import ReferenceRunner

    model = onnx.load(str(cnn_onnx(tmp_path / "cnn.onnx")))
    runner = fp16_ranges._streaming_runner(ReferenceRunner)(model)
    calls: list[object] = []
    def run(self: ReferenceRunner, inputs: object = None) -> dict[str, object]:
        calls.append(inputs)
        return {}

    monkeypatch.setattr(ReferenceRunner, "run", run)
    runner.run(None)  # random inputs: ModelOpt's own business
    assert calls == [None]


def test_the_fp16_graph_is_the_same_with_either_runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A detector whose feature maps exceed a low data_max: the ranges decide which nodes stay in FP32.
    model = detector(tmp_path)
    with np.load(model.calibration) as archive:
        samples = {k: archive[k] for k in archive.files}
    feeds = precision.autocast_feeds([{k: v[: SAMPLES // 2] for k, v in samples.items()}], 2)
    settings = Fp16Settings(data_max=1.0)
    precision.to_fp16(model.onnx, tmp_path / "streamed.onnx", feeds=feeds, what="det", settings=settings,
                      log_file=None)
    from contextlib import nullcontext
    monkeypatch.setattr(fp16_ranges, "streaming", nullcontext)
    precision.to_fp16(model.onnx, tmp_path / "modelopt.onnx", feeds=feeds, what="det", settings=settings,
                      log_file=None)
    streamed, theirs = (onnx.load(str(tmp_path / f"{n}.onnx")) for n in ("streamed", "modelopt"))
    kept = [sum(n.op_type == "Cast" for n in m.graph.node) for m in (streamed, theirs)]
    assert kept[0] == kept[1] and kept[0] > 2  # some nodes were kept in FP32 by their range, the same ones
    assert streamed.graph == theirs.graph


def test_the_ranges_fetched_a_group_at_a_time_equal_modelopts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor a group (and a session) of its own: ONNX Runtime holds every output of a graph until a run
    ends, so a detector at 1280x1280 held 1 GB per feed with all of them exposed."""
    from modelopt.onnx.autocast.referencerunner import ReferenceRunner

    from builder.steps import fetch_groups

    model = onnx.load(str(cnn_onnx(tmp_path / "cnn.onnx")))
    samples = cnn_samples(6)
    feeds = [{k: v[i:i + 2] for k, v in samples.items()} for i in range(0, 6, 2)]
    folder = str(_feed_folder(tmp_path, feeds))
    theirs = ReferenceRunner(model).run(folder)
    exposed: list[int] = []
    original = fetch_groups.group_sessions

    def counted(*args: Any) -> Any:
        for group, session in original(*args):
            exposed.append(len(session.get_outputs()))
            yield group, session

    monkeypatch.setattr(fetch_groups, "GROUP_BYTES", 1)
    monkeypatch.setattr(fetch_groups, "group_sessions", counted)
    ours = _streamed(model, folder, monkeypatch)
    assert exposed and max(exposed) == 1 and len(exposed) > 3
    _same(ours, theirs)
