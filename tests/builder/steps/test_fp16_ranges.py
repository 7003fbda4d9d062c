"""Autocast's reference ranges collected one feed at a time give ModelOpt the same figures its own runner gives
(so the same nodes stay in FP32), and the FP16 conversion built on them is the same graph."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest

from builder.steps import fp16_ranges, precision
from builder.steps.precision import Fp16Settings
from tests.helpers.foreign_models import SAMPLES, detector
from tests.helpers.tiny_models import cnn_onnx, cnn_samples


def _feed_folder(tmp_path: Path, feeds: list[dict[str, np.ndarray]]) -> Path:
    folder = tmp_path / "feeds"
    folder.mkdir()
    for index, feed in enumerate(feeds):
        np.savez(folder / f"{index:05d}.npz", **feed)
    return folder


def test_the_streaming_ranges_equal_modelopts_over_several_feeds(tmp_path: Path) -> None:
    from modelopt.onnx.autocast.referencerunner import ReferenceRunner, TensorStats

    model = onnx.load(str(cnn_onnx(tmp_path / "cnn.onnx")))
    samples = cnn_samples(6)
    feeds = [{k: v[i:i + 2] for k, v in samples.items()} for i in range(0, 6, 2)]
    folder = str(_feed_folder(tmp_path, feeds))
    theirs = ReferenceRunner(model).run(folder)
    ours = fp16_ranges._streaming_runner(ReferenceRunner)(model).run(folder)
    assert list(ours) and set(ours) == set(theirs)
    for name, stats in theirs.items():
        mine = ours[name]
        assert isinstance(mine, TensorStats) and mine.shape == stats.shape, name
        for field in ("absmax", "min_val", "max_val"):
            assert math.isclose(getattr(mine, field), float(getattr(stats, field)), rel_tol=1e-6, abs_tol=1e-9)


def test_other_feeds_keep_modelopts_own_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from modelopt.onnx.autocast.referencerunner import ReferenceRunner

    model = onnx.load(str(cnn_onnx(tmp_path / "cnn.onnx")))
    runner = fp16_ranges._streaming_runner(ReferenceRunner)(model)
    calls: list[object] = []
    monkeypatch.setattr(ReferenceRunner, "run", lambda self, inputs=None: calls.append(inputs) or {})
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
