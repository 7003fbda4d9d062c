"""Exhaustive search: every point of the space."""

from __future__ import annotations

from builder.tuning.objective import Objective
from builder.tuning.points import Measure, Point, Result, Space
from builder.tuning.strategies.base import Strategy


def exhaustive(space: Space, measure: Measure) -> dict[Point, list[Result]]:
    return {point: measure(point) for point in space.points()}


def _search(space: Space, start: Point, measure: Measure, objective: Objective, *, trials: int,
            seed: int) -> dict[Point, list[Result]]:
    return exhaustive(space, measure)


STRATEGY = Strategy(search=_search, budget=lambda space, trials: len(space.points()), starts_at_default=False)
