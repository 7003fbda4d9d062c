"""Models whose weights live in a data file: the branch a model over 2 GB takes (protobuf's limit), taken
here with a small model by lowering the limit. Every copy the build makes (the reference, the FP32 and
FP16 variants, the served artifact) keeps its weights in a data file beside it; the served folders run
with them; new weights in the same graph rebuild; a data file missing beside the user's model is one line."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import numpy as np
import onnx
import pytest

from builder.cli import main
from builder.pipeline import BuildOptions, ModelStatus, build_all
from builder.repository import onnx_files
from builder.runtimes.onnxruntime import OnnxRuntimeCPU, run_file
from builder.spec import CalibrationSpec, DataSpec, DimRange, Int8Recipe, ModelSpec, Precision
from tests.helpers.foreign_models import ForeignModel, external_data


@pytest.fixture
def model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ForeignModel:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRTBUILD_CACHE", str(tmp_path / "cache"))
    return external_data(tmp_path)


def _build(model: ForeignModel, *extra: str) -> int:
    return main([*model.build_args(Path("repo")), "-q", "--log", "build.log", *extra])


def test_over_the_protobuf_limit_every_copy_keeps_its_weights_in_a_data_file(
        model: ForeignModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(onnx_files, "PROTOBUF_LIMIT", 1000)  # the weights are 48 kB
    assert _build(model) == 0
    held_out = {k: v[-4:] for k, v in np.load(model.calibration).items()}
    reference = run_file(model.onnx, held_out, 4)["y"]
    for precision in ("fp32", "fp16"):
        folder = Path("repo") / f"external_{precision}" / "1"
        served, data = folder / "model.onnx", folder / "model.onnx.data"
        assert served.stat().st_size < 1000 < data.stat().st_size, precision  # the weights are in the data file
        assert stat.S_IMODE(data.stat().st_mode) == stat.S_IMODE(served.stat().st_mode)  # readable as the model
        locations = {e.value for t in onnx.load(str(served), load_external_data=False).graph.initializer
                     for e in t.external_data if e.key == "location"}
        assert locations == {"model.onnx.data"}  # beside it, never a path of the build's temporary folder
        outputs = run_file(served, held_out, 4)["y"]
        assert np.allclose(outputs, reference, rtol=1e-2, atol=1e-2), precision
        record = json.loads((folder.parent / "build.json").read_text())
        assert record["size_bytes"] == served.stat().st_size + data.stat().st_size
    # The INT8 variant (ModelOpt writes it inline below 2 GB) is whole too.
    int8 = Path("repo") / "external_int8" / "1" / "model.onnx"
    quantized = run_file(int8, held_out, 4)["y"].ravel()
    cosine = float(quantized @ reference.ravel() / np.linalg.norm(quantized) / np.linalg.norm(reference))
    assert cosine > 0.97
    assert not list(Path().glob("*.data")) and not list(Path().glob("*.onnx"))  # nothing left where it ran

    # New weights in the same graph (the .onnx file unchanged) are a new model: rebuilt, not "unchanged".
    before = json.loads((Path("repo") / "external_fp32" / "build.json").read_text())["fp32_onnx_sha256"]
    weights = model.onnx.parent / "model.weights"
    array = np.frombuffer(weights.read_bytes(), np.float32) * np.float32(0.5)
    weights.write_bytes(array.tobytes())
    assert _build(model, "--precision", "fp32") == 0
    after = json.loads((Path("repo") / "external_fp32" / "build.json").read_text())["fp32_onnx_sha256"]
    assert after != before
    served = Path("repo") / "external_fp32" / "1" / "model.onnx"
    assert np.allclose(run_file(served, held_out, 4)["y"], 0.25 * reference, rtol=1e-4, atol=1e-4)


def test_a_data_file_missing_beside_the_model_is_one_line(model: ForeignModel,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    (model.onnx.parent / "model.weights").unlink()
    assert _build(model) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"trtbuild: error: {model.onnx}: not a readable ONNX model (ValidationError: ")
    assert "model.weights" in line
    # No model folder (the report of the failed build may be there).
    assert not Path("repo").exists() or not [p for p in Path("repo").iterdir() if p.is_dir() and p.name[0] != "."]


@pytest.mark.parametrize("recipe", [Int8Recipe.MODELOPT, Int8Recipe.ONNXRUNTIME])
def test_the_int8_quantizers_keep_the_weights_of_a_model_over_the_limit_in_a_data_file(
        model: ForeignModel, recipe: Int8Recipe, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Over 2 GB a quantizer that writes its result inline fails (ONNX Runtime's writes inline unless told);
    # told, both write a data file beside their output, which the build keeps beside the served model.
    monkeypatch.setattr(onnx_files, "PROTOBUF_LIMIT", 1000)
    spec = ModelSpec(name="external", onnx=model.onnx, batch=DimRange(1, 8, 16), precisions=(Precision.INT8,),
                     calibration=CalibrationSpec(DataSpec(str(model.calibration), 16), recipe=recipe))
    options = BuildOptions(repository=tmp_path / "repo", runtime=OnnxRuntimeCPU(), cache_dir=tmp_path / "cache")
    (result,) = build_all([spec], options, None, ["pytest"])
    assert not result.failures and result.status is ModelStatus.BUILT
    folder = tmp_path / "repo" / "external_int8" / "1"
    # The quantized weights (12 kB of int8) in the data file; scales and small tensors stay inline.
    assert (folder / "model.onnx").stat().st_size < 8000 < (folder / "model.onnx.data").stat().st_size
    held_out = {k: v[-4:] for k, v in np.load(model.calibration).items()}
    quantized = run_file(folder / "model.onnx", held_out, 4)["y"].ravel()
    reference = run_file(model.onnx, held_out, 4)["y"].ravel()
    assert float(quantized @ reference / np.linalg.norm(quantized) / np.linalg.norm(reference)) > 0.97
