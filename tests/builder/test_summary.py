"""builder.summary: one table of every variant, failures marked with their reason, and where things are."""

from __future__ import annotations

import io
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from builder.cli import main
from builder.spec import ModelSpec, Precision
from builder.spec.model import DimRange
from builder.summary import (
    PICK_MARGIN,
    BuildSummary,
    FailedVariant,
    SummaryRow,
    accuracy_text,
    failed_row,
    guard_text,
    render,
    row_from_record,
    summarize,
    with_recommendation,
)
from tests.helpers.tiny_models import mlp_onnx


def _text(summary: BuildSummary) -> str:
    stream = io.StringIO()
    render(summary, stream)
    return stream.getvalue()


def _spec(onnx: Path, name: str = "mlp") -> ModelSpec:
    return ModelSpec(name=name, onnx=onnx, batch=DimRange(1, 8, 16),
                     precisions=(Precision.FP32, Precision.FP16, Precision.INT8))


def test_a_failed_variant_is_listed_with_its_reason(tmp_path: Path) -> None:
    failure = FailedVariant("mlp_int8", "int8", "INT8 calibration (modelopt) failed: Concat shape mismatch "
                                                "(full output: .logs/build-1.log)")
    summary = summarize([], [_spec(tmp_path / "m.onnx")], repository=tmp_path / "repo", report=None,
                        log_file=Path(".logs/build-1.log"), failures=[failure])
    assert [r.variant for r in summary.failures] == ["mlp_int8"]
    text = _text(summary)
    line = next(ln for ln in text.splitlines() if "mlp_int8" in ln)
    assert "INT8 calibration (modelopt) failed: Concat shape mismatch" in line and line.rstrip().endswith("FAILED")
    assert "0 variants ready, 1 FAILED" in text
    assert "build log:  .logs/build-1.log" in text
    assert "\x1b[" not in text  # not a terminal: no colour codes


def test_built_then_unchanged_rows_from_a_real_build(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A real build, then the same build again (unchanged, read back from build.json)."""
    onnx = mlp_onnx(tmp_path / "mlp.onnx")
    repo = tmp_path / "repo"
    # The CPU runtime by name: on a GPU host `auto` would take onnxruntime-cuda.
    args = ["build", "--onnx", str(onnx), "--name", "mlp", "--precision", "fp32", "--runtime", "onnxruntime",
            "--repository", str(repo),
            "--log", str(tmp_path / "b.log")]
    assert main(args) == 0
    first = capsys.readouterr().out
    row = next(ln for ln in first.splitlines() if ln.startswith("mlp_fp32"))
    assert "rebuilt" in row and "max_rel 0 ≤ 0.0001" in row
    assert "build summary: 1 variant ready (runtime: onnxruntime)" in first  # one runtime: named once
    assert f"repository: {repo}" in first and f"report:     {repo / 'build_report.json'}" in first
    assert "perfclient -m mlp_fp32 -u localhost:8001" in first and "trtbuild serve" in first
    assert main(args) == 0
    second = capsys.readouterr().out
    row = next(ln for ln in second.splitlines() if ln.startswith("mlp_fp32"))
    assert "unchanged" in row and "max_rel 0 ≤ 0.0001" in row
    record = json.loads((repo / "mlp_fp32" / "build.json").read_text())
    assert f"{record['size_bytes'] / 1e3:.1f} kB" in row


def test_accuracy_against_each_limit() -> None:
    text, within = accuracy_text({"cosine_min": 0.94, "cosine_mean": 0.978, "top1_agreement": 0.823},
                                 {"cosine_mean_min": 0.95, "cosine_min": 0.97})
    assert text == "cos_min 0.94 < 0.97, cos_mean 0.978 ≥ 0.95, top1 0.823"
    assert within is False
    text, within = accuracy_text({"max_rel": 0.0}, {"max_rel": 1e-4})
    assert (text, within) == ("max_rel 0 ≤ 0.0001", True)
    row = SummaryRow("m_int8", "int8", "onnxruntime", 5_100_000, "cos_min 0.94 < 0.97", False, seconds=3.0)
    text = _text(BuildSummary((row,), Path("repo")))
    assert "(out of tolerance)" in text and "5.1 MB" in text


def test_what_the_guards_kept() -> None:
    assert guard_text({"excluded": ["a", "b", "c"], "fallback": None}) == "3 nodes unquantized"
    assert guard_text({"excluded": [], "fallback": "fp16"}).startswith("all: FP16 served")
    assert guard_text(None, {"kept_fp32_nodes": ["n"], "kept_fp32_op_types": [], "fallback": None}) == "1 node in FP32"
    assert guard_text(None, {"kept_fp32_nodes": [], "kept_fp32_op_types": ["Softmax"], "fallback": None,
                             "settings": {}}) == "op types in FP32: Softmax"
    assert guard_text(None, None) == "-"


def test_a_narrow_terminal_gets_every_column(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below 110 columns rich would drop the last columns to fit; the plain form keeps them all."""
    failure = FailedVariant("a_very_long_model_name_fp16", "fp16", "FP16 conversion failed: shape mismatch")
    row = SummaryRow("a_very_long_model_name_fp32", "fp32", "onnxruntime", 18_600_000,
                     "cos_mean 0.9784 ≥ 0.95, top1 0.823 ≥ 0.7", True, "3 nodes unquantized", 57.2,
                     "rebuilt, calibration cached")
    summary = BuildSummary((row, failed_row(failure)), Path("repo"))
    for columns, wide in (("80", False), ("160", True)):
        monkeypatch.setenv("COLUMNS", columns)
        stream = io.StringIO()
        render(summary, stream, color=True)
        text = stream.getvalue()
        assert "rebuilt, calibration cached" in text.replace("\n", " ") or wide  # whole cells when narrow
        assert "57.2 s" in text and "FAILED" in text and "unquantized" in text
        assert ("\x1b[" in text) is wide  # colour only where the table fits the terminal


def test_the_plain_table_keeps_a_long_reason_on_its_row(tmp_path: Path) -> None:
    """Off a terminal (a log, a pipe) each variant is one line, however long its failure reason: grep finds
    the whole reason on the row that names the variant (the 200-column form wrapped it onto a second line)."""
    reason = ("model 'det': the FP32 model does not run on the evaluation samples (images [4, 3, 102, 102]): "
              "Concat node 'concat': Non concat axis dimensions must match: Axis 2 has mismatched dimensions "
              "of 52 and 51 (full output: .logs/build-20261122T104331Z-1206.log)")
    built = SummaryRow("tiny_fp32", "fp32", "onnxruntime", 13_700, "max_rel 0 ≤ 0.0001, top1 1.000", True,
                       "all: FP16 served (no INT8 mix met the tolerance)", 0.1, "rebuilt, calibration cached")
    summary = BuildSummary((built, failed_row(FailedVariant("det_fp32", "fp32", reason))), Path("repo"))
    lines = _text(summary).splitlines()
    (row,) = [ln for ln in lines if ln.startswith("det_fp32")]
    assert reason in row and row.rstrip().endswith("FAILED"), lines
    header = next(i for i, ln in enumerate(lines) if ln.startswith("variant"))
    assert len(lines) == header + 5, lines  # header, rule, two rows, the repository line


def test_the_next_verify_command_names_only_models_built_whole(tmp_path: Path) -> None:
    """`trtbuild verify` stops at a variant it does not find: after a build with a failure (or of an --only
    subset) the proposed command names the models whose every variant is ready; a plain one otherwise."""
    from builder.pipeline import ModelResult, ModelStatus

    specs = [_spec(tmp_path / "a.onnx", "a"), _spec(tmp_path / "b.onnx", "b")]
    unchanged = [ModelResult(name, ModelStatus.UNCHANGED, "", []) for name in ("a", "b")]
    manifest = Path("models.toml")

    def verify_lines(summary: BuildSummary) -> list[str]:
        return [c for c in summary.next_commands if c.startswith("trtbuild verify")]

    whole = summarize(unchanged, specs, repository=Path("repo"), report=None, log_file=None, manifest=manifest)
    assert verify_lines(whole) == ["trtbuild verify --manifest models.toml --repository repo"]
    failed = summarize(unchanged[1:], specs, repository=Path("repo"), report=None, log_file=None, manifest=manifest,
                       failures=[FailedVariant("a_int8", "int8", "calibration failed")])
    assert verify_lines(failed) == ["trtbuild verify --manifest models.toml --repository repo --only b"]
    subset = summarize(unchanged[:1], specs[:1], repository=Path("repo"), report=None, log_file=None,
                       manifest=manifest, whole_manifest=False)
    assert verify_lines(subset) == ["trtbuild verify --manifest models.toml --repository repo --only a"]
    none = summarize([], specs[:1], repository=Path("repo"), report=None, log_file=None, manifest=manifest,
                     failures=[FailedVariant("a_fp32", "fp32", "export failed")])
    assert verify_lines(none) == [] and none.next_commands == ()


def test_verify_only_checks_the_models_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing is built: the error names the one model asked for (before any request), and an unknown name
    is one line naming --only and the manifest's models."""
    mlp_onnx(tmp_path / "m.onnx")
    (tmp_path / "models.toml").write_text("".join(
        f'[[model]]\nname = "{name}"\nonnx = "m.onnx"\nprecisions = ["fp32"]\n\n' for name in ("a", "b")))
    base = ["verify", "--manifest", str(tmp_path / "models.toml"), "--repository", str(tmp_path / "repo"),
            "--http-url", "127.0.0.1:9", "--grpc-url", "127.0.0.1:9"]
    assert main([*base, "--only", "b"]) == 1
    err = capsys.readouterr().err
    assert "model 'b'" in err and "model 'a'" not in err, err
    assert main([*base, "--only", "c"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("trtbuild: error: --only c: not in ") and line.endswith("(models: a, b)"), line


def test_a_wide_terminal_keeps_every_cell_on_its_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the whole table fits, no cell wraps (the guard column wrapped '1 node unquantized' and its own
    header at 140 columns); where it does not, the table still fits the terminal."""
    rows = (SummaryRow("outlier_int8", "int8", "onnxruntime", 48_600, "cos_min 0.9989 ≥ 0.995", True,
                       "1 node unquantized", 4.3, "rebuilt, calibration cached"),
            SummaryRow("outlier_fp16", "fp16", "onnxruntime", 32_500, "cos_min 1 ≥ 0.999", True, "-", 6.6))
    summary = BuildSummary(rows, Path("repo"))
    monkeypatch.setenv("COLUMNS", "140")
    stream = io.StringIO()
    render(summary, stream, color=True)
    plain = re.sub(r"\x1b\[[0-9;]*m", "", stream.getvalue())
    row = next(ln for ln in plain.splitlines() if ln.startswith("outlier_int8"))
    assert "1 node unquantized" in row and "rebuilt, calibration cached" in row, plain
    assert any("kept in higher precision" in ln for ln in plain.splitlines()), plain
    long_accuracy = "cos_min 0.9989 ≥ 0.995, cos_mean 0.9991 ≥ 0.995, max_abs 0.0123 ≤ 0.05, top1 0.98 ≥ 0.97"
    wide = BuildSummary((replace(rows[0], accuracy=long_accuracy, kept="all: FP16 served (no INT8 mix met "
                                                                       "the tolerance)"),), Path("repo"))
    monkeypatch.setenv("COLUMNS", "112")
    stream = io.StringIO()
    render(wide, stream, color=True)
    assert max(len(ln) for ln in re.sub(r"\x1b\[[0-9;]*m", "", stream.getvalue()).splitlines()) <= 112


def test_a_variant_marked_without_a_measurement_shows_no_ratio_and_is_never_the_pick() -> None:
    """FP32's graph under the INT8 name (its guard fell back to FP32) is marked on every runtime without a
    throughput: its row has no "vs FP32", says not worth serving, and FP32 (measured) is the one to serve."""
    fp32 = {"name": "m_fp32", "precision": "fp32", "model": "m", "accuracy": {"max_rel": 0.0},
            "tolerance": {"max_rel": 1e-4},
            "speed": {"throughput": 100.0, "fp32_throughput": None, "worth_serving": True}}
    int8 = {"name": "m_int8", "precision": "int8", "model": "m", "accuracy": {"max_rel": 0.0},
            "tolerance": {"max_rel": 1e-4},
            "speed": {"throughput": None, "fp32_throughput": None, "ratio": None, "worth_serving": False,
                      "reason": "the FP32 graph (no INT8 mix met the tolerance)"}}
    rows = with_recommendation([row_from_record(fp32, state="rebuilt"), row_from_record(int8, state="rebuilt")])
    assert [r.speed_ratio for r in rows] == [1.0, None]
    assert [r.serve for r in rows] == [True, False]
    assert rows[1].worth_serving is False
    text = _text(BuildSummary(rows=tuple(rows), repository=Path("repo")))
    int8_line = next(line for line in text.splitlines() if line.startswith("m_int8"))
    assert int8_line.split("|")[5].strip() == "-" and int8_line.split("|")[6].strip() == "not worth serving"


def test_a_lower_precision_without_rounds_to_compare_is_never_the_pick() -> None:
    """An older or hand-edited build.json: a ratio but no rounds (or rounds that are not numbers) shows no
    measurement that the variant is faster, so FP32 stays the pick; nothing raises."""
    fp32 = {"name": "m_fp32", "precision": "fp32", "model": "m", "accuracy": {"max_rel": 0.0},
            "tolerance": {"max_rel": 1e-4}, "speed": {"throughput": 100.0, "rounds": [99.0, 101.0]}}
    for speed in ({"throughput": 300.0, "fp32_throughput": 100.0, "ratio": 3.0},
                  {"throughput": 300.0, "fp32_throughput": 100.0, "ratio": 3.0, "rounds": "fast",
                   "fp32_rounds": [1, "x"]}):
        int8 = {"name": "m_int8", "precision": "int8", "model": "m", "accuracy": {"max_rel": 0.0},
                "tolerance": {"max_rel": 1e-4}, "speed": speed}
        rows = with_recommendation([row_from_record(fp32, state="unchanged"),
                                    row_from_record(int8, state="unchanged")])
        assert [r.variant for r in rows if r.serve] == ["m_fp32"]
        assert rows[1].speed_ratio == 3.0 and rows[1].clearly_faster is None


def test_within_noise_is_said_with_the_rounds_and_only_of_a_variant_within_its_tolerance() -> None:
    def record(name: str, within: bool) -> dict[str, object]:
        return {"name": name, "precision": "int8", "model": "m", "accuracy": {"max_rel": 0.0 if within else 1.0},
                "tolerance": {"max_rel": 1e-4},
                "speed": {"throughput": 110.0, "rounds": [95.0, 110.0, 130.0], "fp32_throughput": 100.0,
                          "fp32_rounds": [96.0, 100.0, 104.0], "ratio": 1.1, "worth_serving": True}}

    fp32 = {"name": "m_fp32", "precision": "fp32", "model": "m", "accuracy": {"max_rel": 0.0},
            "tolerance": {"max_rel": 1e-4}, "speed": {"throughput": 100.0, "rounds": [96.0, 100.0, 104.0]}}
    rows = with_recommendation([row_from_record(r, state="rebuilt")
                                for r in (fp32, record("m_int8", True), record("m_int8b", False))])
    text = _text(BuildSummary(rows=tuple(rows), repository=Path("repo")))
    cells = {line.split(" |")[0].strip(): line.split("|")[6].strip() for line in text.splitlines()
             if line.startswith("m_") and " | " in line}
    assert cells == {"m_fp32": "yes", "m_int8": "within noise", "m_int8b": ""}
    assert "m_int8 within noise of FP32: rounds 95–130 vs FP32's 96–104 infer/s" in text.splitlines()
    assert not any(line.startswith("m_int8b within noise") for line in text.splitlines())


def test_a_lower_precision_faster_by_less_than_the_margin_is_not_the_pick() -> None:
    """PP-OCRv4 rec's FP16 was 1.035x FP32 in-process, every round above FP32's, and served 0.70x FP32: a
    pick needs PICK_MARGIN too. Beyond the spread but under the margin: FP32 is the pick and the row says why;
    beyond both: the lower precision is."""
    fp32 = {"name": "m_fp32", "precision": "fp32", "model": "m", "accuracy": {"max_rel": 0.0},
            "tolerance": {"max_rel": 1e-4}, "speed": {"throughput": 70.0, "rounds": [66.9, 71.6, 70.0]}}

    def fp16(ratio: float, rounds: list[float]) -> dict[str, object]:
        return {"name": "m_fp16", "precision": "fp16", "model": "m", "accuracy": {"max_rel": 0.0},
                "tolerance": {"max_rel": 1e-4},
                "speed": {"throughput": 72.5, "rounds": rounds, "fp32_throughput": 70.0,
                          "fp32_rounds": [66.9, 71.6, 70.0], "ratio": ratio, "worth_serving": True}}

    rows = with_recommendation([row_from_record(fp32, state="rebuilt"),
                                row_from_record(fp16(1.035, [72.9, 71.8, 72.5]), state="rebuilt")])
    assert [r.variant for r in rows if r.serve] == ["m_fp32"]
    assert rows[1].beyond_spread is True and rows[1].clearly_faster is False
    text = _text(BuildSummary(rows=tuple(rows), repository=Path("repo")))
    fp16_line = next(line for line in text.splitlines() if line.startswith("m_fp16 ") and " | " in line)
    assert fp16_line.split("|")[6].strip() == f"under {PICK_MARGIN:.2f}x"
    assert (f"m_fp16 1.035x FP32, under the {PICK_MARGIN:.2f}x a pick needs: rounds 71.8–72.9 vs FP32's 66.9–71.6 "
            "infer/s") in text.splitlines()

    rows = with_recommendation([row_from_record(fp32, state="rebuilt"),
                                row_from_record(fp16(1.12, [78.0, 79.0, 80.0]), state="rebuilt")])
    assert [r.variant for r in rows if r.serve] == ["m_fp16"]


def test_a_less_accurate_precision_takes_the_pick_only_by_the_margin() -> None:
    """FP16 and INT8 both clearly faster than FP32: INT8 is the pick only at PICK_MARGIN times FP16's ratio."""
    fp32 = {"name": "m_fp32", "precision": "fp32", "model": "m", "accuracy": {"max_rel": 0.0},
            "tolerance": {"max_rel": 1e-4}, "speed": {"throughput": 100.0, "rounds": [98.0, 100.0, 102.0]}}

    def lower(precision: str, ratio: float) -> dict[str, object]:
        rounds = [100 * ratio - 1, 100 * ratio, 100 * ratio + 1]
        return {"name": f"m_{precision}", "precision": precision, "model": "m", "accuracy": {"max_rel": 0.0},
                "tolerance": {"max_rel": 1e-4},
                "speed": {"throughput": 100 * ratio, "rounds": rounds, "fp32_throughput": 100.0,
                          "fp32_rounds": [98.0, 100.0, 102.0], "ratio": ratio, "worth_serving": True}}

    for int8_ratio, pick in ((1.52, "m_fp16"), (1.70, "m_int8")):
        records = (lower("int8", int8_ratio), fp32, lower("fp16", 1.50))  # any order
        rows = with_recommendation([row_from_record(r, state="rebuilt") for r in records])
        assert [r.variant for r in rows if r.serve] == [pick]
        assert [r.variant for r in rows] == ["m_int8", "m_fp32", "m_fp16"]  # the rows keep their order


def test_a_reason_with_square_brackets_is_shown_whole() -> None:
    """rich reads "[batch, K, 6+]" as a markup tag: the build's one line had it, the table lost it."""
    reason = "task detection: no output of shape [batch, K, 6+] (x1, y1, x2, y2, score, class) among y [16, 4]"
    rows = (failed_row(FailedVariant("m_fp16", "fp16", reason)),
            SummaryRow("m_fp32", "fp32", "onnxruntime", 1000, "cos_min [1] ≥ 0.999", True, "[a]", 1.0, "[b]"))
    for color in (False, True):
        stream = io.StringIO()
        render(BuildSummary(rows, Path("repo")), stream, color=color)
        plain = re.sub(r"\x1b\[[0-9;]*m", "", stream.getvalue())
        assert "[batch," in plain, plain  # the tag rich would have eaten (a narrow cell may wrap the rest)
        assert "cos_min [1]" in plain and "[a]" in plain and "[b]" in plain, plain
