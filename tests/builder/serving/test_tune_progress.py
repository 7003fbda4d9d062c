"""What `trtbuild tune` shows while it measures: the search as one counted task (points done of how many,
elapsed, remaining), then the side-by-side re-measurement; in plain mode no line per point or window."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder.tuning.objective import Goal, Objective
from builder.tuning.points import Space
from builder.tuning.run import TuneConfig, tune
from builder.tuning.strategies import Search
from tests.helpers.progress_capture import plain_progress


@pytest.fixture
def plain_lines() -> Iterator[io.StringIO]:
    with plain_progress(interval=0.0) as stream:
        yield stream


@pytest.mark.server
def test_tune_progress_counts_points_and_hides_each_point_s_lines(repo_copy: Path, tmp_path: Path,
                                                                  plain_lines: io.StringIO) -> None:
    space = Space(("mlp_fp32",), (1, 8), (None,), (1,))
    report = tune(TuneConfig(repo_copy, space, Objective(Goal.THROUGHPUT), search=Search.EXHAUSTIVE, concurrencies=[2],
                  measurement_ms=300, default_variant="mlp_fp32", report_path=tmp_path / "t.json", plot_path=None,
                  max_trials=2, write=False))
    assert report.measurements == 2
    lines = plain_lines.getvalue().splitlines()
    # The private server's start has its own task (trtbuild serve's), before the search's.
    assert "[start] tune: exhaustive search (2 steps)" in lines, lines
    assert any(ln.startswith("[....] tune: exhaustive search, 1/2 (50 %), ") and "left" in ln for ln in lines), lines
    assert any(ln.startswith("[done] tune: exhaustive search (2/2, ") for ln in lines), lines
    assert "[start] tune: side by side (3 steps)" in lines
    assert any(ln.startswith("[done] tune: side by side (3/3, ") for ln in lines), lines
    # Each point's task and its perfclient windows are steps of those two: no lines of their own.
    assert not [ln for ln in lines if "measuring" in ln or "windows" in ln], lines
