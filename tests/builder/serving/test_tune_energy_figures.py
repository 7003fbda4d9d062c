"""bench/gpu/tune_energy.py's table rows: a latency that was not measured is None, never 0."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from builder.tuning.points import Point, Result
from tests.helpers.scripts import loaded_script

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "gpu" / "tune_energy.py"
POINT = Point("efficientnet_lite0_fp16", 16, 0, 1)


@pytest.fixture(scope="module")
def tune_energy() -> Iterator[ModuleType]:
    with loaded_script("tune_energy", SCRIPT) as module:
        yield module


def result(concurrency: int, p50_us: float | None, p99_us: float | None) -> Result:
    throughput = 0.0 if p99_us is None else 100.0
    return Result(POINT, concurrency, throughput, p50_us, p99_us, None, None, True, 0)


def test_a_concurrency_that_completed_nothing_gives_no_latency(tune_energy: ModuleType) -> None:
    row = tune_energy.figures(POINT, [result(32, None, None)], None, 50_000.0)
    assert row["p50_ms"] is None and row["p99_ms"] is None and row["feasible"] is False


def test_one_hung_concurrency_of_several_hides_no_latency(tune_energy: ModuleType) -> None:
    # The worst p99 over the concurrencies is unknown when one of them completed nothing.
    row = tune_energy.figures(POINT, [result(8, 5_000.0, 9_000.0), result(32, None, None)], None, None)
    assert row["p50_ms"] is None and row["p99_ms"] is None


def test_measured_latencies_are_the_worst_over_the_concurrencies(tune_energy: ModuleType) -> None:
    row = tune_energy.figures(POINT, [result(8, 5_000.0, 9_000.0), result(32, 7_000.0, 12_000.0)], None, None)
    assert row["p50_ms"] == 7.0 and row["p99_ms"] == 12.0
