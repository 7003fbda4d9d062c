"""Hill climbing from the builder's own settings: to the best neighbour while one improves."""

from __future__ import annotations

from builder.tuning.objective import Objective
from builder.tuning.points import Measure, Point, Result, Space
from builder.tuning.strategies.base import Strategy


def hill_climb(space: Space, start: Point, measure: Measure, objective: Objective) -> dict[Point, list[Result]]:
    measured: dict[Point, list[Result]] = {start: measure(start)}
    current = start
    while True:
        for point in space.neighbours(current):
            if point not in measured:
                measured[point] = measure(point)
        best_step = max(space.neighbours(current), key=lambda p: objective.rank(measured[p]), default=current)
        if objective.rank(measured[best_step]) <= objective.rank(measured[current]):
            return measured
        current = best_step



def _search(space: Space, start: Point, measure: Measure, objective: Objective, *, trials: int,
            seed: int) -> dict[Point, list[Result]]:
    return hill_climb(space, start, measure, objective)


STRATEGY = Strategy(search=_search, budget=lambda space, trials: None, starts_at_default=True)
