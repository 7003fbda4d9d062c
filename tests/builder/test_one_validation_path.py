"""`trtbuild build` flags and a models.toml entry go through one validation path: the same bad value gives the
same line, naming the flag where the user typed a flag and the key where they wrote models.toml, exit 1, and
nothing is written; the same good values give the same spec."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from builder.cli import _parser, main
from builder.spec import load_manifest
from builder.spec.flags import BuildFlags, spec_from_flags
from tests.helpers.foreign_models import all_models
from tests.helpers.tiny_models import mlp_onnx

# (flags, the models.toml lines saying the same, then the names each path gives the same things: the
# location first (flag, key under model[0]), then any other key the line asks for). The tiny MLP's input is
# x ['batch', 4, 32].
CASES = [
    pytest.param(["--precision", "fp32,bf16"], 'precisions = ["fp32", "bf16"]',
                 [("--precision", "precisions[1]")], id="unknown precision"),
    pytest.param(["--precision", ","], "precisions = []", [("--precision", "precisions")], id="no precision"),
    pytest.param(["--task", "segmentation"], 'task = "segmentation"', [("--task", "task")], id="unknown task"),
    pytest.param(["--name", "my model"], 'name = "my model"', [("--name", "name")], id="bad name"),
    pytest.param(["--max-batch", "0"], "batch = [1, 1, 0]", [("--max-batch", "batch.max")], id="batch 0"),
    pytest.param(["--tolerance", "fp16:cosine_min=1.5"], "[model.tolerances.fp16]\ncosine_min = 1.5",
                 [("--tolerance fp16:cosine_min", "tolerances.fp16.cosine_min")], id="similarity above 1"),
    pytest.param(["--tolerance", "fp16:max_abs=-0.5"], "[model.tolerances.fp16]\nmax_abs = -0.5",
                 [("--tolerance fp16:max_abs", "tolerances.fp16.max_abs")], id="negative limit"),
    pytest.param(["--tolerance", "fp16:cosine=0.9"], "[model.tolerances.fp16]\ncosine = 0.9",
                 [("--tolerance fp16:cosine", "tolerances.fp16.cosine")], id="unknown metric"),
    pytest.param(["--min-shapes", "x:4x4x32", "--opt-shapes", "x:1x4x32"],
                 "[model.shapes]\nx = { min = [4, 4, 32], opt = [1, 4, 32] }",
                 [("--min-shapes/--opt-shapes x", "shapes.x")], id="shape range out of order"),
    pytest.param(["--opt-shapes", "x:1x4x32", "--max-shapes", "x:8x4"],
                 "[model.shapes]\nx = { opt = [1, 4, 32], max = [8, 4] }",
                 [("--opt-shapes/--max-shapes x", "shapes.x")], id="shape ranks differ"),
    pytest.param(["--shapes", "x:1x0x32"], "[model.shapes]\nx = [1, 0, 32]", [("--shapes x axis 1", "shapes.x.opt[1]")],
                 id="shape size 0"),
    pytest.param(["--min-shapes", "x:1x4x32", "--max-shapes", "x:8x4x32"],
                 "[model.shapes]\nx = { min = [1, 4, 32], max = [8, 4, 32] }",
                 [("--opt-shapes x", "shapes.x.opt")], id="no opt shape"),
    pytest.param(["--dim", "seq=8:4:16"], "dims = { seq = [8, 4, 16] }", [("--dim seq", "dims.seq")],
                 id="dim range out of order"),
    pytest.param(["--dim", "seq=0:4:16"], "dims = { seq = [0, 4, 16] }", [("--dim seq (min)", "dims.seq.min")],
                 id="dim size 0"),
    pytest.param(["--input-range", "x:9:1"], "input_ranges = { x = [9, 1] }", [("--input-range x", "input_ranges.x")],
                 id="value range out of order"),
    pytest.param(["--calibration", "cal.txt", "--precision", "fp32"], '[model.calibration]\nsource = "cal.txt"',
                 [("--calibration", "calibration.source")], id="calibration not npz"),
    pytest.param(["--calibration", "cal.npz", "--calibration-samples", "0", "--precision", "fp32"],
                 '[model.calibration]\nsource = "cal.npz"\nsamples = 0',
                 [("--calibration-samples", "calibration.samples")], id="no calibration samples"),
    pytest.param(["--calibration", "cal.npz", "--calibration-method", "minmax", "--precision", "fp32"],
                 '[model.calibration]\nsource = "cal.npz"\nmethod = "minmax"',
                 [("--calibration-method", "calibration.method")], id="unknown calibration method"),
    pytest.param(["--calibration", "cal.npz", "--int8-recipe", "tensorflow", "--precision", "fp32"],
                 '[model.calibration]\nsource = "cal.npz"\nrecipe = "tensorflow"',
                 [("--int8-recipe", "calibration.recipe")], id="unknown int8 recipe"),
    pytest.param(["--precision", "fp32,int8"], 'precisions = ["fp32", "int8"]',
                 [("--precision", "precisions"), ("--calibration FILE.npz", "a [model.calibration] table")],
                 id="int8 without calibration"),
]

# Checked against the graph, when the build starts (the report is written; no model is).
GRAPH_CASES = [
    pytest.param(["--shapes", "x:1x4"], "[model.shapes]\nx = [1, 4]", [("--shapes x", "shapes.x")],
                 id="shape rank against the graph"),
    pytest.param(["--shapes", "y:1x4x32"], "[model.shapes]\ny = [1, 4, 32]", [("--shapes y", "shapes.y")],
                 id="shape of no input"),
    pytest.param(["--dim", "height=1:2:3"], "dims = { height = [1, 2, 3] }",
                 [("--dim height (dims.height)", "--dim height (dims.height)")], id="unknown dim"),
]


def _error_lines(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    code = main(args)
    return code, [line for line in capsys.readouterr().err.splitlines() if line.startswith("trtbuild: error:")]


def _both(tmp_path: Path, flags: list[str], toml: str,
          capsys: pytest.CaptureFixture[str]) -> tuple[tuple[int, list[str], Path], tuple[int, list[str], Path]]:
    """The flags through `trtbuild build`, the lines through `trtbuild engines`, each into its own repository."""
    onnx = mlp_onnx(tmp_path / "mlp.onnx")
    manifest = tmp_path / "models.toml"
    name_line = "" if toml.startswith("name =") else 'name = "m"\n'
    manifest.write_text(f'[[model]]\n{name_line}onnx = "{onnx}"\n{toml}\n')
    by_flags, by_toml = tmp_path / "flags_repo", tmp_path / "toml_repo"
    name = [] if "--name" in flags else ["--name", "m"]
    flag_code, flag_lines = _error_lines(["build", "--onnx", str(onnx), *name, *flags, "--repository", str(by_flags),
                                          "--log", str(tmp_path / "flags.log")], capsys)
    toml_code, toml_lines = _error_lines(["engines", "--manifest", str(manifest), "--repository", str(by_toml),
                                          "--log", str(tmp_path / "toml.log")], capsys)
    return (flag_code, flag_lines, by_flags), (toml_code, toml_lines, by_toml)


def _neutral(line: str, names: list[str]) -> str:
    for i, name in sorted(enumerate(names), key=lambda item: -len(item[1])):  # the longer first: --dim seq (min)
        line = line.replace(name, f"<{i}>")
    return line


@pytest.mark.parametrize(("flags", "toml", "names"), CASES)
def test_a_bad_value_is_the_same_line_from_flags_and_models_toml_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], toml: str,
        names: list[tuple[str, str]]) -> None:
    (flag_code, flag_lines, by_flags), (toml_code, toml_lines, by_toml) = _both(tmp_path, flags, toml, capsys)
    manifest = tmp_path / "models.toml"
    assert flag_code == toml_code == 1
    assert len(flag_lines) == len(toml_lines) == 1, (flag_lines, toml_lines)
    (flag_line,), (toml_line,) = flag_lines, toml_lines
    # Each names where the user wrote the value: the flag, or the file and key.
    assert flag_line.startswith(f"trtbuild: error: {names[0][0]}: "), flag_line
    assert toml_line.startswith(f"trtbuild: error: {manifest}: model[0].{names[0][1]}: "), toml_line
    flag_names = [flag for flag, _ in names]
    toml_names = [f"{manifest}: model[0].{names[0][1]}", *(key for _, key in names[1:])]
    assert _neutral(flag_line, flag_names) == _neutral(toml_line, toml_names)
    assert not by_flags.exists() and not by_toml.exists()


@pytest.mark.parametrize(("flags", "toml", "names"), GRAPH_CASES)
def test_a_value_the_graph_refuses_is_the_same_line_from_flags_and_models_toml(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], toml: str,
        names: list[tuple[str, str]]) -> None:
    (flag_code, flag_lines, by_flags), (toml_code, toml_lines, by_toml) = _both(
        tmp_path, [*flags, "--precision", "fp32"], toml, capsys)
    assert flag_code == toml_code == 1
    assert len(flag_lines) == len(toml_lines) == 1, (flag_lines, toml_lines)
    (flag_line,), (toml_line,) = flag_lines, toml_lines
    assert flag_line.startswith(f"trtbuild: error: model 'm': {names[0][0]}: "), flag_line
    assert toml_line.startswith(f"trtbuild: error: model 'm': {names[0][1]}: "), toml_line
    assert _neutral(flag_line, [names[0][0]]) == _neutral(toml_line, [names[0][1]])
    for repository in (by_flags, by_toml):  # the build report lists the failure; no model folder is written
        assert sorted(p.name for p in repository.iterdir() if p.is_dir() and not p.name.startswith(".")) == []


def test_every_error_of_the_flags_is_reported_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (flag_code, flag_lines, _), (toml_code, toml_lines, _) = _both(
        tmp_path, ["--precision", "fp32,bf16", "--task", "segmentation", "--max-batch", "0"],
        'precisions = ["fp32", "bf16"]\ntask = "segmentation"\nbatch = [1, 1, 0]', capsys)
    assert flag_code == toml_code == 1
    # The schema's order, each line naming its flag; the text after the name is models.toml's.
    assert [line.split(": ")[2] for line in flag_lines] == ["--task", "--max-batch", "--precision"]
    assert [line.split(": ", 3)[3] for line in flag_lines] == [line.split(": ", 4)[4] for line in toml_lines]


def test_a_tolerance_flag_of_engines_is_the_same_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--tolerance` also lays limits over models.toml's: checked by the same table, named the same."""
    onnx = mlp_onnx(tmp_path / "mlp.onnx")
    manifest = tmp_path / "models.toml"
    manifest.write_text(f'[[model]]\nname = "m"\nonnx = "{onnx}"\nprecisions = ["fp32", "fp16"]\n')
    repository = tmp_path / "repo"
    common = ["--tolerance", "fp16:cosine_min=1.5", "--repository", str(repository), "--log", str(tmp_path / "b.log")]
    engines = _error_lines(["engines", "--manifest", str(manifest), *common], capsys)
    build = _error_lines(["build", "--onnx", str(onnx), "--name", "m", *common], capsys)
    assert engines == build == (1, ["trtbuild: error: --tolerance fp16:cosine_min: expected a number from 0 to 1, "
                                    "got 1.5"])
    assert not repository.exists()


def test_flags_and_the_models_toml_entry_of_one_build_give_one_spec(tmp_path: Path) -> None:
    """Each foreign model's build flags and its models.toml entry (tests/helpers/foreign_models.py) stand for one
    build: the same spec, whose shapes name the flags or the keys that gave them."""
    for model in all_models(tmp_path):
        args = _parser().parse_args(model.build_args(tmp_path / "repo"))
        by_flags = spec_from_flags(BuildFlags(**{f.name: getattr(args, f.name) for f in fields(BuildFlags)}))
        manifest = tmp_path / f"{model.name}.toml"
        manifest.write_text(model.manifest_entry())
        (by_toml,) = load_manifest(manifest)
        assert by_flags == by_toml, model.name
        assert all(r.source.startswith("--") for r in by_flags.shapes.values()), model.name
        assert all(r.source == f"shapes.{name}" for name, r in by_toml.shapes.items()), model.name
