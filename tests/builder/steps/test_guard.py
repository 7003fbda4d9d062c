"""Accuracy-guarded INT8 on a model built so that plain INT8 provably misses its tolerance."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from builder.errors import AccuracyError, ToolError
from builder.pipeline import BuildOptions, build_all
from builder.repository.onnx_files import sha256_file
from builder.runtimes.onnxruntime import OnnxRuntimeCPU, OnnxRuntimeReference, ort_session, run_session
from builder.spec import (
    CalibrationMethod,
    CalibrationSpec,
    DataSpec,
    DimRange,
    GuardSensitivity,
    Int8Recipe,
    ModelSpec,
    Precision,
    Task,
    Tolerance,
)
from builder.steps import accuracy, precision
from builder.steps.accuracy import Metrics
from builder.steps.context import ModelContext
from builder.steps.guard import guard, quantized_nodes
from builder.steps.sensitivity import one_pass
from tests.helpers.tiny_models import mlp_samples, outlier_mlp_onnx

TOLERANCE = Tolerance(cosine_min=0.995)


def outlier_spec(tmp_path: Path, recipe: Int8Recipe, tolerance: Tolerance) -> ModelSpec:
    onnx_path = outlier_mlp_onnx(tmp_path / "outlier.onnx")
    np.savez(tmp_path / "cal.npz", **mlp_samples(64, seed=0))
    np.savez(tmp_path / "eval.npz", **mlp_samples(32, seed=1))
    return ModelSpec(
        name="outlier", onnx=onnx_path, task=Task.CLASSIFICATION, batch=DimRange(1, 4, 8),
        precisions=(Precision.FP32, Precision.INT8),
        calibration=CalibrationSpec(DataSpec(str(tmp_path / "cal.npz"), 64), method=CalibrationMethod.MAX,
                                    recipe=recipe),
        evaluation=DataSpec(str(tmp_path / "eval.npz"), 32), tolerances={Precision.INT8: tolerance},
    )


def build(tmp_path: Path, spec: ModelSpec,
          sensitivity: GuardSensitivity = GuardSensitivity.ONE_PASS) -> dict[str, Any]:
    options = BuildOptions(repository=tmp_path / "repo", runtime=OnnxRuntimeCPU(), cache_dir=tmp_path / "cache",
                           guard_sensitivity=sensitivity)
    build_all([spec], options, None, ["pytest"])
    return dict(json.loads((tmp_path / "repo" / "outlier_int8" / "build.json").read_text()))


# ONNX Runtime 1.31's quantizer costs the input projection alone 0.007 of cosine on this model
# (measured: 0.9930), so its recipe gets a tolerance that the outlier chain, not fc_in, decides.
ORT_TOLERANCE = Tolerance(cosine_min=0.99)


# ONNX Runtime's recipe with the exhaustive ranking takes ~10 s: full tier only (its one-pass case, which does not
# escalate, stays in the fast tier).
@pytest.mark.parametrize(("recipe", "tolerance", "sensitivity"), [
    (Int8Recipe.MODELOPT, TOLERANCE, GuardSensitivity.ONE_PASS),
    (Int8Recipe.MODELOPT, TOLERANCE, GuardSensitivity.EXHAUSTIVE),
    (Int8Recipe.ONNXRUNTIME, ORT_TOLERANCE, GuardSensitivity.ONE_PASS),
    pytest.param(Int8Recipe.ONNXRUNTIME, ORT_TOLERANCE, GuardSensitivity.EXHAUSTIVE, marks=pytest.mark.slow),
])
def test_plain_int8_misses_and_the_guarded_build_meets_it_with_a_small_exclusion(
    tmp_path: Path, recipe: Int8Recipe, tolerance: Tolerance, sensitivity: GuardSensitivity
) -> None:
    spec = outlier_spec(tmp_path, recipe, tolerance)
    assert spec.calibration is not None and spec.onnx is not None
    # Plain INT8, the same recipe and data: outside the tolerance.
    plain = tmp_path / "plain.onnx"
    cal, ev = dict(np.load(tmp_path / "cal.npz")), dict(np.load(tmp_path / "eval.npz"))
    precision.to_int8(spec.onnx, fp32_sha=sha256_file(spec.onnx), calibration=cal, data_digest="plain",
                      spec=spec.calibration, out_path=plain, cache_dir=tmp_path / "cache", log_file=None)
    assert quantized_nodes(onnx.load(str(plain)))
    metrics = accuracy.compare(run_session(ort_session(spec.onnx), ev, 8), run_session(ort_session(plain), ev, 8),
                               Task.CLASSIFICATION)
    with pytest.raises(AccuracyError, match="cosine_min"):
        accuracy.check(metrics, tolerance, "outlier_int8")

    record = build(tmp_path, spec, sensitivity)
    guard = record["guard"]
    assert guard["before"]["cosine_min"] < tolerance.cosine_min
    assert guard["fallback"] is None
    # A small set around the outlier (ModelOpt: fc2 alone; ORT, which quantizes every tensor its
    # quantized producers write: the chain fc1 → bias1 → fc2), never half of the quantized nodes.
    assert "fc2" in guard["excluded"] and len(guard["excluded"]) <= 3
    assert len(guard["excluded"]) <= len(guard["most_sensitive"]) / 2
    assert guard["after"]["cosine_min"] >= tolerance.cosine_min
    assert record["accuracy"]["cosine_min"] >= tolerance.cosine_min
    assert guard["most_sensitive"][0]["node"] in guard["excluded"]
    # Exhaustive: one quantization per node, then one per candidate of the search. One pass: no quantization
    # after the plain INT8's: every candidate is derived from its calibration (qdq_mix), and no escalation
    # (ONNX Runtime's recipe rounds a tensor where its producer writes it: a derived candidate reads FP32 at
    # the excluded node itself, so the one-pass ranking's search finds the mix).
    ranking = guard["sensitivity"]
    assert not ranking["escalated"]
    if sensitivity is GuardSensitivity.EXHAUSTIVE:
        assert guard["quantizations"] == len(guard["most_sensitive"]) + len(guard["search"])
        assert guard["derived"] == 0
    else:
        assert guard["quantizations"] == 0 and guard["derived"] == len(guard["search"])
    assert ranking["method"] == sensitivity.value and ranking["kept"] == len(guard["excluded"])
    assert ranking["nodes"] == len(guard["most_sensitive"]) and ranking["seconds"] >= 0
    assert ranking["peak_rss_mib"] > 0
    # The guard inside the gate (which also compiles and measures the guarded mix), listed before it (the
    # steps after the gate are not this test's).
    steps = [s["step"] for s in record["steps"]]
    assert steps[:5] == ["MakePrecision", "Compile", "Measure", "Guard", "Gate"], steps
    assert all(s["peak_rss_mib"] > 0 and s["seconds"] >= 0 for s in record["steps"])
    assert set(guard["throughput_b1_cpu"]) == {"fp32", "int8_plain", "int8_guarded"}
    assert record["calibration"]["recipe"] == recipe.value
    served = onnx.load(str(tmp_path / "repo" / "outlier_int8" / "1" / "model.onnx"))
    assert quantized_nodes(served) and "fc2" not in quantized_nodes(served)
    assert record["variant_onnx_sha256"] == sha256_file(tmp_path / "repo" / "outlier_int8" / "1" / "model.onnx")


def test_with_the_guard_off_the_int8_variant_missing_the_default_tolerance_just_fails(tmp_path: Path) -> None:
    # Guards run by default whatever the tolerance's source (test_onnx_journey.py covers that); --no-guard
    # (guard=False) leaves the plain INT8 to fail against the default tolerance.
    spec = outlier_spec(tmp_path, Int8Recipe.MODELOPT, TOLERANCE)
    unguarded = ModelSpec(**{**spec.__dict__, "tolerances": {}, "guard": False})
    options = BuildOptions(repository=tmp_path / "repo", runtime=OnnxRuntimeCPU(), cache_dir=tmp_path / "cache")
    (result,) = build_all([unguarded], options, None, ["pytest"])
    (failure,) = result.failures
    assert (failure.variant, failure.metric, failure.limit) == ("outlier_int8", "cosine_min", 0.97)
    assert failure.value is not None and failure.value < 0.97 and not failure.kept_previous
    assert [v.name for v in result.variants] == ["outlier_fp32"]
    assert not (tmp_path / "repo" / "outlier_int8").exists()
    assert (tmp_path / "repo" / "outlier_fp32" / "build.json").is_file()
    with pytest.raises(AccuracyError, match="outlier_int8: cosine_min"):
        options.all_or_nothing = True
        build_all([unguarded], BuildOptions(repository=tmp_path / "repo2", runtime=OnnxRuntimeCPU(),
                                            cache_dir=tmp_path / "cache", all_or_nothing=True), None, ["pytest"])
    assert not (tmp_path / "repo2" / "outlier_fp32").exists()


@pytest.mark.parametrize("recipe", list(Int8Recipe))
def test_when_no_int8_mix_meets_the_tolerance_fp16_is_served(tmp_path: Path, recipe: Int8Recipe) -> None:
    # FP16 stays within 3e-4 of FP32 on this model; no INT8 mix with at most half the nodes excluded does.
    record = build(tmp_path, outlier_spec(tmp_path, recipe, Tolerance(max_abs=0.002)))
    guard = record["guard"]
    assert guard["fallback"] == "fp16" and guard["excluded"] == [] and guard["after"] is None
    # (One pass also tries more than half excluded, to prune back from: none that size counts.)
    limit = guard["sensitivity"]["nodes"] // 2
    assert all(not step["passes"] for step in guard["search"] if step["excluded"] <= limit)
    # Before giving up, ModelOpt's recipe ranks each node alone (derived candidates too: no quantization);
    # ONNX Runtime's does not: its one-pass search is the whole search by design.
    escalated = guard["sensitivity"]["escalated"]
    ran = Int8Recipe(record["calibration"]["recipe"])  # "auto" resolved
    assert escalated == (ran is Int8Recipe.MODELOPT)
    alone = guard["sensitivity"]["nodes"] if escalated else 0
    if ran is Int8Recipe.ONNXRUNTIME_DYNAMIC:  # no calibrated scales to derive from: each candidate quantized
        assert guard["derived"] == 0 and guard["quantizations"] == alone + len(guard["search"])
    else:
        assert guard["derived"] == alone + len(guard["search"]) and guard["quantizations"] == 0
    assert {step["ranking"] for step in guard["search"]} == ({"one-pass", "exhaustive"} if escalated else {"one-pass"})
    assert record["accuracy"]["max_abs"] <= 0.002
    served = onnx.load(str(tmp_path / "repo" / "outlier_int8" / "1" / "model.onnx"))
    assert not quantized_nodes(served)
    assert any(i.data_type == onnx.TensorProto.FLOAT16 for i in served.graph.initializer)


def test_when_fp16_misses_the_int8_tolerance_too_the_fp32_graph_is_served_under_the_int8_name(tmp_path: Path) -> None:
    # FP16 stays within 3e-4 of FP32 here: a limit of 1e-6 no INT8 mix and no FP16 graph meets (PP-OCR's detector
    # on text-free images: its INT8 was not written at all). The FP32 graph meets it and is served, said so.
    record = build(tmp_path, outlier_spec(tmp_path, Int8Recipe.ONNXRUNTIME, Tolerance(max_abs=1e-6)))
    guard = record["guard"]
    assert guard["fallback"] == "fp32" and guard["excluded"] == [] and guard["after"] is None
    assert record["accuracy"]["max_abs"] <= 1e-6
    # FP32 itself is the variant to serve: marked so without measuring the same graph twice.
    assert record["speed"]["worth_serving"] is False and "the FP32 graph" in record["speed"]["reason"]
    assert record["speed"]["throughput"] is None and record["speed"]["rounds"] == []
    served = onnx.load(str(tmp_path / "repo" / "outlier_int8" / "1" / "model.onnx"))
    assert not quantized_nodes(served)
    assert all(i.data_type == onnx.TensorProto.FLOAT for i in served.graph.initializer)


def test_when_the_fp16_fallback_does_not_convert_the_fp32_graph_is_served_under_the_int8_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Autocast's "Sanity Check Failed" (silero VAD) in the fallback stopped the INT8 variant instead.
    def refused(*_: Any, **__: Any) -> dict[str, object]:
        raise ToolError("model 'outlier': FP16 conversion (ModelOpt autocast) failed: Sanity Check Failed")

    monkeypatch.setattr(precision, "to_fp16", refused)
    record = build(tmp_path, outlier_spec(tmp_path, Int8Recipe.ONNXRUNTIME, Tolerance(max_abs=0.002)))
    assert record["guard"]["fallback"] == "fp32" and record["accuracy"]["max_abs"] == 0


@pytest.mark.parametrize("sensitivity", list(GuardSensitivity))
def test_one_pass_calibrates_once_per_guard_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                sensitivity: GuardSensitivity) -> None:
    # A tensor's calibrated range does not depend on which nodes are quantized: one pass calibrates for the
    # plain INT8 only and derives every candidate from it, asking ModelOpt only where it would place Q/DQ for
    # the candidate's exclusions (a run on one sample); exhaustive (the old behaviour) calibrates each.
    runs: list[tuple[CalibrationMethod, int]] = []
    real = precision._quantize_modelopt

    def counting(fp32_path: Path, calibration: Any, spec: CalibrationSpec, out: Path) -> None:
        runs.append((spec.method, len(next(iter(calibration.values())))))
        real(fp32_path, calibration, spec, out)

    monkeypatch.setattr(precision, "_quantize_modelopt", counting)
    record = build(tmp_path, outlier_spec(tmp_path, Int8Recipe.MODELOPT, TOLERANCE), sensitivity)
    guard = record["guard"]
    assert guard["excluded"] and guard["search"]
    calibrations = [run for run in runs if run[1] == 64]  # every calibration sample
    placements = [run for run in runs if run[1] == 1]
    assert len(runs) == len(calibrations) + len(placements)
    assert len(calibrations) == 1 + guard["quantizations"]
    if sensitivity is GuardSensitivity.ONE_PASS:
        assert guard["quantizations"] == 0 and guard["derived"] == len(guard["search"]) == len(placements)
    else:
        assert guard["derived"] == 0 and guard["quantizations"] > len(guard["search"]) and not placements


def test_the_int8_guard_scores_its_candidates_as_the_gate_does(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # The gate judges every shape level (ModelContext.measure); a guard scoring only the evaluation samples
    # picked a mix that then missed at the gate (MiniLM INT8 in the demo). Here the INT8 guard is the only
    # caller of ModelContext.measure (the Measure step uses measure_levels; no FP16 variant is built).
    scored: list[Metrics] = []
    real = ModelContext.measure

    def recording(self: ModelContext, run: Any) -> Metrics:
        scored.append(real(self, run))
        return scored[-1]

    monkeypatch.setattr(ModelContext, "measure", recording)
    record = build(tmp_path, outlier_spec(tmp_path, Int8Recipe.MODELOPT, TOLERANCE))
    guard = record["guard"]
    assert guard["excluded"] and len(scored) >= 1 + len(guard["search"])  # the plain INT8, then each candidate


def test_an_int8_graph_with_no_quantized_node_is_not_searched(tmp_path: Path) -> None:
    # Nothing to exclude: the ranking and the search re-quantized the same graph (one pass, then escalated to
    # the exhaustive ranking: two more quantizations and evaluations) before falling back all the same.
    from onnx import helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 4])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 4])])
    plain = tmp_path / "plain.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(plain))
    quantized: list[Path] = []
    far = Metrics(max_abs=1.0, max_rel=1.0, cosine_min=0.5, cosine_mean=0.5, samples=4)
    spec = CalibrationSpec(DataSpec("unused.npz", 4), method=CalibrationMethod.MAX, recipe=Int8Recipe.ONNXRUNTIME)
    samples = {"x": np.ones((4, 4), np.float32)}
    for method in GuardSensitivity:
        result, path = guard(lambda _spec, out: quantized.append(out), spec=spec, plain=plain, evaluation=samples,
                             reference=samples, task=Task.GENERIC, tolerance=TOLERANCE, work=tmp_path,
                             executor=OnnxRuntimeReference(), method=method, fp32=plain, measure=lambda _path: far)
        assert path is None and not result.met and result.quantizations == 0 and quantized == []
        assert result.ranking is not None and result.ranking.nodes == 0 and not result.ranking.escalated


def test_where_modelopt_fails_onnx_runtimes_recipe_makes_the_int8_and_its_guard_candidates(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """ModelOpt failing on the model (here: raised from onnx's own checker, as a tool failure is): the plain INT8
    is ONNX Runtime's recipe, said in one warning and recorded, and the guard's candidates use that recipe too
    instead of running the failing one again for each (one warning, not one per candidate)."""
    calls = []

    def failing_modelopt(*args: object, **kwargs: object) -> None:
        calls.append(args)
        onnx.checker.check_model(onnx.ModelProto())  # raises inside onnx: a tool's failure

    monkeypatch.setattr(precision, "_quantize_modelopt", failing_modelopt)
    spec = outlier_spec(tmp_path, Int8Recipe.MODELOPT, ORT_TOLERANCE)
    record = build(tmp_path, spec)
    assert len(calls) == 1
    warned = [r.getMessage() for r in caplog.records if "ONNX Runtime's recipe instead" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("model 'outlier': "), warned
    settings = record["precision_settings"]
    assert settings["instead_of"] == "modelopt.onnx.quantization" and "ir_version" in settings["why"]
    # Its candidates derived from that recipe's calibration: no quantization again, ModelOpt's or ONNX Runtime's.
    guard = record["guard"]
    assert guard["derived"] > 0 and guard["quantizations"] == 0 and guard["fallback"] is None
    assert not guard["sensitivity"]["escalated"]


def test_one_pass_finds_a_mix_lower_in_its_order_by_pruning_a_longer_prefix(tmp_path: Path) -> None:
    # The one-pass figure is first-order: here the mix that meets the tolerance is its first node and its last.
    # No prefix of at most half the nodes meets it; the smallest passing prefix, pruned back node by node, does,
    # without a quantization or the exhaustive ranking.
    model = outlier_mlp_onnx(tmp_path / "outlier.onnx")
    plain = tmp_path / "plain.onnx"
    spec = CalibrationSpec(DataSpec("unused.npz", 64), method=CalibrationMethod.MAX, recipe=Int8Recipe.MODELOPT)
    precision.to_int8(model, fp32_sha=sha256_file(model), calibration=mlp_samples(64, seed=0), data_digest="p",
                      spec=spec, out_path=plain, cache_dir=tmp_path / "cache", log_file=None)
    nodes = quantized_nodes(onnx.load(str(plain)))
    evaluation = mlp_samples(16, seed=1)
    scores = one_pass(model, plain, nodes, evaluation, 8)
    order = sorted(nodes, key=lambda n: scores[n], reverse=True)
    needed = {order[0], order[-1]}
    assert len(nodes) == 4 and len(needed) == 2

    def measure(path: Path) -> Metrics:
        unquantized = set(nodes) - set(quantized_nodes(onnx.load(str(path))))
        cosine = 1.0 if needed <= unquantized else 0.5
        return Metrics(max_abs=0.0, max_rel=0.0, cosine_min=cosine, cosine_mean=cosine, samples=16)

    quantized: list[CalibrationSpec] = []
    result, path = guard(lambda s, _out: quantized.append(s), spec=spec, plain=plain, evaluation=evaluation,
                         reference=evaluation, task=Task.GENERIC, tolerance=TOLERANCE, work=tmp_path,
                         executor=OnnxRuntimeReference(), method=GuardSensitivity.ONE_PASS, fp32=model, measure=measure)
    assert result.met and set(result.excluded) == needed and path is not None
    assert quantized == [] and result.quantizations == 0 and result.derived == len(result.searched)
    assert result.ranking is not None and not result.ranking.escalated
    assert set(nodes) - set(quantized_nodes(onnx.load(str(path)))) == needed
    # Every prefix up to half missed; the longer one that met it was pruned back to the two that matter.
    assert [a.passes for a in result.searched if a.excluded <= 2][:2] == [False, False]
