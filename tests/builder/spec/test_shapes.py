"""Shapes per input (trtexec style): parsing the flags and resolving them against a graph's inputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from builder.errors import ManifestError
from builder.spec import DimRange, TensorSpec, load_manifest
from builder.spec.flags import BuildFlags, spec_from_flags
from builder.spec.shapes import (
    Level,
    ModelShapes,
    ShapeRange,
    ValueRange,
    parse_shapes,
    parse_value_range,
    resolve,
)

DETECTOR = (TensorSpec("images", "float32", ("p2o.DynamicDimension.0", 3, "p2o.DynamicDimension.1",
                                             "p2o.DynamicDimension.2")),)
OCR = (TensorSpec("x", "float32", (-1, 3, "?", "?")),)
VAD = (TensorSpec("input", "float32", ("batch", "sequence")), TensorSpec("state", "float32", (2, "batch", 128)),
       TensorSpec("sr", "int64", ()))
BATCH = DimRange(1, 8, 16)


def flags(**given: str) -> dict[str, ShapeRange]:
    """The shapes `trtbuild build --shapes/--min-shapes/...` gives (each keyword one flag's value)."""
    return dict(spec_from_flags(BuildFlags(Path("m.onnx"), **{key: (value,) for key, value in given.items()})).shapes)


def test_parse_takes_odd_names_scalars_and_several_inputs() -> None:
    assert parse_shapes("x:1x3x48x192,p2o.in:0:2x4,sr:[]", "--shapes") == {
        "x": (1, 3, 48, 192), "p2o.in:0": (2, 4), "sr": ()}


@pytest.mark.parametrize(("value", "message"), [
    ("x=1x3", r"--shapes 'x=1x3': expected NAME:DxDxD \(e.g. x:1x3x224x224\)"),
    ("x:1x3x", r"--shapes 'x:1x3x': expected NAME:DxDxD"),
    ("x:1*3", r"--shapes 'x:1\*3': expected NAME:DxDxD"),
    (":1x3", r"--shapes ':1x3': expected NAME:DxDxD"),
    ("x:1x3,x:2x3", r"--shapes: input 'x' is given twice"),
])
def test_bad_shape_strings_are_one_line_naming_the_flag(value: str, message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        parse_shapes(value, "--shapes")


def test_flags_follow_trtexec_a_missing_min_or_max_is_the_opt() -> None:
    ranges = flags(min_shapes="x:1x3x48x64", opt_shapes="x:4x3x48x192")
    assert ranges["x"] == ShapeRange((1, 3, 48, 64), (4, 3, 48, 192), (4, 3, 48, 192))
    assert ranges["x"].source == "--min-shapes/--opt-shapes"
    assert flags(shapes="x:2x3x48x48")["x"] == ShapeRange.fixed((2, 3, 48, 48))


@pytest.mark.parametrize(("given", "message"), [
    ({"min_shapes": "x:1x3x48x64", "max_shapes": "x:8x3x48x320"},
     r"^--opt-shapes x: missing; expected a list of integers from 1 to 2147483647$"),
    ({"min_shapes": "x:4x3x48x64", "opt_shapes": "x:1x3x48x64"},
     r"^--min-shapes/--opt-shapes x: axis 0 has min 4, opt 1, max 1; expected min <= opt <= max on every axis, "),
    ({"opt_shapes": "x:1x3x48x64", "max_shapes": "x:1x3x48"},
     r"^--opt-shapes/--max-shapes x: expected min, opt and max of the same rank, got "),
    ({"shapes": "x:1x3x48x64", "max_shapes": "x:1x3x48x90"}, r"^--shapes x: also given by --max-shapes"),
    ({"shapes": "x:0x3"}, r"^--shapes x axis 0: expected an integer from 1 to 2147483647, got 0$"),
    ({"max_shapes": "x:1x99999999999999999999", "opt_shapes": "x:1x3"},
     r"^--max-shapes x axis 1: expected an integer from 1 to 2147483647, got 99999999999999999999$"),
])
def test_inconsistent_flags_are_refused(given: dict[str, str], message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        flags(**given)


def test_duplicate_named_dims_are_told_apart_by_per_input_shapes() -> None:
    shapes = resolve(OCR, batch=BATCH, batch_given=False, dims={}, what="m",
                     shapes=flags(min_shapes="x:1x3x48x64", opt_shapes="x:4x3x48x192", max_shapes="x:8x3x48x320"))
    assert shapes.batching and shapes.batch == DimRange(1, 4, 8)
    assert shapes.inputs["x"] == ShapeRange((1, 3, 48, 64), (4, 3, 48, 192), (8, 3, 48, 320))
    assert shapes.config_dims("x") == [3, 48, -1]
    assert shapes.sample_range("x").at(Level.MAX) == (3, 48, 320)
    assert shapes.levels() == [Level.MIN, Level.OPT, Level.MAX]


def test_named_dims_stay_a_shorthand() -> None:
    dims = {"p2o.DynamicDimension.1": DimRange(64, 96, 128), "p2o.DynamicDimension.2": DimRange(64, 96, 128)}
    shapes = resolve(DETECTOR, batch=DimRange(1, 2, 4), dims=dims, shapes={}, what="m")
    assert shapes.inputs["images"] == ShapeRange((1, 3, 64, 64), (2, 3, 96, 96), (4, 3, 128, 128))


@pytest.mark.parametrize(("inputs", "given", "message"), [
    (OCR, {}, r"m: input 'x' \[\?, 3, '\?', '\?'\] axis 2 \('\?'\) is dynamic and has no range; expected --shapes "
              r"x:Dx3xDxD \(or --min/--opt/--max-shapes\), or --dim \?=MIN:OPT:MAX"),
    (OCR, {"shapes": "y:1x3x48x48"}, r"--shapes y: the model has no input 'y'; its inputs: x"),
    (OCR, {"shapes": "x:1x4x48x48"}, r"--shapes x: axis 1 is fixed at 3 in the model \[\?, 3, '\?', '\?'\], got 4"),
    (OCR, {"shapes": "x:1x3x48"}, r"--shapes x: 3 dims given, the model's input has 4 \[\?, 3, '\?', '\?'\]; "
                                  r"expected x:Dx3xDxD"),
    (VAD, {"shapes": "input:1x512,state:2x2x128"},
     r"m: dim 'batch' is 1:1:1 in input 'input' but 2:2:2 in input 'state'; expected one range for one named dim"),
    (VAD, {"shapes": "input:1x512"}, r"input 'state' \[2, 'batch', 128\] axis 1 \('batch'\) is dynamic"),
    # A scalar given for a batching model's input: the rank check, not a failure to find axis 0.
    (OCR, {"shapes": "x:[]"}, r"^m: --shapes x: 0 dims given, the model's input has 4"),
    (OCR, {"shapes": "y:2"}, r"^m: --shapes y: the model has no input 'y'"),
])
def test_every_dynamic_dim_is_covered_and_given_shapes_match_the_graph(
        inputs: tuple[TensorSpec, ...], given: dict[str, str], message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        resolve(inputs, batch=BATCH, batch_given=False, dims={}, shapes=flags(**given), what="m")


def test_the_batch_is_one_range_on_axis_0_of_every_input() -> None:
    two = (TensorSpec("a", "float32", ("batch", 4)), TensorSpec("b", "float32", ("batch", 2)))
    with pytest.raises(ManifestError, match=r"--shapes: axis 0 is the batch and must have one range for every "
                                            r"input; got a 1:1:1, b 2:2:2"):
        resolve(two, batch=BATCH, batch_given=False, dims={}, shapes=flags(shapes="a:1x4,b:2x2"), what="m")
    with pytest.raises(ManifestError, match=r"m: the shapes give axis 0 \(the batch\) 2:2:2 but the batch range "
                                            r"\(--max-batch, batch\) is 1:8:16"):
        resolve(two, batch=BATCH, batch_given=True, dims={}, shapes=flags(shapes="a:2x4,b:2x2"), what="m")


def test_state_with_batch_on_axis_1_and_a_scalar_do_not_batch() -> None:
    shapes = resolve(VAD, batch=BATCH, dims={}, what="m", shapes=flags(
        min_shapes="input:1x256,state:2x1x128", opt_shapes="input:1x512,state:2x1x128",
        max_shapes="input:1x1024,state:2x1x128"))
    assert not shapes.batching and shapes.batch is None
    assert shapes.reason == "input 'state' has a fixed size 2 on axis 0 [2, 'batch', 128]"
    assert shapes.inputs["sr"] == ShapeRange((), (), ())
    assert shapes.config_dims("input") == [1, -1] and shapes.config_dims("state") == [2, 1, 128]
    assert ModelShapes.from_json(shapes.to_json()) == shapes


def test_no_batch_forces_whole_shapes() -> None:
    inputs = (TensorSpec("x", "float32", ("batch", 4)),)
    shapes = resolve(inputs, batch=BATCH, dims={"batch": DimRange(1, 1, 1)}, shapes={}, no_batch=True, what="m")
    assert not shapes.batching and shapes.reason is not None and "--no-batch" in shapes.reason
    assert shapes.config_dims("x") == [1, 4]


def test_value_ranges() -> None:
    assert parse_value_range("bytes:0:255", "--input-range") == ("bytes", 0, 255)
    assert parse_value_range("ns:in:-5:5", "--input-range") == ("ns:in", -5, 5)
    with pytest.raises(ManifestError, match=r"--input-range 'bytes:0': expected NAME:LOW:HIGH with integers"):
        parse_value_range("bytes:0", "--input-range")
    spec = spec_from_flags(BuildFlags(Path("m.onnx"), input_range=("bytes:0:255", "ns:in:-5:5")))
    assert spec.input_ranges == {"bytes": ValueRange(0, 255), "ns:in": ValueRange(-5, 5)}
    with pytest.raises(ManifestError, match=r"^--input-range bytes: expected \[LOW, HIGH\] integers with LOW <= HIGH, "
                                            r"got \[9, 1\]$"):
        spec_from_flags(BuildFlags(Path("m.onnx"), input_range=("bytes:9:1",)))


def test_models_toml_takes_shapes_input_ranges_and_no_batch(tmp_path: Path) -> None:
    manifest = tmp_path / "models.toml"
    manifest.write_text('[[model]]\nname = "ocr"\nonnx = "ocr.onnx"\nno_batch = true\n'
                        '[model.shapes]\nx = { min = [1, 3, 48, 64], opt = [1, 3, 48, 192] }\n"p2o.y" = [2, 4]\n'
                        '[model.input_ranges]\nids = [0, 9]\n')
    (spec,) = load_manifest(manifest)
    assert spec.shapes["x"] == ShapeRange((1, 3, 48, 64), (1, 3, 48, 192), (1, 3, 48, 192))
    assert spec.shapes["x"].source == "shapes.x"
    assert spec.shapes["p2o.y"] == ShapeRange.fixed((2, 4))
    assert spec.input_ranges == {"ids": ValueRange(0, 9)}
    assert spec.no_batch and not spec.batch_given


def test_models_toml_shapes_name_the_key_once(tmp_path: Path) -> None:
    manifest = tmp_path / "models.toml"
    manifest.write_text('[[model]]\nname = "m"\nonnx = "m.onnx"\n[model.shapes]\ny = [1, 3, 48, 48]\n')
    (spec,) = load_manifest(manifest)
    with pytest.raises(ManifestError, match=r"^model 'm': shapes.y: the model has no input 'y'; its inputs: x$"):
        resolve(OCR, batch=BATCH, batch_given=False, dims={}, shapes=spec.shapes, what="model 'm'")


@pytest.mark.parametrize(("table", "message"), [
    ('[model.shapes]\nx = { min = [4, 3], opt = [1, 3] }', r"model\[0\].shapes.x: axis 0 has min 4, opt 1, max 1; "
                                                           r"expected min <= opt <= max on every axis"),
    ('[model.shapes]\nx = { min = [1], opt = [1, 3] }', r"model\[0\].shapes.x: expected min, opt and max of the same"),
    ('[model.shapes]\nx = "1x3"', r"model\[0\].shapes.x: expected \[D, D, …\] \(fixed\)"),
    ('[model.input_ranges]\nids = [9, 0]', r"model\[0\].input_ranges.ids: expected \[LOW, HIGH\] integers"),
])
def test_models_toml_shape_errors_name_the_key(tmp_path: Path, table: str, message: str) -> None:
    manifest = tmp_path / "models.toml"
    manifest.write_text(f'[[model]]\nname = "m"\nonnx = "m.onnx"\n{table}\n')
    with pytest.raises(ManifestError, match=message):
        load_manifest(manifest)
