"""Issue 26: a point whose windows lack energy (a failed read, a counter that did not advance) is kept,
ranked on what it has and marked "energy unknown" in the report, the page and the terminal table; a run
cut short says so instead of "no point met the constraints". The server is replaced by a stand-in tuner
that returns chosen figures (the search, ranking and reporting are what is tested)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from builder.tuning import run as tune_run
from builder.tuning.objective import Goal, Objective, best, score
from builder.tuning.points import Point, Result, Space, energy_note
from builder.tuning.report import TuneReport
from builder.tuning.run import TuneConfig, tune
from builder.tuning.strategies import Search
from builder.tuning.targets import Target

ENERGY = Objective(Goal.INFER_PER_JOULE)


def result(point: Point, concurrency: int, throughput: float, per_joule: float | None) -> Result:
    return Result(point, concurrency, throughput, 900.0, 1000.0, per_joule, 1.0, True, 0)


def test_a_point_without_energy_is_ranked_on_what_it_has_and_never_raises() -> None:
    a, b, c, d = (Point("m", size, 0, 1) for size in (1, 2, 4, 8))
    measured = {
        a: [result(a, 1, 100.0, 5.0), result(a, 4, 300.0, 7.0)],
        b: [result(b, 1, 100.0, None), result(b, 4, 300.0, 9.0)],  # one window's read failed: ranked on 9.0
        c: [result(c, 1, 500.0, None), result(c, 4, 900.0, None)],  # no energy at all
        d: [result(d, 1, 400.0, None), result(d, 4, 800.0, None)],
    }
    assert ENERGY.value(measured[a]) == 6.0 and ENERGY.value(measured[b]) == 9.0  # before: BuilderError
    assert ENERGY.value(measured[c]) == -math.inf
    assert best(measured, ENERGY) == b
    assert score(ENERGY, measured[a]) > score(ENERGY, measured[c]) > score(ENERGY, [result(a, 1, 0.0, None)])
    assert energy_note(measured[b]) == "energy unknown at concurrency 1"
    assert energy_note(measured[c]) == "energy unknown" and energy_note(measured[a]) is None
    # Where no point has energy, the ties go to throughput.
    assert best({c: measured[c], d: measured[d]}, ENERGY) == c


class StandInTarget(Target):
    # LocalTarget's signature
    def __init__(self, repository: Path, variants: object, *, mps: bool | None = False) -> None:
        self.originals = {}

    def load(self, point: Point) -> None:
        pass


def stand_in_tuner(figures: Callable[[Point, int], Result]) -> type:
    class StandInTuner:
        def __init__(self, target: Target, concurrencies: list[int], **_: Any) -> None:
            self.concurrencies = concurrencies
            self.measured: dict[Point, list[Result]] = {}
            self.failures: dict[Point, str] = {}
            self.restarts: dict[Point, list[str]] = {}
            self.count = 0
            self.search_bar = None

        def measure(self, point: Point) -> list[Result]:
            self.count += 1
            self.measured[point] = [figures(point, c) for c in self.concurrencies]
            return self.measured[point]

        def remeasure(self, point: Point) -> list[Result]:
            return [figures(point, c) for c in self.concurrencies]

    return StandInTuner


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Callable[[Callable[[Point, int], Result]], None]:
    monkeypatch.setattr(tune_run, "LocalTarget", StandInTarget)
    monkeypatch.setattr(tune_run, "require_power", lambda attach: None)

    def use(figures: Callable[[Point, int], Result]) -> None:
        monkeypatch.setattr(tune_run, "Tuner", stand_in_tuner(figures))

    return use


SPACE = Space(("mlp_fp32",), (1, 8), (0,), (1,))


def run(repository: Path, tmp_path: Path) -> TuneReport:
    return tune(TuneConfig(repository, SPACE, ENERGY, search=Search.EXHAUSTIVE, concurrencies=[1, 4],
                           measurement_ms=300,
                default_variant="mlp_fp32", report_path=tmp_path / "tune.json", plot_path=None,
                html_path=tmp_path / "tune.html", write=False, compare=False))


def test_tune_keeps_and_marks_a_point_whose_energy_is_unknown(
        repo_copy: Path, tmp_path: Path, stand_in: Callable[[Callable[[Point, int], Result]], None]) -> None:
    # Batch 8 is faster but its energy reads failed at concurrency 4; batch 1 has every figure.
    stand_in(lambda p, c: result(p, c, 100.0 * p.max_batch_size,
                                 None if (p.max_batch_size, c) == (8, 4) else 2.0 * p.max_batch_size))
    report = run(repo_copy, tmp_path)  # before: BuilderError "no power source here", "no point met the constraints"
    assert report.winner is not None and report.winner.max_batch_size == 8 and report.partial is None
    doc = json.loads((tmp_path / "tune.json").read_text())
    energy = {p["label"]: p["energy"] for p in doc["points"]}
    assert sorted(energy.values(), key=str) == [None, "energy unknown at concurrency 4"]
    page = (tmp_path / "tune.html").read_text()
    assert "energy unknown at concurrency 4" in page and "<th>infer/J</th>" in page and "<td>2.00</td>" in page
    assert "no point met the constraints" not in page


def test_a_run_cut_short_says_so_and_not_that_no_point_met_the_constraints(
        repo_copy: Path, tmp_path: Path, stand_in: Callable[[Callable[[Point, int], Result]], None]) -> None:
    def figures(p: Point, c: int) -> Result:
        if p.max_batch_size == 8:
            raise RuntimeError("the meter's thread died")
        return result(p, c, 100.0, 1.0)

    stand_in(figures)
    with pytest.raises(RuntimeError, match="the meter's thread died"):
        run(repo_copy, tmp_path)
    doc = json.loads((tmp_path / "tune.json").read_text())
    assert doc["partial"] == "the meter's thread died"  # before: None
    assert doc["why"] == "no pick: the run stopped before the search ended (the meter's thread died)"
    page = (tmp_path / "tune.html").read_text()
    assert "Partial run: the meter&#x27;s thread died" in page and "no point met the constraints" not in page
