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


def _error_lines(path: Path) -> list[str]:
    """Every line of the one ManifestError, without the leading `<path>: ` each line carries."""
    with pytest.raises(ManifestError) as caught:
        load_manifest(path)
    lines = str(caught.value).splitlines()
    prefix = f"{path}: "
    assert all(line.startswith(prefix) for line in lines), lines
    return [line.removeprefix(prefix) for line in lines]


# The mistakes issue 14 found accepted silently (or with a traceback): each is one line naming the key.
ISSUE_14 = [
    ("[model.serving]\nmax_queue_delay = 100",
     "model[0].serving.max_queue_delay: unknown key; did you mean max_queue_delay_us?"),
    ('[model.serving]\ndynamic_batching = "false"',
     'model[0].serving.dynamic_batching: expected true or false, got "false"'),
    ('precisions = "fp32"', 'model[0].precisions: expected a list of fp32, fp16, int8, got "fp32"'),
    ('[model.calibration]\nsource = "x:y"\nop_types_to_quantize = "MatMul"',
     'model[0].calibration.op_types_to_quantize: expected a list of non-empty strings, got "MatMul"'),
    ('opset = "seventeen"', 'model[0].opset: expected an integer >= 17, got "seventeen"'),
]


@pytest.mark.parametrize(("extra", "line"), ISSUE_14)
def test_each_issue_14_mistake_is_one_line_naming_the_key(tmp_path: Path, extra: str, line: str) -> None:
    assert _error_lines(_write(tmp_path, BASE.format(extra=extra))) == [line]


def test_every_mistake_of_a_file_is_reported_at_once(tmp_path: Path) -> None:
    body = BASE.format(extra="""precisions = "fp32"
opset = "seventeen"

[model.calibration]
source = "x:y"
op_types_to_quantize = "MatMul"

[model.serving]
max_queue_delay = 100
dynamic_batching = "false"
""")
    assert sorted(_error_lines(_write(tmp_path, body))) == sorted(line for _, line in ISSUE_14)


def test_schema_and_cross_key_errors_of_several_models_come_together(tmp_path: Path) -> None:
    body = """
stray = 1

[[model]]
name = "a"
onnx = "a.onnx"
batch = [1, 2]

[[model]]
name = "b"
source = "pkg.models:b"
precisions = ["int8"]
inputs = [{ name = "x", dtype = "float32", shape = [-1, "seq"] }]
batch = { min = 1, opt = 2, max = 4 }

[[model]]
name = "a"
onnx = "c.onnx"
batch = { min = 1, opt = 2, max = 4 }
"""
    assert _error_lines(_write(tmp_path, body)) == [
        "stray: unknown key; expected one of model",
        "model[0].batch: expected [min, opt, max] or { min = …, opt = …, max = … }, got [1, 2]",
        "model[1].inputs[0].shape: input 'x': dynamic dim 'seq' has no range; "
        "add dims.seq = [min, opt, max] or shapes.x",
        "model[1].precisions: int8 needs a [model.calibration] table",
        'model[2].name: duplicate model name "a" (also model[0])',
    ]


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        ('precisions = ["fp32", "bf16"]',
         'model[0].precisions[1]: expected one of fp32, fp16, int8, got "bf16"; did you mean fp16?'),
        ("precisions = []", "model[0].precisions: expected at least 1 item (fp32, fp16, int8), got []"),
        ('precisions = ["int8"]', "model[0].precisions: int8 needs a [model.calibration] table"),
        ('color = "blue"', "model[0].color: unknown key; expected one of name, source, onnx, task, inputs, outputs, "
                           "batch, dims, shapes, input_ranges, no_batch, precisions, calibration, evaluation, "
                           "tolerances, serving, opset"),
        ("batch2 = 1", "model[0].batch2: unknown key; did you mean batch?"),
        ('name = "x"', None),  # a duplicate key is TOML's error, below
        ('task = "segmentation"',
         'model[0].task: expected one of classification, detection, embedding, generic, got "segmentation"'),
        ('inputs = [{ name = "x", dtype = "float32", shape = [-1, "seq"] }]',
         "model[0].inputs[0].shape: input 'x': dynamic dim 'seq' has no range; "
         "add dims.seq = [min, opt, max] or shapes.x"),
        ('inputs = [{ name = "x", dtype = "float32", shape = [3, 3] }]',
         "model[0].inputs[0].shape: expected -1 (the batch axis) first, got [3, 3]"),
        ('inputs = [{ name = "x", dtype = "float32", shape = [-1, true] }]',
         "model[0].inputs[0].shape[1]: expected an integer or the name of a dim in dims, got true"),
        ('inputs = [{ name = "x", dtype = "complex7", shape = [-1, 3] }]',
         'model[0].inputs[0].dtype: expected one of float32, float16, float64, int64, int32, int16, int8, uint8, '
         'bool, got "complex7"'),
        ('dims = { seq = [1, 2.5, 3] }', "model[0].dims.seq.opt: expected an integer >= 1, got 2.5"),
        ("[model.tolerances.int8]\ncosine = 0.9",
         "model[0].tolerances.int8.cosine: unknown key; did you mean cosine_min?"),
        ("[model.tolerances.bf16]\ncosine_min = 0.9", "model[0].tolerances.bf16: unknown key; did you mean fp16?"),
        ("[model.tolerances.fp16]\ncosine_min = -1",
         "model[0].tolerances.fp16.cosine_min: expected a number from 0 to 1, got -1"),
        ("[model.tolerances.fp16]\ncosine_min = 1.5",  # a similarity above 1: a limit no variant meets
         "model[0].tolerances.fp16.cosine_min: expected a number from 0 to 1, got 1.5"),
        ("[model.tolerances.fp16]\nmax_abs = inf", "model[0].tolerances.fp16.max_abs: expected a finite number >= 0, "
                                                   "got inf"),
        ("[model.shapes]\nx = [1, 4294967296]",
         "model[0].shapes.x.opt[1]: expected an integer from 1 to 2147483647, got 4294967296"),
        ('[model.calibration]\nsource = "x:y"\nmethod = "minmax"',
         'model[0].calibration.method: expected one of entropy, max, got "minmax"; did you mean max?'),
        ('[model.calibration]\nsource = "x:y"\nrecipe = "tflite"',
         'model[0].calibration.recipe: expected one of auto, modelopt, onnxruntime, onnxruntime-dynamic, got "tflite"'),
        ('[model.calibration]\nsource = "data"',
         'model[0].calibration.source: expected module:function or a .npz file, got "data"'),
        ("[model.evaluation]\nsamples = 64.0",
         "model[0].evaluation.source: missing; expected module:function or a .npz file"),
        ("[model.serving]\ninstances = true", "model[0].serving.instances: expected an integer >= 1, got true"),
    ],
)
def test_bad_entries_name_the_key_and_the_allowed_values(tmp_path: Path, extra: str, line: str | None) -> None:
    path = _write(tmp_path, BASE.format(extra=extra))
    if line is None:
        with pytest.raises(ManifestError, match="not valid TOML"):
            load_manifest(path)
        return
    assert line in _error_lines(path)


def test_batch_range_must_be_ordered(tmp_path: Path) -> None:
    body = BASE.format(extra="").replace("min = 1, opt = 2, max = 4", "min = 4, opt = 2, max = 8")
    assert _error_lines(_write(tmp_path, body)) == [
        "model[0].batch: expected min <= opt <= max, got { min = 4, opt = 2, max = 8 }"]


def test_a_file_without_models_and_bad_toml(tmp_path: Path) -> None:
    assert _error_lines(_write(tmp_path, "")) == ["model: expected at least one [[model]] table"]
    assert _error_lines(_write(tmp_path, '[[models]]\nname = "m"')) == [
        "model: expected at least one [[model]] table", "models: unknown key; did you mean model?"]
    assert _error_lines(_write(tmp_path, '[model]\nname = "m"')) == [
        'model: expected at least one [[model]] table, got { name = "m" }']
    with pytest.raises(ManifestError, match="not valid TOML"):
        load_manifest(_write(tmp_path, "[[model]\nname="))
    with pytest.raises(ManifestError, match="manifest not found"):
        load_manifest(tmp_path / "absent.toml")


FULL = """
[[model]]
name = "user_model"
onnx = "models/user.onnx"
task = "classification"
precisions = ["int8", "fp32", "int8"]
outputs = ["logits"]
batch = [1, 4, 8]
dims = { seq = { min = 1, opt = 16, max = 32 } }
opset = 18

[model.calibration]
source = "data/cal.npz"
samples = 32
seed = 3
method = "max"
recipe = "onnxruntime"
op_types_to_quantize = ["MatMul"]
nodes_to_exclude = ["/head/Gemm"]

[model.evaluation]
source = "pkg.data:heldout"

[model.tolerances.fp32]
max_abs = 0

[model.tolerances.int8]
cosine_mean_min = 0.95
top1_agreement_min = 1

[model.serving]
instances = 2
dynamic_batching = false
max_queue_delay_us = 500
ort_intra_op_threads = 4
"""


def test_every_key_reaches_the_typed_spec_and_paths_resolve_against_the_manifest(tmp_path: Path) -> None:
    from builder.spec import (
        CalibrationMethod,
        CalibrationSpec,
        DataSpec,
        DimRange,
        Int8Recipe,
        ModelSpec,
        Precision,
        ServingSpec,
        Task,
        Tolerance,
    )

    def expected(base: Path) -> ModelSpec:
        return ModelSpec(
            name="user_model", onnx=base / "models/user.onnx", task=Task.CLASSIFICATION,
            precisions=(Precision.FP32, Precision.INT8), outputs=("logits",), batch=DimRange(1, 4, 8),
            dims={"seq": DimRange(1, 16, 32)}, opset=18,
            calibration=CalibrationSpec(DataSpec(str(base / "data/cal.npz"), 32, 3), method=CalibrationMethod.MAX,
                                        recipe=Int8Recipe.ONNXRUNTIME, op_types_to_quantize=("MatMul",),
                                        nodes_to_exclude=("/head/Gemm",)),
            evaluation=DataSpec("pkg.data:heldout", 64, 0),
            tolerances={Precision.FP32: Tolerance(max_abs=0.0),
                        Precision.INT8: Tolerance(cosine_mean_min=0.95, top1_agreement_min=1.0)},
            serving=ServingSpec(instances=2, dynamic_batching=False, max_queue_delay_us=500, ort_intra_op_threads=4),
        )

    path = _write(tmp_path, FULL)
    (spec,) = load_manifest(path)
    assert spec == expected(tmp_path)
    assert isinstance(spec.tolerance(Precision.INT8).top1_agreement_min, float)
    assert load_manifest(path, base_dir=tmp_path / "elsewhere") == [expected(tmp_path / "elsewhere")]


DRAFT_4_KEYWORDS = {
    "$schema", "id", "$ref", "title", "description", "default", "multipleOf", "maximum", "exclusiveMaximum",
    "minimum", "exclusiveMinimum", "maxLength", "minLength", "pattern", "additionalItems", "items", "maxItems",
    "minItems", "uniqueItems", "maxProperties", "minProperties", "required", "additionalProperties", "definitions",
    "properties", "patternProperties", "dependencies", "enum", "type", "allOf", "anyOf", "oneOf", "not", "format",
}


def test_schema_subcommand_prints_the_json_schema_editors_use(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    import tomllib

    from builder.cli import main

    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "model" in schema["properties"] and schema["additionalProperties"] is False
    serving = schema["definitions"]["ServingTable"]
    assert "max_queue_delay_us" in serving["properties"] and serving["additionalProperties"] is False

    # taplo (Even Better TOML) implements Draft 4: the schema uses no later keyword.
    keywords: set[str] = set()

    def collect(node: object, named: bool = False) -> None:
        if isinstance(node, dict):
            if not named:
                keywords.update(node)
            for key, value in node.items():
                if key not in ("enum", "default", "required"):
                    collect(value, named=key in ("properties", "definitions"))
        elif isinstance(node, list):
            for item in node:
                collect(item)

    collect(schema)
    assert keywords <= DRAFT_4_KEYWORDS, keywords - DRAFT_4_KEYWORDS

    # What an editor checks agrees with the loader.
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft4Validator(schema)
    validator.check_schema(schema)
    assert list(validator.iter_errors(tomllib.loads((ROOT / "models.toml").read_text()))) == []
    for extra, line in ISSUE_14:
        document = tomllib.loads(BASE.format(extra=extra))
        errors = list(validator.iter_errors(document))
        assert len(errors) == 1, (extra, errors)
        key = line.split(":")[0].removeprefix("model[0].").split(".")
        where = [str(p) for p in errors[0].absolute_path][2:]
        assert where == key or (errors[0].validator == "additionalProperties" and where == key[:-1]), (key, where)


def test_the_cli_prints_every_error_as_its_own_line_and_builds_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from builder.cli import main

    manifest = _write(tmp_path, BASE.format(extra='precisions = "fp32"\n[model.serving]\nmax_queue_delay = 100'))
    repository = tmp_path / "repo"
    assert main(["engines", "--manifest", str(manifest), "--repository", str(repository)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f'trtbuild: error: {manifest}: model[0].precisions: expected a list of fp32, fp16, int8, got "fp32"',
        f"trtbuild: error: {manifest}: model[0].serving.max_queue_delay: unknown key; did you mean max_queue_delay_us?",
    ]
    assert not repository.exists()


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
    with pytest.raises(ManifestError,
                       match=r"calibration\.recipe 'tflite': expected one of auto, modelopt, onnxruntime"):
        CalibrationSpec(DataSpec("x:y", 8), recipe="tflite")  # type: ignore[arg-type]
