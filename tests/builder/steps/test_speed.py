"""INT8 (or FP16 on the CPU) only where it pays: each variant's throughput at the opt shape and its size
against FP32's are recorded at build time; one slower (beyond the rounds' spread) or larger is marked not
worth serving, stays built and gated, and the summary names the variant to serve per model."""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from numpy.typing import NDArray

from builder.pipeline import BuildOptions, build_all
from builder.runtimes.onnxruntime import OnnxRuntimeCPU
from builder.spec import Precision
from builder.steps.speed import verdict
from builder.summary import render, summarize
from tests.helpers.tiny_models import tiny_specs

# Inferences per second per round, by the variant's precision (as its folder names it): INT8 well below FP32
# in every round; FP16 within FP32's spread.
_ROUNDS = {"fp32": [100.0, 104.0, 96.0], "fp16": [95.0, 103.0, 99.0], "int8": [40.0, 44.0, 42.0]}


def _stub_meter(paths: Sequence[Path], feed: Mapping[str, NDArray[Any]], **_: Any) -> list[list[float]]:
    def figures(path: Path) -> list[float]:
        folder = path.parent.parent.name  # REPO/.staging/<variant>/1/model.onnx, or the FP32 reference
        return next((f for p, f in _ROUNDS.items() if folder.endswith(p)), _ROUNDS["fp32"])

    return [figures(p) for p in paths]


def test_an_int8_slower_than_fp32_is_marked_not_worth_serving_and_fp32_is_the_one_to_serve(tmp_path: Path) -> None:
    specs = tiny_specs(tmp_path)[:1]  # the MLP: fp32, fp16, int8
    options = BuildOptions(repository=tmp_path / "repo", runtime=OnnxRuntimeCPU(), cache_dir=tmp_path / "cache",
                           speed_meter=_stub_meter)
    results = build_all(specs, options, tmp_path / "repo" / "build_report.json", ["pytest"])
    assert not results[0].failures  # built and gated all the same
    record = json.loads((tmp_path / "repo" / "mlp_int8" / "build.json").read_text())
    assert record["worth_serving"] is False
    assert record["speed"]["ratio"] == 0.42 and record["speed"]["fp32_throughput"] == 100.0
    assert record["speed"]["reason"].startswith("int8 0.42x FP32's throughput, ")
    assert json.loads((tmp_path / "repo" / "mlp_fp16" / "build.json").read_text())["worth_serving"] is True
    (model,) = json.loads((tmp_path / "repo" / "build_report.json").read_text())["models"]
    by_name = {v["name"]: v for v in model["variants"]}
    assert by_name["mlp_int8"]["speed"]["worth_serving"] is False

    summary = summarize(results, specs, repository=tmp_path / "repo", report=None, log_file=None)
    assert [r.variant for r in summary.rows if r.serve] == ["mlp_fp32"]
    out = io.StringIO()
    render(summary, out, color=False)
    text = out.getvalue()
    assert "mlp_int8 not worth serving: int8 0.42x FP32's throughput, " in text
    (fp32_line,) = [line for line in text.splitlines() if line.startswith("mlp_fp32 |")]
    assert "| yes " in fp32_line and "1.00x" in fp32_line
    (int8_line,) = [line for line in text.splitlines() if line.startswith("mlp_int8 |")]
    assert "not worth serving" in int8_line and "0.42x" in int8_line

    # Unchanged on the next build: the summary reads the same verdict from build.json.
    again = build_all(specs, options, None, ["pytest"])
    summary = summarize(again, specs, repository=tmp_path / "repo", report=None, log_file=None)
    assert [r.variant for r in summary.rows if r.serve] == ["mlp_fp32"]
    assert [r.variant for r in summary.rows if r.worth_serving is False] == ["mlp_int8"]


def test_the_verdict_allows_for_the_rounds_spread_and_marks_a_larger_variant() -> None:
    assert verdict(Precision.INT8, [90, 110, 95], [100, 104, 96], 10, 20) == (True, None)  # within the spread
    worth, reason = verdict(Precision.INT8, [120, 130, 125], [100, 104, 96], 6_800_000, 6_700_000)
    assert not worth and reason == "int8 1.25x FP32's throughput, 6.8 MB vs 6.7 MB"
    worth, reason = verdict(Precision.FP16, [43, 44, 42], [100, 104, 96], 10, 20)
    assert not worth and reason == "fp16 0.43x FP32's throughput, 0.0 kB vs 0.0 kB"
    assert verdict(Precision.FP32, [1, 1, 1], None, 10, 10) == (True, None)


def test_the_real_measurement_records_positive_figures(tmp_path: Path) -> None:
    specs = tiny_specs(tmp_path)[:1]
    options = BuildOptions(repository=tmp_path / "repo", runtime=OnnxRuntimeCPU(), cache_dir=tmp_path / "cache")
    build_all(specs, options, None, ["pytest"])
    for name in ("mlp_fp32", "mlp_int8"):
        speed = json.loads((tmp_path / "repo" / name / "build.json").read_text())["speed"]
        assert speed["throughput"] > 0 and all(r > 0 for r in speed["rounds"])
        assert speed["size_bytes"] > 0 and speed["fp32_size_bytes"] > 0 and speed["batch"] == 4
        assert isinstance(speed["worth_serving"], bool)
    int8 = json.loads((tmp_path / "repo" / "mlp_int8" / "build.json").read_text())["speed"]
    assert int8["fp32_throughput"] > 0 and int8["ratio"] > 0 and len(int8["fp32_rounds"]) == 3


def test_a_variant_faster_only_within_the_spread_is_not_the_one_to_serve(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """FP16's slowest round above FP32's fastest: FP16 is the pick. FP16's median above FP32's but its rounds
    overlapping FP32's (a busy machine's short rounds): FP32 is the pick, and FP16's row says why not it. (The
    tiny MLP's INT8 is larger than its FP32, so never the pick.)"""
    monkeypatch.setitem(_ROUNDS, "fp16", [150.0, 160.0, 155.0])
    specs = tiny_specs(tmp_path)[:1]
    options = BuildOptions(repository=tmp_path / "repo", runtime=OnnxRuntimeCPU(), cache_dir=tmp_path / "cache",
                           speed_meter=_stub_meter)
    results = build_all(specs, options, None, ["pytest"])
    summary = summarize(results, specs, repository=tmp_path / "repo", report=None, log_file=None)
    assert [r.variant for r in summary.rows if r.serve] == ["mlp_fp16"]

    monkeypatch.setitem(_ROUNDS, "fp16", [95.0, 130.0, 110.0])  # median 1.1x FP32's, slowest round below its fastest
    results = build_all(specs, replace(options, repository=tmp_path / "repo2"), None, ["pytest"])
    summary = summarize(results, specs, repository=tmp_path / "repo2", report=None, log_file=None)
    assert [r.variant for r in summary.rows if r.serve] == ["mlp_fp32"]
    out = io.StringIO()
    render(summary, out, color=False)
    lines = {line.split(" |")[0]: line for line in out.getvalue().splitlines() if line.startswith("mlp_")}
    assert "1.10x" in lines["mlp_fp16"] and "| within noise" in lines["mlp_fp16"]
    assert "mlp_fp16 within noise of FP32: rounds 95–130 vs FP32's 96–104 infer/s" in out.getvalue().splitlines()
    assert "| yes " in lines["mlp_fp32"]


def _branching_model(path: Path) -> Path:
    """y = x where sr == 16000; any other sr takes a branch that cannot run (a reshape of 4 values to 3 rows),
    as a voice-activity model's If over its sample rate fails on a rate it has no branch for."""
    from onnx import TensorProto, helper, save

    then = helper.make_graph([helper.make_node("Identity", ["x"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    bad = helper.make_tensor("three", TensorProto.INT64, [2], [3, -1])
    other = helper.make_graph([helper.make_node("Reshape", ["x", "three"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)], initializer=[bad])
    rate = helper.make_tensor("rate", TensorProto.INT64, [], [16000])
    graph = helper.make_graph(
        [helper.make_node("Equal", ["sr", "rate"], ["is16k"]),
         helper.make_node("If", ["is16k"], ["y"], then_branch=then, else_branch=other)],
        "branching", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4]),  # n: checked at run time
                      helper.make_tensor_value_info("sr", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=[rate])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_the_opt_feed_takes_an_integer_input_from_the_held_out_samples(tmp_path: Path) -> None:
    """0s and 1s for an integer input with no declared range send a model down a branch it never takes (silero
    VAD's If over its sample rate failed there, and no variant's speed was recorded); the held-out samples'
    values are used where their shape is the opt shape."""
    import numpy as np
    import onnxruntime as ort

    from builder.spec.model import TensorSpec
    from builder.spec.shapes import ModelShapes, ShapeRange
    from builder.steps.speed import opt_feed

    path = _branching_model(tmp_path / "m.onnx")
    inputs = (TensorSpec("x", "float32", (1, 4)), TensorSpec("sr", "int64", ()))
    shapes = ModelShapes(False, {"x": ShapeRange.fixed((1, 4)), "sr": ShapeRange.fixed(())})
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    guessed, _ = opt_feed(inputs, shapes, {})
    with pytest.raises(Exception, match=r"(?i)reshape"):
        session.run(None, guessed)  # what the build measured before: the failing branch
    held_out = {"x": np.arange(8, dtype=np.float32).reshape(2, 1, 4), "sr": np.array([16000, 16000])}
    feed, batch = opt_feed(inputs, shapes, {}, real=held_out)
    assert batch == 1 and int(feed["sr"]) == 16000
    np.testing.assert_array_equal(feed["x"], held_out["x"][0])  # every input fits: the real sample whole
    session.run(None, feed)

    # Held-out floats at another shape: synthetic floats at the opt shape, the integer input still real.
    wide = {"x": np.zeros((2, 1, 8), np.float32), "sr": np.array([16000, 16000])}
    feed, _ = opt_feed(inputs, shapes, {}, real=wide)
    assert feed["x"].shape == (1, 4) and feed["x"].any() and int(feed["sr"]) == 16000


def test_a_batching_models_opt_feed_repeats_the_held_out_rows_up_to_the_opt_batch() -> None:
    import numpy as np

    from builder.spec.model import TensorSpec
    from builder.spec.shapes import ModelShapes, ShapeRange
    from builder.steps.speed import opt_feed

    inputs = (TensorSpec("ids", "int64", (-1, 3)),)
    shapes = ModelShapes(True, {"ids": ShapeRange((1, 3), (5, 3), (8, 3))})
    rows = np.array([[7, 8, 9], [4, 5, 6]])
    feed, batch = opt_feed(inputs, shapes, {}, real={"ids": rows})
    assert batch == 5
    np.testing.assert_array_equal(feed["ids"], rows[[0, 1, 0, 1, 0]])


def test_each_round_runs_the_model_a_few_times_however_slow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A round of 0.15 s held one or two runs of a slow model; now MIN_ROUND_RUNS at least, counted here."""
    from builder.runtimes import onnxruntime as runtime
    from tests.helpers.tiny_models import mlp_onnx

    runs: list[int] = []

    class Counted:
        def __init__(self, session: Any) -> None:
            self.session = session

        def run(self, *args: Any) -> Any:
            runs.append(1)
            return self.session.run(*args)

    opened = runtime.ort_session
    monkeypatch.setattr(runtime, "ort_session", lambda path, threads: Counted(opened(path, threads)))
    path = mlp_onnx(tmp_path / "m.onnx")
    import numpy as np

    feed = {"x": np.zeros((1, 4, 32), np.float32)}
    figures = runtime.ort_rounds([path], feed, rounds=2, seconds=0.0)
    assert len(figures[0]) == 2 and all(f > 0 for f in figures[0])
    assert len(runs) == 3 + 2 * runtime.MIN_ROUND_RUNS  # three warm-up runs, then each round's


def test_a_slow_models_round_stops_after_its_time_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model slower than MAX_ROUND_SECONDS a run gets one run per round, not MIN_ROUND_RUNS: the build's time
    stays bounded (a clock that advances 5 s per run stands in for the slow model)."""
    import numpy as np

    from builder.runtimes import onnxruntime as runtime
    from tests.helpers.tiny_models import mlp_onnx

    now = [0.0]

    class Slow:
        def __init__(self, session: Any) -> None:
            self.session = session

        def run(self, *args: Any) -> Any:
            now[0] += 5.0
            return self.session.run(*args)

    opened = runtime.ort_session
    monkeypatch.setattr(runtime, "ort_session", lambda path, threads: Slow(opened(path, threads)))
    monkeypatch.setattr(runtime.time, "perf_counter", lambda: now[0])
    path = mlp_onnx(tmp_path / "m.onnx")
    figures = runtime.ort_rounds([path], {"x": np.zeros((1, 4, 32), np.float32)}, rounds=2, seconds=0.15)
    assert figures == [[0.2, 0.2]]  # one run of 5 s per round
