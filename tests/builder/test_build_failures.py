"""`trtbuild build` when a variant fails: the others are written, each failure is one line on stderr,
exit status 1; a library's failure is one line naming the model, the step, the cause and the build log;
`--all-or-nothing` writes nothing; `--tolerance` sets limits from the command line."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from builder.cli import main
from builder.errors import BuilderError, ManifestError
from builder.pipeline import BuildOptions, ModelStatus, build_all
from builder.runtimes.base import CompileTarget
from builder.runtimes.onnxruntime import OnnxRuntimeCPU
from builder.spec import CalibrationSpec, DataSpec, DimRange, ModelSpec, Precision, Tolerance
from builder.spec.tolerances import parse_tolerances, with_tolerances
from builder.steps import fp16_fallback
from tests.helpers.files import snapshot
from tests.helpers.foreign_models import detector
from tests.helpers.tiny_models import mlp_samples, outlier_mlp_onnx


def contrib_gelu_onnx(path: Path) -> Path:
    """MatMul → com.microsoft Gelu → MatMul → Celu: ONNX Runtime runs it; ModelOpt autocast rewrites the Gelu to the
    standard one, which opset 17 lacks, and fails; onnxconverter-common's FP16 (the fallback) gives the Celu
    an FP16 input, which Celu does not take, and ONNX Runtime refuses its graph until the repair keeps the
    Celu in FP32 (fp16_fallback.MAX_REPAIRS rounds)."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"),
         helper.make_node("Gelu", ["h"], ["g"], name="gelu", domain="com.microsoft"),
         helper.make_node("MatMul", ["g", "w"], ["h2"], name="fc2"),
         helper.make_node("Celu", ["h2"], ["y"], name="celu")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        initializer=[numpy_helper.from_array(np.eye(8, dtype=np.float32), "w")])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    onnx.save(model, str(path))
    return path


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Relative paths on the command line (as a user types them); a private calibration cache."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRTBUILD_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_a_library_failure_is_one_line_naming_model_step_cause_and_log(
        workdir: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # No repair round: the fallback's graph keeps the FP16 Celu that ONNX Runtime refuses (both tools fail).
    monkeypatch.setattr(fp16_fallback, "MAX_REPAIRS", 0)
    contrib_gelu_onnx(workdir / "gelu.onnx")
    code = main(["build", "-q", "--onnx", "gelu.onnx", "--name", "gelu", "--repository", "repo", "--log", "build.log"])
    err = capfd.readouterr().err
    assert code == 1
    lines = err.splitlines()
    assert len(lines) == 1, err
    (line,) = lines
    assert line.startswith("trtbuild: error: gelu_fp16 not written: model 'gelu': FP16 conversion (ModelOpt "
                           "autocast) failed: ")
    assert "Gelu" in line and line.endswith("(full output: build.log)")
    assert "\x1b[" not in line and "/tmp" not in line and "trtbuild-" not in line
    log_text = (workdir / "build.log").read_text()
    assert "Traceback" in log_text and "fp16 model 'gelu'" in log_text
    # The variant that does build is written.
    assert (workdir / "repo" / "gelu_fp32" / "build.json").is_file()
    assert not (workdir / "repo" / "gelu_fp16").exists()


def test_a_failing_variant_keeps_its_previous_copy_and_all_or_nothing_writes_nothing(
        workdir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    outlier_mlp_onnx(workdir / "outlier.onnx")
    np.savez(workdir / "cal.npz", **mlp_samples(64, seed=0))
    np.savez(workdir / "eval.npz", **mlp_samples(32, seed=1))
    command = ["build", "-q", "--onnx", "outlier.onnx", "--name", "outlier", "--precision", "fp32,int8",
               "--calibration", "cal.npz", "--eval-data", "eval.npz", "--task", "classification",
               "--calibration-method", "max", "--repository", "repo", "--log", "build.log"]
    # Plain INT8 on this model: cosine ~0.13 against FP32, far below the default 0.97.
    assert main([*command, "--tolerance", "int8:cosine_min=0.1"]) == 0
    capfd.readouterr()
    first = snapshot(workdir / "repo")
    assert any(k.startswith("outlier_int8/") for k in first)
    fp32_folder = (workdir / "repo" / "outlier_fp32").stat().st_ino

    # --no-guard: the default limit is missed, and no guard searches for a mix that meets it.
    assert main([*command, "--force", "--no-guard"]) == 1
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("trtbuild: error: outlier_int8 not written: cosine_min = 0.")
    assert lines[0].endswith("is below the limit cosine_min = 0.97 (no guard: --no-guard); the previous "
                             "outlier_int8 stays in place")
    second = snapshot(workdir / "repo")
    int8 = {k: v for k, v in first.items() if k.startswith("outlier_int8/")}
    assert {k: v for k, v in second.items() if k.startswith("outlier_int8/")} == int8
    assert (workdir / "repo" / "outlier_fp32").stat().st_ino != fp32_folder  # rebuilt and swapped in
    report = json.loads((workdir / "repo" / "build_report.json").read_text())
    (failure,) = report["models"][0]["failures"]
    assert (failure["variant"], failure["metric"], failure["limit"]) == ("outlier_int8", "cosine_min", 0.97)

    assert main([*command, "--force", "--no-guard", "--all-or-nothing"]) == 1
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("trtbuild: error: outlier_int8: cosine_min = 0.")
    assert {k: v for k, v in snapshot(workdir / "repo").items() if k != "build_report.json"} == \
        {k: v for k, v in second.items() if k != "build_report.json"}


@pytest.mark.parametrize(("value", "expected"), [
    # What models.toml's [model.tolerances] schema says, with the flag's spelling in place of the key.
    ("fp8:cosine_min=0.9", "--tolerance fp8: unknown key; expected one of fp32, fp16, int8"),
    ("fp16:cosine=0.9", "--tolerance fp16:cosine: unknown key; did you mean cosine_min?"),
    ("fp16:cosine_min=high", '--tolerance fp16:cosine_min: expected a number from 0 to 1, got "high"'),
    ("fp16:cosine_min=1.5", "--tolerance fp16:cosine_min: expected a number from 0 to 1, got 1.5"),
    ("fp16:max_abs=-1", "--tolerance fp16:max_abs: expected a number >= 0, got -1.0"),
    ("fp16:max_abs=inf", "--tolerance fp16:max_abs: expected a finite number >= 0, got inf"),
    ("cosine_min=0.9", "--tolerance 'cosine_min=0.9': expected PRECISION:METRIC=VALUE"),
    ("int8:cosine_min=0.9", "--tolerance int8: no model of this build makes an int8 variant (they make fp32, fp16)"),
    ("fp16:cosine_min=0.9,fp16:cosine_min=0.8", "--tolerance 'fp16:cosine_min=0.9,fp16:cosine_min=0.8': "
                                                "fp16:cosine_min is given twice; expected it once"),
    ("fp16:cosine_min=0.9,", "--tolerance 'fp16:cosine_min=0.9,': an empty item between commas; expected "
                             "PRECISION:METRIC=VALUE[,PRECISION:METRIC=VALUE...]"),
])
def test_a_bad_tolerance_is_one_line_naming_the_flag_and_builds_nothing(
        workdir: Path, capfd: pytest.CaptureFixture[str], value: str, expected: str) -> None:
    contrib_gelu_onnx(workdir / "gelu.onnx")
    code = main(["build", "-q", "--onnx", "gelu.onnx", "--name", "gelu", "--repository", "repo", "--log", "b.log",
                 "--tolerance", value])
    (line,) = capfd.readouterr().err.splitlines()
    assert code == 1 and line.startswith(f"trtbuild: error: {expected}"), line
    assert not (workdir / "repo" / "gelu_fp32").exists()


def test_a_limit_given_in_two_tolerance_flags_is_one_line(workdir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    contrib_gelu_onnx(workdir / "gelu.onnx")
    code = main(["build", "-q", "--onnx", "gelu.onnx", "--name", "gelu", "--repository", "repo", "--log", "b.log",
                 "--tolerance", "fp16:cosine_min=0.99", "--tolerance", "fp16:max_abs=0.1,fp16:cosine_min=0.9"])
    (line,) = capfd.readouterr().err.splitlines()
    assert code == 1 and line == ("trtbuild: error: --tolerance: fp16:cosine_min is given twice (in two --tolerance "
                                  "flags); expected it once")
    assert not (workdir / "repo" / "gelu_fp32").exists()


def test_tolerance_flag_replaces_only_the_limits_it_names() -> None:
    limits = parse_tolerances("fp16:cosine_min=0.998, int8:top1_agreement_min=0.9,fp16:max_abs=0.5")
    assert limits == {Precision.FP16: {"cosine_min": 0.998, "max_abs": 0.5},
                      Precision.INT8: {"top1_agreement_min": 0.9}}
    spec = ModelSpec(name="m", onnx=Path("m.onnx"), batch=DimRange(1, 1, 1),
                     precisions=(Precision.FP16, Precision.INT8), calibration=CalibrationSpec(DataSpec("c.npz", 8)),
                     tolerances={Precision.INT8: Tolerance(cosine_min=0.9, max_rel=0.2)})
    merged = with_tolerances(spec, limits)
    assert merged.tolerance(Precision.FP16) == Tolerance(cosine_min=0.998, max_abs=0.5)
    assert merged.tolerance(Precision.INT8) == Tolerance(cosine_min=0.9, max_rel=0.2, top1_agreement_min=0.9)
    assert merged.tolerance(Precision.FP32) == spec.tolerance(Precision.FP32)  # not given: unchanged
    # A model that does not make a precision keeps its spec (and build key) as it was.
    fp32_only = replace(spec, precisions=(Precision.FP32,), calibration=None)
    assert with_tolerances(fp32_only, limits) == fp32_only
    with pytest.raises(ManifestError, match="--tolerance"):
        parse_tolerances("fp16:")


class _ParserFailsOnInt8(OnnxRuntimeCPU):
    """ONNX Runtime, except that compiling a Q/DQ graph fails the way TensorRT's ONNX parser does (a plain
    BuilderError from the runtime, neither an accuracy miss nor a ModelOpt failure)."""

    def compile(self, onnx_path: Path, out_path: Path, target: CompileTarget) -> None:
        if any(n.op_type == "QuantizeLinear" for n in onnx.load(str(onnx_path)).graph.node):
            raise BuilderError(f"{onnx_path.name}: TensorRT's ONNX parser failed: no importer for QuantizeLinear")
        super().compile(onnx_path, out_path, target)


def test_a_runtime_failure_in_one_variant_is_that_variant_s_failure_only(
        tiny_repository: tuple[Path, list[ModelSpec]], repo_copy: Path, tmp_path: Path) -> None:
    _, specs = tiny_repository
    mlp = next(s for s in specs if s.name == "mlp")
    before = snapshot(repo_copy)
    fp32_folder = (repo_copy / "mlp_fp32").stat().st_ino
    options = BuildOptions(repository=repo_copy, runtime=_ParserFailsOnInt8(), cache_dir=tmp_path / "cache",
                           force=True)
    (result,) = build_all([mlp], options, None, ["pytest"])
    assert result.status is ModelStatus.BUILT and result.error is None
    assert {v.name for v in result.variants} == {"mlp_fp32", "mlp_fp16"}
    (failure,) = result.failures
    assert failure.variant == "mlp_int8" and failure.kept_previous and "ONNX parser failed" in failure.reason
    after = snapshot(repo_copy)
    assert {k: v for k, v in after.items() if k.startswith("mlp_int8/")} == \
        {k: v for k, v in before.items() if k.startswith("mlp_int8/")}
    # Rebuilt and swapped in (a new folder: the record's content may well be identical).
    assert (repo_copy / "mlp_fp32").stat().st_ino != fp32_folder


def test_data_inside_the_range_the_graph_cannot_take_is_one_line(workdir: Path,
                                                                  capfd: pytest.CaptureFixture[str]) -> None:
    # 102 is inside 64..128 but not a multiple of 4: the detector's feature maps no longer concatenate.
    model = detector(workdir)
    np.savez(workdir / "cal.npz", images=np.ones((16, 3, 102, 102), np.float32))
    code = main(["build", "-q", "--onnx", str(model.onnx), "--name", "d", "--precision", "fp32,fp16",
                 "--calibration", "cal.npz", "--repository", "repo", "--log", "b.log",
                 "--min-shapes", "images:1x3x64x64", "--opt-shapes", "images:2x3x96x96",
                 "--max-shapes", "images:4x3x128x128"])
    (line,) = capfd.readouterr().err.splitlines()
    assert code == 1
    assert line == ("trtbuild: error: model 'd': the FP32 model does not run on the evaluation samples "
                    "(images [4, 3, 102, 102]): Concat node 'concat': Non concat axis dimensions must match: "
                    "Axis 2 has mismatched dimensions of 52 and 51")
    # No model folder: the lock, and the report that lists the failure.
    assert [p.name for p in (workdir / "repo").iterdir() if not p.name.startswith(".")] == ["build_report.json"]
