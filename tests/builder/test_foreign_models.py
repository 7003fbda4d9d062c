"""ONNX models shaped like the ones users bring (issue 12), one per class: each builds FP32, FP16 and
INT8 through `trtbuild build`, serves on the bundled Triton (one server for all) and passes
`trtbuild verify`; the FP16-sensitive one through the FP16 guard. Bad shape flags are one line naming
the flag and the input."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import onnx
import pytest

from builder.cli import main
from builder.repository.model_folder import read_record
from builder.serving.triton_server import Ports, TritonServer, free_ports
from tests.helpers.files import snapshot
from tests.helpers.foreign_models import ForeignModel, all_models, detector, ocr_classifier, stateful

PRECISIONS = ("fp32", "fp16", "int8")


@pytest.fixture(scope="module")
def foreign(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[ForeignModel], dict[str, int]]:
    """Every class built into one repository with `trtbuild build`; the exit status of each build."""
    root = tmp_path_factory.mktemp("foreign")
    models = all_models(root)
    repository = root / "repository"
    # Where the user ran trtbuild: only the build logs and the default cache (.cache/trtbuild, fresh
    # here, so ModelOpt really runs) may appear.
    cwd = tmp_path_factory.mktemp("cwd")
    before = Path.cwd()
    os.chdir(cwd)
    try:
        # ONNX Runtime on the CPU on every host: the classes' figures (which node the FP16 guard keeps, cosines
        # against the default limits) were set on it; a GPU host's auto runtime (the CUDA provider) computes
        # FP16 differently. The CUDA runtime has its own tests (tests/builder/runtimes/test_onnxruntime_cuda.py).
        codes = {m.name: main([*m.build_args(repository), "--runtime", "onnxruntime",
                               "--report", str(root / f"{m.name}.json")])
                 for m in models}
    finally:
        os.chdir(before)
    left = sorted(p.name for p in cwd.iterdir() if p.name not in (".logs", ".cache"))
    assert not left, f"the builds left files in the working directory: {left}"
    return repository, models, codes


@pytest.fixture(scope="module")
def server(foreign: tuple[Path, list[ForeignModel], dict[str, int]],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ports]:
    repository, _, _ = foreign
    ports = Ports(*free_ports(3))
    triton = TritonServer(repository, tmp_path_factory.mktemp("foreign-triton"), ports)
    triton.start(timeout=180)
    yield ports
    triton.stop()


@pytest.mark.slow  # the module's builds of every class take ~20 s: full tier (make test) only
def test_every_class_builds_fp32_fp16_and_int8(foreign: tuple[Path, list[ForeignModel], dict[str, int]]) -> None:
    repository, models, codes = foreign
    assert codes == {m.name: 0 for m in models}
    for model in models:
        for precision in PRECISIONS:
            folder = repository / f"{model.name}_{precision}"
            record = read_record(folder)
            assert record is not None and record.shapes is not None, folder
            assert record.shapes.batching is model.batching, folder
            config = (folder / "config.pbtxt").read_text()
            assert ("max_batch_size" in config) is model.batching, config  # protobuf text omits a 0
            assert ("dynamic_batching" in config) is model.batching, config


@pytest.mark.slow  # the module's builds of every class take ~20 s: full tier (make test) only
def test_shapes_reach_config_and_the_record(foreign: tuple[Path, list[ForeignModel], dict[str, int]]) -> None:
    repository, _, _ = foreign
    detector_cfg = (repository / "detector_fp32" / "config.pbtxt").read_text()
    assert "max_batch_size: 4" in detector_cfg
    assert "dims: 3\n  dims: -1\n  dims: -1" in detector_cfg
    record = json.loads((repository / "ocr_cls_fp16" / "build.json").read_text())
    assert record["shapes"]["inputs"]["x"] == {"min": [1, 3, 48, 64], "opt": [4, 3, 48, 192], "max": [8, 3, 48, 320]}
    old = json.loads((repository / "opset11_fp16" / "build.json").read_text())["precision_settings"]
    assert old["opset"]["model"] == 11 and old["opset"]["variant"] > 11  # the upgrade is recorded
    vad = (repository / "vad_int8" / "config.pbtxt").read_text()
    assert 'string_value: "sr"' in vad and "dims: 2\n  dims: 1\n  dims: 128" in vad


@pytest.mark.slow  # the module's builds of every class take ~20 s: full tier (make test) only
def test_plain_fp16_misses_on_the_sensitive_model_and_the_guard_keeps_one_node_in_fp32(
        foreign: tuple[Path, list[ForeignModel], dict[str, int]]) -> None:
    repository, _, _ = foreign
    record = json.loads((repository / "sensor_fp16" / "build.json").read_text())
    guard = record["fp16_guard"]
    assert guard["fallback"] is None and guard["kept_fp32_nodes"] == ["centre"]
    assert guard["before"]["cosine_min"] < 0.999 <= guard["after"]["cosine_min"]  # the default limit
    assert guard["fp16_nodes_plain"] == 5 and guard["fp16_nodes_guarded"] == 4
    assert record["precision_settings"]["nodes_to_exclude"] == ["centre"]
    assert record["accuracy"]["cosine_min"] == guard["after"]["cosine_min"]


@pytest.mark.slow  # the module's builds of every class take ~20 s: full tier (make test) only
def test_an_opset_21_model_with_ai_onnx_ml_5_is_served_at_its_opsets(
        foreign: tuple[Path, list[ForeignModel], dict[str, int]]) -> None:
    repository, _, _ = foreign
    for precision in PRECISIONS:
        served = onnx.load(str(repository / f"opset21_{precision}" / "1" / "model.onnx"))
        opsets = {o.domain or "ai.onnx": o.version for o in served.opset_import}
        assert opsets["ai.onnx"] == 21 and opsets["ai.onnx.ml"] == 5, (precision, opsets)


def test_every_class_serves_and_verify_passes(foreign: tuple[Path, list[ForeignModel], dict[str, int]],
                                              server: Ports, capsys: pytest.CaptureFixture[str]) -> None:
    repository, models, _ = foreign
    manifest = repository.parent / "models.toml"
    manifest.write_text("\n".join(m.manifest_entry() for m in models))
    capsys.readouterr()
    code = main(["verify", "--manifest", str(manifest), "--repository", str(repository),
                 "--http-url", f"localhost:{server.http}", "--grpc-url", f"localhost:{server.grpc}"])
    expected = {f"{m.name}_{p}" for m in models for p in PRECISIONS}
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln.split()[:1] and ln.split()[0] in expected]
    assert code == 0, rows
    checked = {row[0] for row in rows if row.count("OK") == 2}  # one row per variant: gRPC and HTTP columns
    assert checked == expected and len(rows) == len(expected)


def _last_error(capsys: pytest.CaptureFixture[str]) -> str:
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("trtbuild: error:")]
    return errors[-1] if errors else ""


@pytest.mark.parametrize(("make", "flags", "message"), [
    (ocr_classifier, ["--shapes", "x:1x3x48x48,"],
     "--shapes 'x:1x3x48x48,': an empty item between commas; expected NAME:DxDxD[,NAME:DxDxD...]"),
    (ocr_classifier, ["--shapes", "x=1x3x48x48"],
     "--shapes 'x=1x3x48x48': expected NAME:DxDxD (e.g. x:1x3x224x224), several separated by commas"),
    (ocr_classifier, ["--shapes", "images:1x3x48x48"], "--shapes images: the model has no input 'images'; "
                                                      "its inputs: x"),
    (ocr_classifier, ["--min-shapes", "x:1x3x48x320", "--opt-shapes", "x:1x3x48x192"],
     "--min-shapes/--opt-shapes x: axis 3 has min 320, opt 192, max 192; expected min <= opt <= max on every axis"),
    (ocr_classifier, ["--max-shapes", "x:8x3x48x320"], "--opt-shapes x: missing; expected a list of integers"),
    (ocr_classifier, [], "model 'm': input 'x' [?, 3, '?', '?'] axis 2 ('?') is dynamic and has no range; "
                         "expected --shapes x:Dx3xDxD (or --min/--opt/--max-shapes), or --dim ?=MIN:OPT:MAX"),
    (ocr_classifier, ["--shapes", "x:1x1x48x48"], "--shapes x: axis 1 is fixed at 3 in the model "
                                                  "[?, 3, '?', '?'], got 1"),
    (detector, ["--min-shapes", "images:1x3x64x64", "--opt-shapes", "images:1x3x96x96", "--max-shapes",
                "images:1x3x102x102"],
     "model 'm': the FP32 model does not run at the max shapes (images:1x3x102x102):"),
    (stateful, ["--shapes", "input:1x512"], "model 'm': input 'state' [2, 'batch', 128] axis 1 ('batch') is dynamic"),
    (stateful, ["--shapes", "input:1x512,state:2x1x128", "--input-range", "sr"],
     "--input-range 'sr': expected NAME:LOW:HIGH with integers (e.g. ids:0:999)"),
    (stateful, ["--shapes", "input:1x512,state:2x1x128"],
     "input 'sr' is int64: random values would be meaningless; expected real data (--calibration/--eval-data "
     "FILE.npz) or a value range (--input-range sr:LOW:HIGH"),
])
def test_bad_shape_flags_are_one_line_exit_1_and_nothing_written(
        make: type, flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model: ForeignModel = make(tmp_path)
    repository = tmp_path / "repository"
    repository.mkdir()
    before = snapshot(repository)
    code = main(["build", "--onnx", str(model.onnx), "--name", "m", "--precision", "fp32", "--repository",
                 str(repository), *flags])
    line = _last_error(capsys)
    assert code == 1 and message in line, line
    after = snapshot(repository)
    after.pop("build_report.json", None)  # the report of the failed build; no model folder
    assert after == before
