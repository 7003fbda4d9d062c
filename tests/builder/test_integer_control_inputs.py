"""Issue 22 (corpus: silero-vad): the FP32 graph's run at the min, opt and max shapes gave an int64 `sr` the
values 0 and 1, so silero's If took its 8 kHz branch, which cannot run a 16 kHz window, and the build failed
before any variant (`the FP32 model does not run at the min shapes (input:1x512,state:2x1x128,sr:[]): If node
'If_0': ... LSTM ... Input X must have 3 dimensions only`), although the user's data held sr = 16000 and
--input-range sr:16000:16000 was given. Integer inputs now take their values from --input-range, else from
the user's samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from builder.cli import main
from tests.helpers.foreign_models import rate_gated


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRTBUILD_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_an_integer_control_input_takes_the_users_values_in_the_shape_check(
        workdir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    model = rate_gated(workdir)
    code = main([*model.build_args(workdir / "repo"), "--precision", "fp32,fp16"])
    err = capfd.readouterr().err
    assert code == 0, err
    assert "does not run at the" not in err and "Traceback" not in err
    for precision in ("fp32", "fp16"):
        assert (workdir / "repo" / f"rate_gated_{precision}" / "config.pbtxt").is_file()


def test_an_integer_control_input_takes_its_input_range_without_data(
        workdir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    model = rate_gated(workdir)
    code = main(["build", "--onnx", str(model.onnx), "--name", "rate_gated", "--repository", str(workdir / "repo"),
                 "--precision", "fp32", *model.flags, "--input-range", "sr:16000:16000"])
    err = capfd.readouterr().err
    assert code == 0, err
    assert (workdir / "repo" / "rate_gated_fp32" / "config.pbtxt").is_file()


def test_onnx_runtimes_int8_recipe_calibrates_a_scalar_input_of_a_model_that_does_not_batch(
        workdir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The ORT quantizer's reader gave a whole sample's scalar `sr` as a numpy scalar, which ONNX Runtime refuses
    ("Unable to handle object of type <class 'numpy.int64'>"): the INT8 variant was not written."""
    model = rate_gated(workdir)
    entry = model.manifest_entry().replace('precisions = ["fp32", "fp16", "int8"]', 'precisions = ["fp32", "int8"]')
    (workdir / "models.toml").write_text(entry + 'recipe = "onnxruntime"\nmethod = "max"\n')
    code = main(["engines", "--manifest", "models.toml", "--repository", "repo", "--no-guard"])
    err = capfd.readouterr().err
    assert code == 0, err
    record = json.loads((workdir / "repo" / "rate_gated_int8" / "build.json").read_text())
    assert record["precision_settings"]["tool"] == "onnxruntime.quantization.quantize_static"
    assert record["calibration"]["samples"] > 0  # calibrated on the user's samples, scalar sr included
