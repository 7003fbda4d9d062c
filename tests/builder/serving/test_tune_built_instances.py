"""A grid search measures the as-built instance count beside tune's default counts (the python runner on CUDA is
built with 4 per GPU, outside 1,2), so it never writes an unmeasured count over it; counts the user names with
--instances are measured as named. The server is replaced by a stand-in tuner (which points are measured is what is
tested)."""

from __future__ import annotations

from pathlib import Path

import pytest

from builder import cli
from builder.tuning import run as tune_run
from builder.tuning.objective import Objective
from builder.tuning.points import Point, Result, Space
from builder.tuning.run import TuneConfig, tune
from builder.tuning.strategies import Search
from tests.builder.serving.test_tune_energy_gaps import StandInTarget, stand_in_tuner


def measured_instances(repository: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, built: bool) -> set[int]:
    seen: set[int] = set()

    def figures(point: Point, concurrency: int) -> Result:
        seen.add(point.instances)
        return Result(point, concurrency, 100.0 * point.instances, 900.0, 1000.0, None, 1.0, True, 0)

    monkeypatch.setattr(tune_run, "LocalTarget", StandInTarget)
    monkeypatch.setattr(tune_run, "Tuner", stand_in_tuner(figures))
    tune(TuneConfig(repository, Space(("mlp_fp32",), (8,), (0,), (2, 3)), Objective(), search=Search.EXHAUSTIVE,
                    concurrencies=[1], measurement_ms=300, default_variant="mlp_fp32",
                    report_path=tmp_path / "tune.json", plot_path=None, html_path=None, write=False, compare=False,
                    measure_built_instances=built))
    return seen


def test_a_grid_measures_the_built_instance_count_only_where_the_counts_were_not_named(
        repo_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The tiny repository's mlp_fp32 is built with 1 instance (ONNX Runtime on CPU), outside the space's 2,3.
    assert measured_instances(repo_copy, tmp_path, monkeypatch, built=True) == {1, 2, 3}
    assert measured_instances(repo_copy, tmp_path, monkeypatch, built=False) == {2, 3}


class Stop(Exception):
    pass


@pytest.mark.parametrize(("flags", "expected"), [([], ((1, 2), True)), (["--instances", "2"], ((2,), False))])
def test_the_cli_measures_the_built_count_unless_instances_are_given(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: list[str], expected: tuple[tuple[int, ...], bool]
) -> None:
    (tmp_path / "models.toml").write_text('[[model]]\nname = "mlp"\nonnx = "mlp.onnx"\nprecisions = ["fp32"]\n')
    (tmp_path / "repository" / "mlp_fp32").mkdir(parents=True)
    configs: list[TuneConfig] = []

    def capture(config: TuneConfig) -> None:
        configs.append(config)
        raise Stop

    monkeypatch.setattr(tune_run, "tune", capture)
    with pytest.raises(Stop):
        cli.main(["tune", "mlp", "--manifest", str(tmp_path / "models.toml"), "--repository",
                  str(tmp_path / "repository"), "--report", str(tmp_path / "t.json"), "--plot",
                  str(tmp_path / "t.png"), "--html", str(tmp_path / "t.html"), *flags])
    assert (configs[0].space.instances, configs[0].measure_built_instances) == expected
