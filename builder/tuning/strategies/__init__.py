"""Search strategies, one module each, chosen by name (`--search`) from this registry."""

from __future__ import annotations

from builder.tuning.strategies import grid, hill, tpe
from builder.tuning.strategies.base import Strategy
from common.choices import Choice


class Search(Choice):
    HILL = "hill"
    EXHAUSTIVE = "exhaustive"
    TPE = "tpe"  # optuna's Tree-structured Parzen Estimator: a fixed budget of points, seeded


STRATEGIES: dict[Search, Strategy] = {Search.HILL: hill.STRATEGY, Search.EXHAUSTIVE: grid.STRATEGY,
                                      Search.TPE: tpe.STRATEGY}


def strategy(search: Search) -> Strategy:
    return STRATEGIES[search]
