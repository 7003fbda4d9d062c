"""Issue 22: the `build --onnx` journey without a models.toml, and guards on by default.

- `trtbuild verify --repository R` reads the models from their variants' build.json (every model, or
  `--only`), and the build summary's `next:` proposes it;
- REPOSITORY/build_report.json lists every model built into the repository (per model, the newest build);
- a rebuild names what changed ("build flags changed: tolerance int8 (...)"), and changing one precision's
  settings rebuilds that precision's variant only;
- a `--dim` naming a dim the model does not have is one line naming it and the model's dims;
- an INT8 variant that misses the default tolerance runs its guard (`--no-guard` turns it off).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from builder.cli import main
from builder.serving.triton_server import Ports, TritonServer, free_ports
from tests.helpers.foreign_models import ForeignModel, data_sized, ocr_classifier, split_detector
from tests.helpers.tiny_models import mlp_samples, outlier_mlp_onnx


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the user runs trtbuild: no models.toml there; a private calibration cache."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRTBUILD_CACHE", str(tmp_path / "cache"))
    return tmp_path


def _build(workdir: Path, make: Callable[[Path], ForeignModel], *extra: str) -> int:
    model = make(workdir)
    return main([*model.build_args(workdir / "repo"), "--precision", "fp32,fp16", *extra])


@pytest.mark.server
def test_verify_reads_build_json_when_there_is_no_models_toml(workdir: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert _build(workdir, ocr_classifier) == 0
    assert _build(workdir, split_detector) == 0
    out = capsys.readouterr().out
    assert f"trtbuild verify --repository {workdir / 'repo'} --only split_detector" in out  # the next: line
    assert not (workdir / "models.toml").exists()
    ports = Ports(*free_ports(3))
    server = TritonServer(workdir / "repo", workdir / "triton", ports)
    server.start(timeout=180)
    try:
        urls = ["--http-url", f"127.0.0.1:{ports.http}", "--grpc-url", f"127.0.0.1:{ports.grpc}"]
        assert main(["verify", "--repository", str(workdir / "repo"), *urls]) == 0
        rows = [ln.split() for ln in capsys.readouterr().out.splitlines()]
        checked = {row[0] for row in rows if row.count("OK") == 2}
        assert checked == {"ocr_cls_fp32", "ocr_cls_fp16", "split_detector_fp32", "split_detector_fp16"}, rows
        # The samples are the held-out quarter of the calibration data the build was given.
        assert all("calibration" in " ".join(row) for row in rows if row and row[0] in checked)
        assert main(["verify", "--repository", str(workdir / "repo"), "--only", "ocr_cls", *urls]) == 0
        rows = [ln.split() for ln in capsys.readouterr().out.splitlines()]
        assert {row[0] for row in rows if row.count("OK") == 2} == {"ocr_cls_fp32", "ocr_cls_fp16"}
    finally:
        server.stop()
    assert main(["verify", "--repository", str(workdir / "repo"), "--only", "nothing", *urls]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (f"trtbuild: error: --only nothing: not in the build.json in {workdir / 'repo'} "
                    "(models: ocr_cls, split_detector)")


@pytest.mark.server
def test_verify_compares_an_output_whose_length_depends_on_the_data(workdir: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # kokoro's audio grows with its text: before, verify raised "cannot reshape array of size 58800 into shape
    # (68400,)" (the served answer against the local outputs, stacked padded to the longest sample).
    model = data_sized(workdir)
    held_out = np.load(model.calibration)["tokens"][-4:]
    assert len({int((t > 0).sum()) for t in held_out}) > 1  # the held-out answers differ in length
    assert main([*model.build_args(workdir / "repo"), "--precision", "fp32"]) == 0
    ports = Ports(*free_ports(3))
    server = TritonServer(workdir / "repo", workdir / "triton", ports)
    server.start(timeout=180)
    try:
        urls = ["--http-url", f"127.0.0.1:{ports.http}", "--grpc-url", f"127.0.0.1:{ports.grpc}"]
        capsys.readouterr()
        assert main(["verify", "--repository", str(workdir / "repo"), *urls]) == 0
        rows = [ln.split() for ln in capsys.readouterr().out.splitlines()]
        assert [row[0] for row in rows if row.count("OK") == 2] == ["tts_fp32"], rows
    finally:
        server.stop()


def test_the_build_report_lists_every_model_built_into_the_repository(workdir: Path) -> None:
    report = workdir / "repo" / "build_report.json"
    assert _build(workdir, ocr_classifier) == 0
    first = json.loads(report.read_text())["models"]
    assert _build(workdir, split_detector) == 0
    assert [m["name"] for m in json.loads(report.read_text())["models"]] == ["ocr_cls", "split_detector"]
    assert _build(workdir, ocr_classifier, "--force") == 0  # the newest build of a model replaces its entry
    models = json.loads(report.read_text())["models"]
    assert [m["name"] for m in models] == ["split_detector", "ocr_cls"]
    assert models[1]["started_unix"] > first[0]["started_unix"]


def test_the_build_report_accumulates_however_the_repository_is_spelled(workdir: Path) -> None:
    # `--repository repo` then `--repository /abs/repo`: one repository, one report listing both models.
    for make, repository in ((ocr_classifier, Path("repo")), (split_detector, workdir / "repo")):
        args = make(workdir).build_args(repository)
        assert main([*args, "--precision", "fp32"]) == 0
    models = json.loads((workdir / "repo" / "build_report.json").read_text())["models"]
    assert [m["name"] for m in models] == ["ocr_cls", "split_detector"]


def test_verify_reads_build_json_where_the_models_toml_here_is_of_another_repository(
        workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A project folder's models.toml, none of whose models is in the repository `build --onnx` wrote.
    (workdir / "models.toml").write_text(split_detector(workdir).manifest_entry())
    assert main([*ocr_classifier(workdir).build_args(workdir / "repo"), "--precision", "fp32"]) == 0
    capsys.readouterr()
    assert main(["verify", "--repository", "repo", "--only", "nothing"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line == "trtbuild: error: --only nothing: not in the build.json in repo (models: ocr_cls)"
    assert main(["verify", "--repository", "empty"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line == ("trtbuild: error: empty: no model to verify: none of the models in models.toml is there and no "
                    "build.json in the repository; expected `trtbuild build` (or `trtbuild engines`) first")


def _outlier(workdir: Path, precisions: str = "fp32,fp16,int8") -> list[str]:
    outlier_mlp_onnx(workdir / "outlier.onnx")
    np.savez(workdir / "cal.npz", **mlp_samples(64, seed=0))
    np.savez(workdir / "eval.npz", **mlp_samples(32, seed=1))
    return ["build", "-q", "--onnx", "outlier.onnx", "--name", "outlier", "--precision", precisions,
            "--calibration", "cal.npz", "--eval-data", "eval.npz", "--task", "classification",
            "--repository", "repo"]


def test_changing_one_precisions_settings_rebuilds_that_variant_only_and_says_what_changed(
        workdir: Path, caplog: pytest.LogCaptureFixture) -> None:
    command = _outlier(workdir)
    assert main([*command, "--tolerance", "int8:cosine_min=0.1"]) == 0
    folders = {p: os.stat(workdir / "repo" / f"outlier_{p}").st_ino for p in ("fp32", "fp16", "int8")}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="builder.pipeline"):
        assert main([*command, "--tolerance", "int8:cosine_min=0.05"]) == 0
    lines = [r.getMessage() for r in caplog.records if "rebuilding" in r.getMessage()]
    assert lines == ["outlier: rebuilding: build flags changed: tolerance int8 (cosine_min 0.1 -> 0.05)"], lines
    now = {p: os.stat(workdir / "repo" / f"outlier_{p}").st_ino for p in ("fp32", "fp16", "int8")}
    assert now["fp32"] == folders["fp32"] and now["fp16"] == folders["fp16"] and now["int8"] != folders["int8"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="builder.pipeline"):
        assert main([*command, "--tolerance", "int8:cosine_min=0.05", "--calibration-method", "max"]) == 0
    lines = [r.getMessage() for r in caplog.records if "rebuilding" in r.getMessage()]
    assert lines == ["outlier: rebuilding: build flags changed: calibration int8 (method entropy -> max)"], lines
    later = {p: os.stat(workdir / "repo" / f"outlier_{p}").st_ino for p in ("fp32", "fp16", "int8")}
    assert later["fp32"] == now["fp32"] and later["fp16"] == now["fp16"] and later["int8"] != now["int8"]


def test_an_int8_variant_missing_the_default_tolerance_runs_its_guard(workdir: Path,
                                                                    capfd: pytest.CaptureFixture[str]) -> None:
    """Plain INT8 scores cosine ~0.13 on this model against the default 0.97, with no --tolerance given."""
    assert main(_outlier(workdir, "fp32,int8")) == 0, capfd.readouterr().err
    record = json.loads((workdir / "repo" / "outlier_int8" / "build.json").read_text())
    assert record["guard"] is not None and record["guard"]["before"]["cosine_min"] < 0.97
    assert record["accuracy"]["cosine_min"] >= 0.97


def test_a_dim_the_model_does_not_have_is_one_line(workdir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    model = ocr_classifier(workdir)
    code = main([*model.build_args(workdir / "repo"), "--precision", "fp32", "--dim", "height=32:48:64"])
    (line,) = capfd.readouterr().err.splitlines()
    assert code == 1
    assert line == ("trtbuild: error: model 'ocr_cls': --dim height (dims.height): the model has no dim 'height'; "
                    "its named dims: '?' (inputs: x [?, 3, '?', '?'])"), line
    assert not (workdir / "repo" / "ocr_cls_fp32").exists()


def test_the_next_line_proposes_verify_without_a_manifest(tmp_path: Path) -> None:
    """A `build --onnx` (no manifest): verify reads build.json, and is proposed for the models built whole."""
    from builder.pipeline import ModelResult, ModelStatus
    from builder.spec import DimRange, ModelSpec, Precision
    from builder.summary import summarize

    specs = [ModelSpec(name=name, onnx=tmp_path / f"{name}.onnx", batch=DimRange(1, 1, 1),
                       precisions=(Precision.FP32,)) for name in ("a", "b")]
    results = [ModelResult(name, ModelStatus.UNCHANGED, "", []) for name in ("a", "b")]
    summary = summarize(results, specs, repository=Path("repo"), report=None, log_file=None)
    assert [c for c in summary.next_commands if c.startswith("trtbuild verify")] == \
        ["trtbuild verify --repository repo --only a --only b"]
