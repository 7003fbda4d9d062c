"""`trtbuild tune` on models whose config.pbtxt leaves dims free: its requests take the build's opt shapes
(build.json), for a batching model with dynamic H/W and for one built with max_batch_size 0."""

from __future__ import annotations

from pathlib import Path

import pytest

from builder.cli import main
from builder.repository.model_folder import load_shapes
from builder.tuning.objective import Goal, Objective
from builder.tuning.points import Space
from builder.tuning.run import TuneConfig, tune
from builder.tuning.strategies import Search
from tests.helpers.foreign_models import ForeignModel, detector, stateful


@pytest.mark.parametrize(("make", "expected"), [
    (stateful, {"input": (1, 512)}),  # max_batch_size 0: whole shapes (state and sr are fixed)
    (detector, {"images": (3, 96, 96)}),  # batching: without the batch axis
])
@pytest.mark.server
def test_tune_measures_a_model_with_free_dims_at_its_opt_shapes(
        make: type, expected: dict[str, tuple[int, ...]], tmp_path: Path) -> None:
    model: ForeignModel = make(tmp_path)
    repository = tmp_path / "repository"
    code = main(["build", "-q", "--onnx", str(model.onnx), "--name", model.name, "--precision", "fp32",
                 "--calibration", str(model.calibration), "--repository", str(repository),
                 "--log", str(tmp_path / "build.log"), *model.flags])
    assert code == 0
    variant = f"{model.name}_fp32"
    assert load_shapes(repository / variant) == expected
    space = Space((variant,), (1, 4), (None,), (1,))
    report = tune(TuneConfig(repository, space, Objective(Goal.THROUGHPUT), search=Search.EXHAUSTIVE, concurrencies=[2],
                  measurement_ms=300, default_variant=variant, report_path=None, plot_path=None, max_trials=2,
                  compare=False, write=False))
    assert report.failed == 0 and report.winner is not None
    assert all(entry.throughput > 0 for entry in report.points)
    # A model that cannot batch is measured at max_batch_size 0 only; the detector at its batch sizes.
    assert {entry.point.max_batch_size for entry in report.points} == ({1, 4} if model.batching else {0})
