"""One-pass sensitivity (steps/sensitivity.py): on models built so that one node's conversion is catastrophic,
that node ranks first; the guards reach their tolerance with either ranking; FP16 conversions are reused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

from builder.pipeline import BuildOptions, build_all
from builder.repository.onnx_files import sha256_file
from builder.runtimes.onnxruntime import OnnxRuntimeCPU
from builder.spec import CalibrationMethod, CalibrationSpec, DataSpec, GuardSensitivity, Int8Recipe
from builder.steps import fetch_groups, precision, sensitivity
from builder.steps.fp16_guard import fp16_nodes
from builder.steps.guard import quantized_nodes
from builder.steps.sensitivity import node_tensors, one_pass
from tests.builder.steps.test_fp16_guard import offset_model, offset_samples, spec_for
from tests.helpers.tiny_models import mlp_samples, offset_graph, outlier_mlp_onnx


def test_one_pass_ranks_the_layer_fed_the_outlier_channel_first(tmp_path: Path) -> None:
    # fc2's input carries one channel 400x the others: one per-tensor INT8 scale wipes the others out.
    model = outlier_mlp_onnx(tmp_path / "outlier.onnx")
    plain = tmp_path / "int8.onnx"
    spec = CalibrationSpec(DataSpec("unused.npz", 64), method=CalibrationMethod.MAX, recipe=Int8Recipe.MODELOPT)
    precision.to_int8(model, fp32_sha=sha256_file(model), calibration=mlp_samples(64, seed=0), data_digest="t",
                      spec=spec, out_path=plain, cache_dir=tmp_path / "cache", log_file=None)
    nodes = quantized_nodes(onnx.load(str(plain)))
    scores = one_pass(model, plain, nodes, mlp_samples(32, seed=1), 8)
    ranked = sorted(nodes, key=lambda n: scores[n], reverse=True)
    assert ranked[0] == "fc2", scores
    assert scores["fc2"] > 0.5 > max(scores[n] for n in ranked[1:]), scores
    assert not list(tmp_path.glob(".*sensitivity*"))  # the exposed copies are removed


def test_one_pass_in_groups_of_tensors_gives_the_same_scores_as_one_run(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose exposed tensors exceed GROUP_BYTES runs in several groups (layout_cdla's guard peaked at
    2.1 GB holding both graphs' tensors at once): each pair's sums, so the scores, do not change."""
    model = outlier_mlp_onnx(tmp_path / "outlier.onnx")
    plain = tmp_path / "int8.onnx"
    spec = CalibrationSpec(DataSpec("unused.npz", 64), method=CalibrationMethod.MAX, recipe=Int8Recipe.MODELOPT)
    precision.to_int8(model, fp32_sha=sha256_file(model), calibration=mlp_samples(64, seed=0), data_digest="t",
                      spec=spec, out_path=plain, cache_dir=tmp_path / "cache", log_file=None)
    nodes = quantized_nodes(onnx.load(str(plain)))
    whole = one_pass(model, plain, nodes, mlp_samples(32, seed=1), 8)
    runs: list[int] = []
    exposed: list[int] = []
    original, original_session = fetch_groups.run_group, sensitivity.ort_session

    def counted(session: Any, feed: Any, names: list[str]) -> Any:
        runs.append(len(names))
        return original(session, feed, names)

    def counted_session(path: Path, *args: Any, **kwargs: Any) -> Any:
        session = original_session(path, *args, **kwargs)
        exposed.append(len(session.get_outputs()))
        return session

    monkeypatch.setattr(fetch_groups, "GROUP_BYTES", 1)  # every tensor a group of its own
    monkeypatch.setattr(fetch_groups, "run_group", counted)
    monkeypatch.setattr(sensitivity, "ort_session", counted_session)
    grouped = one_pass(model, plain, nodes, mlp_samples(32, seed=1), 8)
    assert max(runs) == 1 and len(runs) > 2 * 4  # one tensor per run, both graphs, 4 batches of 8
    # Each session exposes its group only: ONNX Runtime holds every output of a graph until a run ends.
    assert exposed and max(exposed) == 1
    # The same figures: group sessions run unoptimized, so no tensor's values depend on its group.
    assert grouped == pytest.approx(whole, rel=1e-9, abs=1e-12)


def test_one_pass_ranks_the_subtraction_fp16_cannot_hold_first(tmp_path: Path) -> None:
    # x − (300 + u): FP16's spacing at 300 is 0.25, so the subtraction loses u; the nodes after it only pass
    # the error on, and score about nothing however large the error they carry.
    model = offset_model(tmp_path / "offset.onnx")
    evaluation = offset_samples(32, seed=1)
    plain = tmp_path / "fp16.onnx"
    precision.to_fp16(model, plain, feeds=precision.autocast_feeds([evaluation], 8), what="offset", log_file=None)
    nodes = fp16_nodes(onnx.load(str(plain)))
    scores = one_pass(model, plain, nodes, evaluation, 8)
    assert max(scores, key=lambda n: scores[n]) == "centre", scores
    assert scores["centre"] > 0.1 and abs(scores["scale"]) < 1e-3, scores


def test_one_pass_reads_a_model_whose_weights_are_in_an_external_file(tmp_path: Path) -> None:
    graph = offset_graph(np.random.default_rng(0))
    folder = tmp_path / "external"
    folder.mkdir()
    model = folder / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(model),
              save_as_external_data=True, all_tensors_to_one_file=True, location="model.weights", size_threshold=0)
    evaluation = offset_samples(16, seed=1)
    plain = tmp_path / "fp16.onnx"
    precision.to_fp16(model, plain, feeds=precision.autocast_feeds([evaluation], 8), what="offset", log_file=None)
    scores = one_pass(model, plain, fp16_nodes(onnx.load(str(plain))), evaluation, 8)
    assert max(scores, key=lambda n: scores[n]) == "centre", scores
    assert sorted(p.name for p in folder.iterdir()) == ["model.onnx", "model.weights"]


def _fp16_build(tmp_path: Path, sensitivity: GuardSensitivity, cache: Path) -> dict[str, object]:
    spec = spec_for(tmp_path)
    options = BuildOptions(repository=tmp_path / f"repo-{sensitivity.value}", runtime=OnnxRuntimeCPU(),
                           cache_dir=cache, guard_sensitivity=sensitivity)
    build_all([spec], options, None, ["pytest"])
    return dict(json.loads((options.repository / "offset_fp16" / "build.json").read_text()))


@pytest.mark.parametrize("sensitivity", list(GuardSensitivity))
def test_the_fp16_guard_meets_the_tolerance_keeping_the_subtraction_with_either_ranking(
        tmp_path: Path, sensitivity: GuardSensitivity) -> None:
    record = _fp16_build(tmp_path, sensitivity, tmp_path / "cache")
    guard = record["fp16_guard"]
    assert isinstance(guard, dict)
    assert guard["kept_fp32_nodes"] == ["centre"] and guard["fallback"] is None
    assert guard["after"]["cosine_min"] >= 0.999
    ranking = guard["sensitivity"]
    assert ranking["method"] == sensitivity.value and ranking["kept"] == 1 and ranking["nodes"] == 5
    # The search's conversions, plus (exhaustive) one per node.
    alone = 5 if sensitivity is GuardSensitivity.EXHAUSTIVE else 0
    assert guard["conversions"] == alone + len(guard["search"])


def test_fp16_conversions_are_reused_when_their_inputs_are_unchanged(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = _fp16_build(tmp_path, GuardSensitivity.ONE_PASS, cache)
    stored = sorted(p.name for p in (cache / "fp16").iterdir())
    assert stored and first["fp16_guard"]["cached_conversions"] == 0  # type: ignore[index]
    (tmp_path / "again").mkdir()  # the same model and samples, written again elsewhere
    second = _fp16_build(tmp_path / "again", GuardSensitivity.ONE_PASS, cache)
    guard = second["fp16_guard"]
    assert isinstance(guard, dict)
    assert guard["cached_conversions"] == guard["conversions"]
    assert sorted(p.name for p in (cache / "fp16").iterdir()) == stored  # nothing new was converted
    assert second["variant_onnx_sha256"] == first["variant_onnx_sha256"]


def test_a_node_the_conversion_fused_and_renamed_is_paired_by_its_tensors() -> None:
    # ONNX Runtime's pre-processing fuses Conv + Clip into one Conv named after the Conv's output and writing the
    # Clip's: paired by node name it went unscored (0) and the one-pass ranking missed EfficientNet's stem.
    def model(nodes: list[onnx.NodeProto]) -> onnx.ModelProto:
        x, y = (helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [1, 1, 4, 4]) for n in ("x", "y"))
        weights = helper.make_tensor("w", onnx.TensorProto.FLOAT, [1, 1, 1, 1], [2.0])
        graph = helper.make_graph(nodes, "g", [x], [y], [weights])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    fp32 = model([helper.make_node("Conv", ["x", "w"], ["c"], name="stem"),
                  helper.make_node("Clip", ["c"], ["y"], name="clip")])
    candidate = model([helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q"),
                       helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq"),
                       helper.make_node("Conv", ["xd", "w"], ["y"], name="c_fused")])
    pairs = node_tensors(fp32, candidate, ["c_fused"])
    assert [(p.fp32, p.candidate) for p in pairs["c_fused"].outputs] == [("y", "y")]
    assert [(p.fp32, p.candidate) for p in pairs["c_fused"].inputs] == [("x", "x")]  # before its Q/DQ pair
