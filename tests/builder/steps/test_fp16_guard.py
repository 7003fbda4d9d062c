"""Guarded FP16 on a model built so that plain FP16 provably misses its tolerance: a per-feature offset
that FP16 cannot hold (300 + a fraction: FP16's spacing there is 0.25) subtracted from inputs that carry
the same large offset, as in a normalization layer fed raw sensor values."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from numpy.typing import NDArray
from onnx import helper

from builder.errors import AccuracyError, ToolError
from builder.pipeline import BuildOptions, build_all
from builder.runtimes.onnxruntime import OnnxRuntimeCPU, run_file
from builder.spec import DataSpec, DimRange, ModelSpec, Precision, Task, Tolerance
from builder.steps import accuracy, precision
from builder.steps.fp16_guard import fp16_nodes, guard
from builder.steps.precision import Fp16Settings
from tests.helpers.tiny_models import OFFSET, OFFSET_FEATURES, offset_graph

FEATURES = OFFSET_FEATURES


def offset_model(path: Path, seed: int = 0, *, head: bool = True) -> Path:
    """tests.helpers.tiny_models.offset_graph saved at `path`."""
    graph = offset_graph(np.random.default_rng(seed), head=head)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def offset_samples(count: int, seed: int) -> dict[str, NDArray[np.float32]]:
    rng = np.random.default_rng(seed)
    return {"x": (OFFSET + 0.1 * rng.standard_normal((count, FEATURES))).astype(np.float32)}


@dataclass(frozen=True)
class Offset:
    """The offset model, its held-out samples, autocast's feeds, the FP32 outputs and the plain FP16 graph."""

    model: Path
    evaluation: dict[str, NDArray[np.float32]]
    feeds: list[dict[str, NDArray[Any]]]
    reference: dict[str, NDArray[Any]]
    plain: Path

    def convert(self, settings: Fp16Settings, out: Path) -> None:
        precision.to_fp16(self.model, out, feeds=self.feeds, what="offset", settings=settings, log_file=None)

    def evaluate(self, path: Path) -> accuracy.Metrics:
        return accuracy.compare(self.reference, run_file(path, self.evaluation, 8), Task.GENERIC)


def plain_offset(tmp_path: Path, *, head: bool = True) -> Offset:
    model = offset_model(tmp_path / "offset.onnx", head=head)
    evaluation = offset_samples(32, seed=1)
    feeds = precision.autocast_feeds([evaluation], 8)
    plain = tmp_path / "plain.onnx"
    precision.to_fp16(model, plain, feeds=feeds, what="offset", log_file=None)
    return Offset(model, evaluation, feeds, run_file(model, evaluation, 8), plain)


def spec_for(tmp_path: Path, tolerance: Tolerance | None = None, *, head: bool = True) -> ModelSpec:
    np.savez(tmp_path / "eval.npz", **offset_samples(32, seed=1))
    return ModelSpec(
        name="offset", onnx=offset_model(tmp_path / "offset.onnx", head=head), task=Task.GENERIC,
        batch=DimRange(1, 4, 8),
        precisions=(Precision.FP32, Precision.FP16), evaluation=DataSpec(str(tmp_path / "eval.npz"), 32),
        tolerances={Precision.FP16: tolerance} if tolerance is not None else {},
    )


def build(tmp_path: Path, spec: ModelSpec) -> dict[str, Any]:
    options = BuildOptions(repository=tmp_path / "repo", runtime=OnnxRuntimeCPU(), cache_dir=tmp_path / "cache")
    build_all([spec], options, None, ["pytest"])
    return dict(json.loads((tmp_path / "repo" / "offset_fp16" / "build.json").read_text()))


def test_plain_fp16_misses_the_default_tolerance_and_the_guard_meets_it_keeping_one_node(tmp_path: Path) -> None:
    spec = spec_for(tmp_path)
    assert spec.onnx is not None
    tolerance = spec.tolerance(Precision.FP16)  # the default: cosine_min 0.999
    evaluation = dict(np.load(tmp_path / "eval.npz"))
    # Plain FP16 with real feeds: outside the tolerance.
    plain = tmp_path / "plain.onnx"
    precision.to_fp16(spec.onnx, plain, feeds=precision.autocast_feeds([evaluation], 8), what="offset", log_file=None)
    assert fp16_nodes(onnx.load(str(plain))) == ["centre", "scale", "fc1", "relu", "fc2"]
    metrics = accuracy.compare(run_file(spec.onnx, evaluation, 8), run_file(plain, evaluation, 8), Task.GENERIC)
    with pytest.raises(AccuracyError, match="cosine_min"):
        accuracy.check(metrics, tolerance, "offset_fp16")

    record = build(tmp_path, spec)
    guard = record["fp16_guard"]
    assert guard["fallback"] is None
    assert guard["before"]["cosine_min"] < 0.999 <= guard["after"]["cosine_min"]
    assert guard["before"]["cosine_min"] == pytest.approx(metrics.cosine_min, abs=1e-6)
    # The subtraction, where the offset's fraction lives, and nothing more.
    assert guard["kept_fp32_nodes"] == ["centre"]
    assert guard["most_sensitive"][0]["node"] == "centre"
    assert guard["fp16_nodes_plain"] == 5 and guard["fp16_nodes_guarded"] == 4
    assert record["accuracy"]["cosine_min"] >= 0.999
    assert record["precision_settings"]["nodes_to_exclude"] == ["centre"]
    served = onnx.load(str(tmp_path / "repo" / "offset_fp16" / "1" / "model.onnx"))
    assert "centre" not in fp16_nodes(served) and "fc1" in fp16_nodes(served)
    # FP32 was built alongside.
    assert (tmp_path / "repo" / "offset_fp32" / "build.json").is_file()


def test_when_no_fp16_mix_meets_the_tolerance_fp32_is_served_under_the_fp16_name(tmp_path: Path) -> None:
    # The subtraction is the whole graph: keeping it in FP32 leaves no FP16 node, which is no FP16 mix.
    record = build(tmp_path, spec_for(tmp_path, head=False))
    guard = record["fp16_guard"]
    assert guard["fallback"] == "fp32" and guard["after"] is None and guard["fp16_nodes_guarded"] == 0
    assert guard["search"] and not any(step["passes"] for step in guard["search"])
    assert record["precision_settings"]["fallback"] == "fp32"
    assert guard["before"]["cosine_min"] < 0.999 and record["accuracy"]["max_abs"] == 0.0
    served = onnx.load(str(tmp_path / "repo" / "offset_fp16" / "1" / "model.onnx"))
    assert not fp16_nodes(served)


def test_a_candidate_autocast_refuses_is_recorded_and_the_search_goes_on(tmp_path: Path) -> None:
    offset = plain_offset(tmp_path)
    refused: list[Fp16Settings] = []

    def convert(settings: Fp16Settings, out: Path) -> None:
        if len(settings.nodes_to_exclude) == 4 and "relu" not in settings.nodes_to_exclude:
            refused.append(settings)  # relu alone in FP16: refused, as autocast may refuse a combination
            raise ToolError("model 'offset': FP16 conversion (ModelOpt autocast) failed: refused (full output: -)")
        offset.convert(settings, out)

    work = tmp_path / "work"
    work.mkdir()
    report, path = guard(convert, offset.evaluate, plain=offset.plain, tolerance=Tolerance(cosine_min=0.999),
                         work=work)
    assert len(refused) == 1 and path is not None
    assert report.kept_fp32_nodes == ["centre"] and report.fallback is None
    relu = next(s for s in report.most_sensitive if s.node == "relu")
    assert relu.damage is None and report.most_sensitive[-1].node == "relu"  # no figure, ranked last
    assert report.conversions == 5 + len(report.search)  # five alone, then the search
