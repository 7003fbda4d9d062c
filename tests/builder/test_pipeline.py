"""The whole pipeline on tiny generated models: every precision, reuse, tolerance failures, atomicity."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest

from builder.errors import AccuracyError, DataError
from builder.pipeline import BuildOptions, ModelStatus, build_all
from builder.repository.triton_config import parse
from builder.runtimes import OnnxRuntimeCPU
from builder.spec import (
    CalibrationMethod,
    DataSpec,
    DimRange,
    GuardSensitivity,
    Int8Recipe,
    ModelSpec,
    Precision,
    Task,
    TensorSpec,
    Tolerance,
)
from builder.steps.build_key import precision_settings, rebuild_reasons
from tests.helpers.files import snapshot
from tests.helpers.tiny_models import mlp_samples, tiny_specs


def options(repository: Path, cache: Path) -> BuildOptions:
    return BuildOptions(repository=repository, runtime=OnnxRuntimeCPU(), cache_dir=cache)


def test_every_precision_is_built_checked_and_recorded(tiny_repository: tuple[Path, list[ModelSpec]]) -> None:
    repository, _ = tiny_repository
    names = sorted(p.name for p in repository.iterdir() if p.is_dir())
    assert names == ["mlp_fp16", "mlp_fp32", "mlp_int8", "seq_fp16", "seq_fp32"]
    for name in names:
        record = json.loads((repository / name / "build.json").read_text())
        assert record["name"] == name and len(record["sha256"]) == 64
        assert record["tools"]["onnxruntime"] and record["tools"]["nvidia-modelopt"]
        assert record["served_options"] == {}  # the CPU runtime has no option that depends on the graph
        config = parse((repository / name / "config.pbtxt").read_text())
        assert config.name == name and config.backend == "python"
        assert (repository / name / "1" / "model.onnx").is_file()
        assert (repository / name / "1" / "model.py").is_file()
    fp16 = onnx.load(str(repository / "mlp_fp16" / "1" / "model.onnx"))
    assert any(i.data_type == onnx.TensorProto.FLOAT16 for i in fp16.graph.initializer)
    assert fp16.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT  # I/O stay FP32
    int8 = onnx.load(str(repository / "mlp_int8" / "1" / "model.onnx"))
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in int8.graph.node}
    mlp8 = json.loads((repository / "mlp_int8" / "build.json").read_text())
    assert mlp8["accuracy"]["top1_agreement"] >= 0.8
    assert mlp8["calibration"]["method"] == "entropy" and mlp8["calibration"]["samples"] == 64
    report = json.loads((repository / "build_report.json").read_text())
    assert {m["name"] for m in report["models"]} == {"mlp", "seq"}
    assert parse((repository / "seq_fp32" / "config.pbtxt").read_text()).max_batch_size == 4


def test_unchanged_inputs_rebuild_nothing(tiny_repository: tuple[Path, list[ModelSpec]], repo_copy: Path,
                                          tmp_path: Path) -> None:
    _, specs = tiny_repository
    before = snapshot(repo_copy)
    results = build_all(specs, options(repo_copy, tmp_path / "cache"), None, ["pytest"])
    assert [r.status for r in results] == ["unchanged", "unchanged"]
    assert snapshot(repo_copy) == before


def test_calibration_is_reused_while_its_inputs_are_unchanged(tmp_path: Path) -> None:
    mlp = tiny_specs(tmp_path)[0]
    cache = tmp_path / "cache"
    first = build_all([mlp], options(tmp_path / "r1", cache), None, ["pytest"])
    second = build_all([mlp], options(tmp_path / "r2", cache), None, ["pytest"])
    int8 = next(v for v in first[0].variants if v.precision == "int8")
    again = next(v for v in second[0].variants if v.precision == "int8")
    assert int8.calibration and not int8.calibration.cached
    assert again.calibration and again.calibration.cached
    assert again.sha256 == int8.sha256
    np.savez(tmp_path / "mlp_calib.npz", **mlp_samples(64, seed=7))  # new data, new calibration
    third = build_all([mlp], options(tmp_path / "r3", cache), None, ["pytest"])
    fresh = next(v for v in third[0].variants if v.precision == "int8")
    assert fresh.calibration and not fresh.calibration.cached


def test_max_calibration_method_builds_too(tmp_path: Path) -> None:
    mlp = tiny_specs(tmp_path)[0]
    assert mlp.calibration is not None
    spec = replace(mlp, precisions=(Precision.FP32, Precision.INT8),
                   calibration=replace(mlp.calibration, method=CalibrationMethod.MAX))
    (result,) = build_all([spec], options(tmp_path / "r", tmp_path / "cache"), None, ["pytest"])
    assert result.variants[1].calibration and result.variants[1].calibration.method is CalibrationMethod.MAX


def test_tolerance_failure_names_the_variant_and_leaves_the_repository_untouched(
    tiny_repository: tuple[Path, list[ModelSpec]], repo_copy: Path, tmp_path: Path
) -> None:
    _, specs = tiny_repository
    # No guard: with it, the FP32 graph would be served under the INT8 name (test_guard.py covers that).
    strict = replace(specs[0], tolerances={Precision.INT8: Tolerance(max_abs=1e-6)}, guard=False)
    before = snapshot(repo_copy)
    opts = options(repo_copy, tmp_path / "cache")
    opts.force = True
    opts.all_or_nothing = True
    with pytest.raises(AccuracyError, match=r"mlp_int8: max_abs = [0-9.e-]+ is above the limit max_abs = 1e-06"):
        build_all([specs[1], strict], opts, None, ["pytest"])
    assert snapshot(repo_copy) == before
    assert not [p for p in repo_copy.iterdir() if p.name.startswith((".staging-", ".trash-"))]


def test_a_failing_variant_is_listed_while_the_others_are_written_and_its_previous_copy_stays(
    tiny_repository: tuple[Path, list[ModelSpec]], repo_copy: Path, tmp_path: Path
) -> None:
    _, specs = tiny_repository
    # No guard: with it, the FP32 graph would be served under the INT8 name (test_guard.py covers that).
    strict = replace(specs[0], tolerances={Precision.INT8: Tolerance(max_abs=1e-6)}, guard=False)
    before = snapshot(repo_copy)
    opts = options(repo_copy, tmp_path / "cache")
    opts.force = True
    report = tmp_path / "report.json"
    results = build_all([specs[1], strict], opts, report, ["pytest"])
    failed = [f for r in results for f in r.failures]
    assert [(f.variant, f.metric, f.limit, f.kept_previous) for f in failed] == [("mlp_int8", "max_abs", 1e-6, True)]
    assert failed[0].value is not None and failed[0].value > 1e-6
    assert "mlp_int8 not written: max_abs = " in failed[0].line() and "previous mlp_int8 stays" in failed[0].line()
    after = snapshot(repo_copy)
    # The failing variant's previous copy is untouched; every passing variant was rewritten.
    assert {k: v for k, v in after.items() if k.startswith("mlp_int8/")} == \
        {k: v for k, v in before.items() if k.startswith("mlp_int8/")}
    rebuilt = {v.name for r in results for v in r.variants}
    assert "mlp_int8" not in rebuilt and {"mlp_fp32", "mlp_fp16"} <= rebuilt
    assert not [p for p in repo_copy.iterdir() if p.name.startswith((".staging-", ".trash-"))]
    recorded = json.loads(report.read_text())
    assert [f["variant"] for m in recorded["models"] for f in m["failures"]] == ["mlp_int8"]


def test_bad_calibration_data_fails_before_anything_is_written(
    tiny_repository: tuple[Path, list[ModelSpec]], repo_copy: Path, tmp_path: Path
) -> None:
    _, specs = tiny_repository
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.zeros((64, 4, 32), np.float64))
    assert specs[0].calibration is not None
    spec = replace(specs[0], calibration=replace(specs[0].calibration,
                                                 data=replace(specs[0].calibration.data, source=str(bad))))
    before = snapshot(repo_copy)
    with pytest.raises(DataError, match="input 'x' has dtype float64, expected float32"):
        build_all([spec], options(repo_copy, tmp_path / "cache"), repo_copy / "build_report.json", ["pytest"])
    # No model is touched, and the report is written all the same (then the error raised): it lists the failure.
    assert {k: v for k, v in snapshot(repo_copy).items() if k != "build_report.json"} == \
        {k: v for k, v in before.items() if k != "build_report.json"}
    # The report accumulates across builds: the earlier builds' other models stay listed beside this failure.
    models = json.loads((repo_copy / "build_report.json").read_text())["models"]
    (recorded,) = [m for m in models if m["name"] == spec.name]
    assert recorded["status"] == "failed"
    assert {m["name"] for m in models} == {s.name for s in specs}
    assert "input 'x' has dtype float64, expected float32" in recorded["error"]
    # Beside a model that builds: that one is written, this one listed with its reason, untouched.
    opts = options(repo_copy, tmp_path / "cache")
    opts.force = True
    bad, good = build_all([spec, specs[1]], opts, None, ["pytest"])
    assert bad.status is ModelStatus.FAILED and bad.variants == []
    assert bad.error is not None and "input 'x' has dtype float64, expected float32" in bad.error
    assert [f.variant for f in bad.failures] == ["mlp_fp32", "mlp_fp16", "mlp_int8"]
    assert all(f.kept_previous for f in bad.failures)
    after = snapshot(repo_copy)
    assert {k: v for k, v in after.items() if k.startswith("mlp_")} == \
        {k: v for k, v in before.items() if k.startswith("mlp_")}
    assert good.status is ModelStatus.BUILT and after != before


def test_pytorch_source_is_exported_with_a_dynamic_batch_axis(tmp_path: Path) -> None:
    spec = ModelSpec(
        name="tiny_torch", source="tests.helpers.tiny_models:tiny_torch", task=Task.CLASSIFICATION,
        inputs=(TensorSpec("x", "float32", (-1, 4, 32)),), outputs=("logits",), batch=DimRange(1, 4, 8),
        precisions=(Precision.FP32, Precision.FP16),
    )
    spec = replace(spec, evaluation=DataSpec("tests.helpers.tiny_models:mlp_samples_fn", 24, 3))
    (result,) = build_all([spec], options(tmp_path / "repo", tmp_path / "cache"), None, ["pytest"])
    assert [v.precision for v in result.variants] == ["fp32", "fp16"]
    model = onnx.load(str(tmp_path / "repo" / "tiny_torch_fp32" / "1" / "model.onnx"))
    batch_dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    assert batch_dim.dim_param and not batch_dim.dim_value
    assert model.opset_import[0].version >= 17
    assert result.variants[1].accuracy.top1_agreement == 1.0


def test_onnxruntime_int8_recipe_quantizes_per_channel_and_passes(tmp_path: Path) -> None:
    mlp = tiny_specs(tmp_path)[0]
    assert mlp.calibration is not None
    spec = replace(mlp, precisions=(Precision.FP32, Precision.INT8),
                   calibration=replace(mlp.calibration, recipe=Int8Recipe.ONNXRUNTIME, method=CalibrationMethod.MAX))
    (result,) = build_all([spec], options(tmp_path / "r", tmp_path / "cache"), None, ["pytest"])
    int8 = result.variants[1]
    assert int8.calibration is not None
    assert int8.calibration.recipe == "onnxruntime" and int8.calibration.quantize_linear_nodes > 0
    model = onnx.load(str(tmp_path / "r" / "mlp_int8" / "1" / "model.onnx"))
    weight_scales = [i for i in model.graph.initializer if i.name.endswith("_scale") and len(i.dims) == 1]
    assert weight_scales, "per-channel quantization stores one scale per output channel"
    assert int8.accuracy.top1_agreement >= 0.8


def test_rebuild_reasons_name_what_changed(tiny_repository: tuple[Path, list[ModelSpec]], repo_copy: Path) -> None:
    _, specs = tiny_repository
    record_path = repo_copy / "mlp_int8" / "build.json"
    record = json.loads(record_path.read_text())
    wanted = {k: v for k, v in record["inputs"].items() if k != "settings"}  # what every variant shares
    own = {p: {"settings": json.loads((repo_copy / f"mlp_{p.value}" / "build.json").read_text())["inputs"]["settings"]}
           for p in specs[0].precisions}  # each variant's own
    assert rebuild_reasons(specs[0], repo_copy, wanted, per_precision=own) == []  # only --force rebuilds
    wanted["calibration"] = "0" * 64
    wanted["runtime"] = {"tensorrt": "10.13.0", "gpu": "NVIDIA H200"}
    reasons = rebuild_reasons(specs[0], repo_copy, wanted, per_precision=own)
    assert "calibration data changed" in reasons
    assert any(r.startswith("runtime changed (") and "gpu None -> NVIDIA H200" in r for r in reasons)
    # A key only one side has (an older record's, or a new kind of input) is named, not hidden.
    record["inputs"]["serving_backend"] = "python"
    record_path.write_text(json.dumps(record))
    assert "serving_backend changed" in rebuild_reasons(specs[0], repo_copy, dict(wanted, calibration=None),
                                                        per_precision=own)
    # One precision's own settings: named with the precision, and where the spec came from.
    own[Precision.INT8] = {"settings": {**own[Precision.INT8]["settings"], "tolerance": {"cosine_min": 0.5}}}
    reasons = rebuild_reasons(specs[0], repo_copy, wanted, per_precision=own, origin="build flags")
    assert [r for r in reasons if r.startswith("build flags changed: ")] == \
        ["build flags changed: tolerance int8 (cosine_min 0.95 -> 0.5, top1_agreement_min 0.8 -> None)"]


def test_the_guards_ranking_method_is_in_the_fp16_and_int8_build_keys(
        tiny_repository: tuple[Path, list[ModelSpec]], repo_copy: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    # Another ranking can keep other nodes in higher precision: FP16 and INT8 rebuild, FP32 (no guard) does not.
    _, specs = tiny_repository
    mlp = specs[0]
    assert set(mlp.precisions) == {Precision.FP32, Precision.FP16, Precision.INT8}
    exhaustive = BuildOptions(repository=repo_copy, runtime=OnnxRuntimeCPU(), cache_dir=tmp_path / "cache",
                              guard_sensitivity=GuardSensitivity.EXHAUSTIVE)
    with caplog.at_level(logging.INFO, logger="builder.pipeline"):
        (result,) = build_all([mlp], exhaustive, None, ["pytest"])
    assert sorted(v.name for v in result.variants) == ["mlp_fp16", "mlp_int8"]
    (line,) = [r.getMessage() for r in caplog.records if "rebuilding" in r.getMessage()]
    assert "--guard-sensitivity changed: guard_sensitivity fp16 (one-pass -> exhaustive)" in line
    assert "models.toml entry" not in line  # a flag of this run, not the manifest
    assert "guard_sensitivity int8 (one-pass -> exhaustive)" in line
    # With the guard off the method decides nothing: not in the key.
    unguarded = replace(mlp, guard=False)
    exhaustive_method = GuardSensitivity.EXHAUSTIVE
    assert all("guard_sensitivity" not in precision_settings(unguarded, p, guard_sensitivity=exhaustive_method)
               for p in Precision)
    assert "guard_sensitivity" not in precision_settings(mlp, Precision.FP32, guard_sensitivity=exhaustive_method)
