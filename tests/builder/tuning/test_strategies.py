"""builder/tuning (issue 25): every --search name has a strategy in the registry, and the strategies and the
plot set no process-wide library option (optuna's verbosity, matplotlib's backend) as a side effect."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import optuna

from builder.tuning.objective import Objective
from builder.tuning.points import Point, Result, Space
from builder.tuning.strategies import STRATEGIES, Search, strategy

SPACE = Space(("m_fp32",), (1, 8), (None, 100), (1,))


def _measure(point: Point) -> list[Result]:
    throughput = 100.0 * point.max_batch_size
    return [Result(point, 4, throughput, 1000.0, 2000.0, None, None, True, 0)]


def test_every_search_name_has_a_strategy() -> None:
    assert set(STRATEGIES) == set(Search)
    for search in Search:
        assert strategy(search) is STRATEGIES[search]


def test_each_strategy_measures_points_of_the_space_within_its_budget() -> None:
    start = Point("m_fp32", 1, None, 1)
    for search in Search:
        chosen = strategy(search)
        measured = chosen.search(SPACE, start, _measure, Objective(), trials=3, seed=0)
        assert measured and set(measured) <= set(SPACE.points()), search
        budget = chosen.budget(SPACE, 3)
        assert budget is None or len(measured) <= budget, search


def test_tpe_leaves_optuna_s_verbosity_as_it_found_it() -> None:
    previous = optuna.logging.get_verbosity()
    try:
        optuna.logging.set_verbosity(optuna.logging.DEBUG)
        strategy(Search.TPE).search(SPACE, Point("m_fp32", 1, None, 1), _measure, Objective(), trials=2, seed=0)
        assert optuna.logging.get_verbosity() == optuna.logging.DEBUG
    finally:
        optuna.logging.set_verbosity(previous)


def test_the_plot_chooses_no_matplotlib_backend_and_imports_no_pyplot() -> None:
    # In a fresh interpreter: this one's matplotlib state is whatever earlier tests left.
    code = (
        "import sys\n"
        "from builder.tuning.plot import plot_png\n"
        "from builder.tuning.points import Point, Result\n"
        "p = Point('m_fp32', 8, 100, 1)\n"
        "png = plot_png({p: [Result(p, 4, 800.0, 1000.0, 2000.0, None, None, True, 0)]}, [p], p)\n"
        "import matplotlib\n"
        "assert png.startswith(b'\\x89PNG'), png[:8]\n"
        "assert 'matplotlib.pyplot' not in sys.modules\n"
        "print(matplotlib.rcParams._get_backend_or_none())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                          env=env, cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"  # no backend was chosen


def test_a_grid_space_gains_the_as_built_instance_count_and_keeps_every_other_axis() -> None:
    # The python runner on CUDA is built with 4 instances per GPU, outside tune's default --instances 1,2: an
    # exhaustive search (it does not start at the built point) measures 4 too, or it would write 1 or 2 over it.
    grown = Space(("m_fp16",), (8, 64), (None, 0), (1, 2)).with_instances(4)
    assert grown.instances == (1, 2, 4)
    assert (grown.variants, grown.max_batch_sizes, grown.queue_delays_us) == (("m_fp16",), (8, 64), (None, 0))
    assert len(grown.points()) == 12 and SPACE.with_instances(1) == SPACE
