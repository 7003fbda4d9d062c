"""Auto-tuning: search logic on a deterministic cost model, then the real thing on a real server."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest

from builder.errors import BuilderError
from builder.repository.triton_config import parse, to_text
from builder.tuning.objective import Goal, Objective, best, pareto
from builder.tuning.points import Point, Result, Space, apply, point_of
from builder.tuning.run import TuneConfig, tune
from builder.tuning.strategies import Search
from builder.tuning.strategies.grid import exhaustive
from builder.tuning.strategies.hill import hill_climb
from builder.tuning.strategies.tpe import tpe
from tests.helpers.files import snapshot

OFF = None  # dynamic batching off
SPACE = Space(("m_fp32", "m_int8"), (1, 4, 8, 16), (OFF, 0, 500, 2000), (1, 2))


def cost_model(point: Point) -> list[Result]:
    """A smooth, single-peaked stand-in for a server: batching helps up to 8, delay costs latency."""
    batch = min(point.max_batch_size, 8) if point.queue_delay_us is not None else 1
    speed = 100.0 * batch ** 0.8 * (1.6 if point.variant == "m_int8" else 1.0) * (1.1 if point.instances == 2 else 1.0)
    p99 = 1e6 * 32 / speed + (point.queue_delay_us or 0) * 2
    return [Result(point, 32, speed, p99 / 2, p99, None, float(batch), True, 0)]


def test_space_points_and_neighbours() -> None:
    assert len(SPACE.points()) == 2 * 4 * 4 * 2
    start = Point("m_fp32", 8, 0, 1)
    assert set(SPACE.neighbours(start)) == {
        Point("m_int8", 8, 0, 1), Point("m_fp32", 4, 0, 1), Point("m_fp32", 16, 0, 1),
        Point("m_fp32", 8, OFF, 1), Point("m_fp32", 8, 500, 1), Point("m_fp32", 8, 0, 2),
        Point("m_fp32", 4, OFF, 1), Point("m_fp32", 16, 500, 1)}


def test_hill_climbing_reaches_the_exhaustive_optimum_with_fewer_measurements() -> None:
    objective = Objective(Goal.THROUGHPUT)
    full = exhaustive(SPACE, cost_model)
    climbed = hill_climb(SPACE, Point("m_fp32", 1, OFF, 1), cost_model, objective)
    best_full, best_hill = best(full, objective), best(climbed, objective)
    assert best_full is not None and best_hill is not None
    assert objective.value(climbed[best_hill]) >= 0.95 * objective.value(full[best_full])
    assert len(climbed) < len(full) / 2


def measured_points() -> dict[Point, list[Result]]:
    rows = {  # (throughput, p99 ms)
        Point("m_fp32", 16, 2000, 1): (900.0, 80.0),
        Point("m_fp32", 8, 500, 1): (700.0, 40.0),
        Point("m_fp32", 1, OFF, 1): (300.0, 120.0),
        Point("m_int8", 8, 0, 1): (650.0, 30.0),
    }
    return {p: [Result(p, 32, t, p99 * 500, p99 * 1000, None, 4.0, True, 0)] for p, (t, p99) in rows.items()}


def test_constraints_exclude_points_and_can_leave_none() -> None:
    points = measured_points()
    assert best(points, Objective(Goal.THROUGHPUT)) == Point("m_fp32", 16, 2000, 1)
    assert best(points, Objective(Goal.THROUGHPUT, p99_budget_us=50_000)) == Point("m_fp32", 8, 500, 1)
    assert best(points, Objective(Goal.P99)) == Point("m_int8", 8, 0, 1)
    assert best(points, Objective(Goal.P99, min_throughput=680)) == Point("m_fp32", 8, 500, 1)
    assert best(points, Objective(Goal.THROUGHPUT, p99_budget_us=10_000)) is None
    # Infeasible points rank below feasible ones, and among themselves by how far p99 is over.
    budget = Objective(Goal.THROUGHPUT, p99_budget_us=50_000)
    assert budget.rank(points[Point("m_fp32", 16, 2000, 1)]) < budget.rank(points[Point("m_int8", 8, 0, 1)])
    assert pareto(points) == sorted([Point("m_fp32", 16, 2000, 1), Point("m_fp32", 8, 500, 1),
                                     Point("m_int8", 8, 0, 1)], key=Point.sort_key)
    # No energy figure: no value, ranked below every point with one, never an exception (issue 26; a run
    # without any power source is refused before it starts: test_tune_power.py).
    assert Objective(Goal.INFER_PER_JOULE).value(points[Point("m_int8", 8, 0, 1)]) == -math.inf


def test_apply_rewrites_serving_settings_through_the_schema(repo_copy: Path) -> None:
    text = (repo_copy / "mlp_fp32" / "config.pbtxt").read_text()
    original = point_of("mlp_fp32", text)
    assert original == Point("mlp_fp32", 8, 0, 1)
    config = parse(apply(text, Point("mlp_fp32", 4, 1500, 2)))
    assert config.max_batch_size == 4 and config.instance_group[0].count == 2
    assert config.dynamic_batching.max_queue_delay_microseconds == 1500
    assert list(config.dynamic_batching.preferred_batch_size) == [4]
    assert not parse(apply(text, Point("mlp_fp32", 8, OFF, 1))).HasField("dynamic_batching")
    for point in (Point("mlp_fp32", 1, 0, 1), Point("mlp_fp32", 1, OFF, 2), Point("mlp_fp32", 16, 4000, 1)):
        assert point_of("mlp_fp32", apply(text, point)) == point  # every point survives the round trip


@pytest.mark.server
def test_tune_on_a_real_server_writes_the_winner_atomically(repo_copy: Path, tmp_path: Path) -> None:
    space = Space(("mlp_fp32", "mlp_int8"), (1, 8), (OFF, 0), (1,))
    names = {path.relative_to(repo_copy) for path in repo_copy.rglob("*")}
    report = tune(TuneConfig(repo_copy, space, Objective(Goal.THROUGHPUT), search=Search.HILL, concurrencies=[4],
                  measurement_ms=400, default_variant="mlp_fp32", report_path=tmp_path / "tune.json",
                  plot_path=tmp_path / "tune.png", max_trials=3))
    assert report.winner is not None and report.measurements >= 1
    written = (repo_copy / report.winner.variant / "config.pbtxt").read_text()
    assert point_of(report.winner.variant, written) == report.winner
    # Nothing new in the served repository (no backup for deploy to copy), apart from the lock file.
    assert {path.relative_to(repo_copy) for path in repo_copy.rglob("*")} - names <= {Path(".trtbuild.lock")}
    doc = json.loads((tmp_path / "tune.json").read_text())
    assert doc["winner"]["variant"] == report.winner.variant and doc["why"]
    assert [row["config"] for row in doc["comparison"]] == ["tuned", "default", "no dynamic batching"]
    assert all(entry["results"][0]["throughput"] > 0 for entry in doc["points"])
    assert (tmp_path / "tune.png").stat().st_size > 1000


def test_a_point_that_completed_nothing_is_never_feasible_nor_best_for_p99() -> None:
    points = measured_points()
    hung = Point("m_int8", 16, 4000, 2)
    points[hung] = [Result(hung, 32, 0.0, None, None, None, None, False, 0)]
    objective = Objective(Goal.P99)
    assert not objective.feasible(points[hung])
    assert best(points, objective) == Point("m_int8", 8, 0, 1)
    assert hung not in pareto(points)


@pytest.mark.server
def test_tune_with_unmeetable_constraints_leaves_the_repository_untouched(repo_copy: Path, tmp_path: Path) -> None:
    before = snapshot(repo_copy)
    space = Space(("mlp_fp32",), (8,), (0,), (1,))
    with pytest.raises(BuilderError, match="none of the 1 measured points met the constraints"):
        tune(TuneConfig(repo_copy, space, Objective(Goal.THROUGHPUT, p99_budget_us=1.0), search=Search.EXHAUSTIVE,
             concurrencies=[2], measurement_ms=300, default_variant="mlp_fp32", report_path=tmp_path / "t.json",
             plot_path=None, max_trials=2))
    assert snapshot(repo_copy) == before
    assert json.loads((tmp_path / "t.json").read_text())["winner"] is None


def test_p99_objective_averages_over_concurrencies_and_feasibility_takes_the_worst() -> None:
    point = Point("m_fp32", 8, 0, 1)
    results = [Result(point, 1, 100.0, 1e3, 2e3, None, 1.0, True, 0),
               Result(point, 32, 900.0, 2e4, 4e4, None, 8.0, True, 0)]
    assert Objective(Goal.P99).value(results) == -2.1e4  # the mean of 2 ms and 40 ms p99
    assert not Objective(Goal.P99, p99_budget_us=3e4).feasible(results)  # 40 ms is over the budget


def test_tpe_gives_the_same_points_under_the_same_seed_and_stays_within_its_budget() -> None:
    start = Point("m_fp32", 1, OFF, 1)
    objective = Objective(Goal.THROUGHPUT)

    def sequence(seed: int) -> list[Point]:
        return list(tpe(SPACE, start, cost_model, objective, trials=16, seed=seed))

    first = sequence(3)
    assert first == sequence(3)
    assert first[0] == start and len(first) == 16 and len(set(first)) == 16
    assert sequence(4) != first  # the seed, not a fixed list, decides
    full = exhaustive(SPACE, cost_model)
    found = tpe(SPACE, start, cost_model, objective, trials=16, seed=3)
    best_full, best_tpe = best(full, objective), best(found, objective)
    assert best_full is not None and best_tpe is not None
    assert objective.value(found[best_tpe]) >= 0.95 * objective.value(full[best_full])


def test_the_engines_max_batch_bounds_the_space() -> None:
    bounded = SPACE.bounded(8)
    assert bounded.max_batch_sizes == (1, 4, 8) and bounded.queue_delays_us == SPACE.queue_delays_us
    assert SPACE.bounded(0).max_batch_sizes == (0,) and SPACE.bounded(0).queue_delays_us == (OFF,)
    assert Space(("m",), (16, 32), (0,), (1,)).bounded(8).max_batch_sizes == (8,)


def variant_copy(repository: Path, source: str, name: str) -> Path:
    """Another model in the repository: `source`'s folder under a new name."""
    target = repository / name
    shutil.copytree(repository / source, target)
    config = parse((target / "config.pbtxt").read_text())
    config.name = name
    (target / "config.pbtxt").write_text(to_text(config))
    return target


HUNG_MODEL = '''
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(20)  # far beyond the point's time limit in the test
        return [pb_utils.InferenceResponse(output_tensors=[]) for _ in requests]
'''


@pytest.mark.server
def test_a_point_whose_model_fails_to_load_is_skipped_and_reported(repo_copy: Path, tmp_path: Path) -> None:
    broken = variant_copy(repo_copy, "mlp_fp32", "mlp_broken")
    (broken / "1" / "model.onnx").write_bytes(b"not an ONNX file")
    space = Space(("mlp_broken", "mlp_fp32"), (8,), (0,), (1,))
    report = tune(TuneConfig(repo_copy, space, Objective(Goal.THROUGHPUT), search=Search.EXHAUSTIVE, concurrencies=[2],
                  measurement_ms=300, default_variant="mlp_fp32", report_path=tmp_path / "t.json", plot_path=None,
                  max_trials=2, compare=False))
    assert report.winner == Point("mlp_fp32", 8, 0, 1)
    assert report.measurements == 2 and report.failed == 1
    failed = {entry.point.variant: entry.failure for entry in report.points if entry.failure}
    assert list(failed) == ["mlp_broken"] and "did not load" in str(failed["mlp_broken"])
    doc = json.loads((tmp_path / "t.json").read_text())
    assert [p["failure"] is not None for p in doc["points"]] == [True, False]  # sorted: mlp_broken first


@pytest.mark.server
def test_a_hung_point_is_recorded_as_timed_out_and_never_wins(repo_copy: Path, tmp_path: Path) -> None:
    hung = variant_copy(repo_copy, "mlp_fp32", "mlp_hung")
    (hung / "1" / "model.py").write_text(HUNG_MODEL)
    space = Space(("mlp_hung", "mlp_fp32"), (8,), (0,), (1,))
    # The p99 objective: a point with no completed request (no p99 at all) must not look fastest.
    report = tune(TuneConfig(repo_copy, space, Objective(Goal.P99), search=Search.EXHAUSTIVE, concurrencies=[1],
                  measurement_ms=300, default_variant="mlp_hung", report_path=tmp_path / "t.json", plot_path=None,
                  max_trials=2, compare=False, point_timeout_s=6))
    assert report.winner is not None and report.winner.variant == "mlp_fp32"
    entry = next(e for e in report.points if e.point.variant == "mlp_hung")
    assert not entry.feasible and "timed out after 6 s" in str(entry.failure)
    assert point_of("mlp_fp32", (repo_copy / "mlp_fp32" / "config.pbtxt").read_text()) == report.winner


def test_a_missing_variant_is_one_line_and_leaves_no_temporary_folder(repo_copy: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    tempfile.tempdir = None  # re-read TMPDIR
    try:
        with pytest.raises(BuilderError, match=r"--precisions: variant mlp_int4 is not in .*trtbuild engines"):
            tune(TuneConfig(repo_copy, Space(("mlp_fp32", "mlp_int4"), (8,), (0,), (1,)), Objective(),
                            search=Search.HILL,
                 concurrencies=[1], measurement_ms=300, default_variant="mlp_fp32", report_path=None,
                 plot_path=None))
        assert list((tmp_path / "tmp").iterdir()) == []
    finally:
        tempfile.tempdir = None


FAILING_MODEL = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(error=pb_utils.TritonError("refused on purpose")) for _ in requests]
'''


@pytest.mark.server
def test_a_point_whose_every_request_fails_is_recorded_and_never_wins(repo_copy: Path, tmp_path: Path) -> None:
    failing = variant_copy(repo_copy, "mlp_fp32", "mlp_failing")
    (failing / "1" / "model.py").write_text(FAILING_MODEL)
    space = Space(("mlp_failing", "mlp_fp32"), (8,), (0,), (1,))
    # The p99 objective: every request answered at once with an error must not pass for a fast point.
    report = tune(TuneConfig(repo_copy, space, Objective(Goal.P99), search=Search.EXHAUSTIVE, concurrencies=[1],
                  measurement_ms=300, default_variant="mlp_failing", report_path=tmp_path / "t.json",
                  plot_path=None, max_trials=2, compare=False))
    assert report.winner is not None and report.winner.variant == "mlp_fp32"
    entry = next(e for e in report.points if e.point.variant == "mlp_failing")
    assert not entry.feasible and entry.p99_ms is None
    assert "refused on purpose" in str(entry.failure)  # perfclient's warm-up already says why
    assert report.failed == 1 and report.measurements == 2
