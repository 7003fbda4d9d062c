from pathlib import Path

import pytest

from builder.errors import ManifestError
from builder.spec import load_manifest, parse_precisions

ROOT = Path(__file__).resolve().parents[3]


def test_project_manifest_describes_both_real_models() -> None:
    specs = {s.name: s for s in load_manifest(ROOT / "models.toml")}
    assert set(specs) == {"efficientnet_lite0", "minilm_l6_v2"}
    eff, mini = specs["efficientnet_lite0"], specs["minilm_l6_v2"]
    assert eff.precisions == ("fp32", "fp16", "int8")
    assert eff.task == "classification" and eff.inputs[0].shape == (-1, 3, 224, 224)
    assert eff.calibration is not None and eff.calibration.data.samples >= 64
    assert eff.calibration.recipe == "onnxruntime"
    assert eff.evaluation is not None and eff.evaluation.source != eff.calibration.data.source
    assert mini.dims["sequence"].max == 128
    assert mini.calibration is not None and mini.calibration.op_types_to_quantize == ("MatMul", "Gemm")


def _write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "models.toml"
    path.write_text(body)
    return path


BASE = """
[[model]]
name = "m"
onnx = "m.onnx"
batch = {{ min = 1, opt = 2, max = 4 }}
{extra}
"""


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('precisions = ["fp32", "bf16"]', "unknown precision 'bf16': expected one of fp32, fp16, int8"),
        ('precisions = ["int8"]', "precision int8 needs a [calibration] table"),
        ('color = "blue"', "unknown keys color"),
        ('task = "detection"', "task 'detection'"),
        ('inputs = [{ name = "x", dtype = "float32", shape = [-1, "seq"] }]', "dynamic dim 'seq' has no range"),
        ('inputs = [{ name = "x", dtype = "complex7", shape = [-1, 3] }]', "unknown dtype 'complex7'"),
        ("[model.tolerances.int8]\ncosine = 0.9", "tolerances.int8: unknown keys cosine"),
        ('[model.calibration]\nsource = "x:y"\nmethod = "minmax"', "calibration.method 'minmax'"),
        ('[model.calibration]\nsource = "x:y"\nrecipe = "tflite"', "recipe 'tflite': expected one of modelopt"),
    ],
)
def test_bad_entries_name_the_key_and_the_allowed_values(tmp_path: Path, extra: str, message: str) -> None:
    with pytest.raises(ManifestError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_manifest(_write(tmp_path, BASE.format(extra=extra)))


def test_batch_range_must_be_ordered(tmp_path: Path) -> None:
    body = BASE.format(extra="").replace("min = 1, opt = 2, max = 4", "min = 4, opt = 2, max = 8")
    with pytest.raises(ManifestError, match="1 <= min <= opt <= max"):
        load_manifest(_write(tmp_path, body))


def test_duplicate_names_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="duplicate model names: m"):
        load_manifest(_write(tmp_path, BASE.format(extra="") * 2))
    with pytest.raises(ManifestError, match="not valid TOML"):
        load_manifest(_write(tmp_path, "[[model]\nname="))
    with pytest.raises(ManifestError, match="manifest not found"):
        load_manifest(tmp_path / "absent.toml")


def test_precisions_are_ordered_with_the_reference_first() -> None:
    assert parse_precisions("int8,fp32,fp16,int8", "--precision") == ("fp32", "fp16", "int8")
    with pytest.raises(ManifestError, match="--precision: unknown precision 'fp8'"):
        parse_precisions("fp8", "--precision")


def test_library_callers_may_pass_plain_strings_and_get_members_or_a_named_error() -> None:
    from builder.spec import CalibrationMethod, CalibrationSpec, DataSpec, DimRange, ModelSpec, Precision, Task

    spec = ModelSpec(name="m", batch=DimRange(1, 1, 1), precisions=("fp32", "fp16"), task="embedding")  # type: ignore[arg-type]
    assert spec.precisions == (Precision.FP32, Precision.FP16) and spec.task is Task.EMBEDDING
    cal = CalibrationSpec(DataSpec("x:y", 8), method="max")  # type: ignore[arg-type]
    assert cal.method is CalibrationMethod.MAX
    with pytest.raises(ManifestError, match=r"calibration\.recipe 'tflite': expected one of modelopt, onnxruntime"):
        CalibrationSpec(DataSpec("x:y", 8), recipe="tflite")  # type: ignore[arg-type]
