"""Each accuracy guard's search stops at its time budget (steps/budget.py): no candidate is tried after it, the
report says the budget ended the search, and the summary line tells the user how to raise it. The clock is a
stand-in that each candidate moves on by 10 s, so the test does not depend on the machine's speed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from builder.cli import main
from builder.repository.onnx_files import sha256_file
from builder.runtimes.onnxruntime import OnnxRuntimeReference
from builder.spec import DataSpec, Task, Tolerance
from builder.spec.enums import CalibrationMethod, GuardSensitivity, Int8Recipe
from builder.spec.model import CalibrationSpec
from builder.steps import budget, precision
from builder.steps.accuracy import Metrics
from builder.steps.fp16_guard import guard as fp16_guard
from builder.steps.guard import guard as int8_guard
from builder.steps.precision import Fp16Settings
from builder.steps.qdq_mix import quantized_nodes
from builder.summary import guard_text
from tests.builder.steps.test_fp16_guard import offset_model, offset_samples, plain_offset
from tests.helpers.tiny_models import mlp_samples, outlier_mlp_onnx


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(budget, "time", fake)
    return fake


def test_the_int8_guard_tries_no_candidate_past_its_budget(tmp_path: Path, clock: Clock) -> None:
    model = outlier_mlp_onnx(tmp_path / "outlier.onnx")
    plain = tmp_path / "plain.onnx"
    spec = CalibrationSpec(DataSpec("unused.npz", 64), method=CalibrationMethod.MAX, recipe=Int8Recipe.MODELOPT)
    precision.to_int8(model, fp32_sha=sha256_file(model), calibration=mlp_samples(64, seed=0), data_digest="b",
                      spec=spec, out_path=plain, cache_dir=tmp_path / "cache", log_file=None)
    evaluation = mlp_samples(16, seed=1)
    scored: list[Path] = []

    def measure(path: Path) -> Metrics:  # nothing ever meets the tolerance; each candidate costs 10 s
        scored.append(path)
        clock.now += 10.0
        return Metrics(max_abs=1.0, max_rel=1.0, cosine_min=0.5, cosine_mean=0.5, samples=16)

    def run(budget_s: float | None) -> tuple[bool, int]:
        scored.clear()
        clock.now = 0.0
        result, path = int8_guard(lambda s, _out: None, spec=spec, plain=plain, evaluation=evaluation,
                                  reference=evaluation, task=Task.GENERIC, tolerance=Tolerance(cosine_min=0.99),
                                  work=tmp_path, executor=OnnxRuntimeReference(), method=GuardSensitivity.ONE_PASS,
                                  fp32=model, measure=measure, escalate=True, budget_s=budget_s)
        assert path is None and not result.met
        return result.budget_spent, len(scored) - 1  # the first scored graph is the plain one, before the search

    unbounded = run(None)
    assert unbounded[0] is False and unbounded[1] > 3  # prefixes, then the exhaustive ranking and its search
    # The budget counts from the guard's start: the plain graph's score (0 s), candidates at 10 and 20 s; at 30 s
    # it is spent.
    assert run(25.0) == (True, 2)
    assert len(quantized_nodes(onnx.load(str(plain)))) == 4


def test_the_fp16_guard_stops_at_its_budget_and_serves_fp32_saying_why(tmp_path: Path, clock: Clock) -> None:
    offset = plain_offset(tmp_path, head=False)  # no FP16 mix can meet it
    converted: list[Fp16Settings] = []

    def convert(settings: Fp16Settings, out: Path) -> None:
        converted.append(settings)
        clock.now += 10.0
        offset.convert(settings, out)

    work = tmp_path / "work"
    work.mkdir()
    report, path = fp16_guard(convert, offset.evaluate, plain=offset.plain, tolerance=Tolerance(cosine_min=0.999),
                              work=work, budget_s=15.0)
    assert path is None and report.budget_spent and report.budget_s == 15.0
    assert len(converted) == 2 == report.conversions  # at 0 and 10 s; at 20 s the budget is spent
    text = guard_text(None, {"fallback": "fp32", "budget_s": report.budget_s, "budget_spent": report.budget_spent})
    assert text == ("all: FP32 served (no FP16 mix met the tolerance within the guard's 15 s budget; "
                    "--guard-budget raises it)")
    unbounded, _ = fp16_guard(convert, offset.evaluate, plain=offset.plain, tolerance=Tolerance(cosine_min=0.999),
                              work=work)
    assert not unbounded.budget_spent and unbounded.conversions > 2
    assert guard_text(None, {"fallback": "fp32"}) == "all: FP32 served (no FP16 mix met the tolerance)"


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_guard_budget_that_is_not_seconds_is_one_line(value: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    model = offset_model(tmp_path / "offset.onnx")
    np.savez(tmp_path / "cal.npz", **offset_samples(16, seed=0))
    code = main(["build", "--onnx", str(model), "--name", "m", "--calibration", str(tmp_path / "cal.npz"),
                 "--repository", str(tmp_path / "repo"), "--guard-budget", value])
    assert code != 0 and not (tmp_path / "repo" / "m_fp32").exists()
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"trtbuild: error: --guard-budget {value}") and "0 or more" in line
