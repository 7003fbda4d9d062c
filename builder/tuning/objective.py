"""What a tuning run maximizes: the goal, its constraints, and the picks made from measured points."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from builder.tuning.points import Point, Result, mean_p99, mean_throughput, worst_p99
from common.choices import Choice


class Goal(Choice):
    THROUGHPUT = "throughput"
    P99 = "p99"
    INFER_PER_JOULE = "infer_per_joule"

@dataclass(frozen=True)
class Objective:
    goal: Goal = Goal.THROUGHPUT
    p99_budget_us: float | None = None
    min_throughput: float | None = None

    def feasible(self, results: Sequence[Result]) -> bool:
        return bool(results) and all(
            r.completed and r.errors == 0
            and (self.p99_budget_us is None or (r.p99_us is not None and r.p99_us <= self.p99_budget_us))
            and (self.min_throughput is None or r.throughput >= self.min_throughput)
            for r in results
        )

    def value(self, results: Sequence[Result]) -> float:
        """Higher is better; the mean over the measured concurrencies. Inferences per joule: the mean over
        the concurrencies whose energy is known (energy_note says which are not), -inf when none is: such a
        point ranks below every point with a figure, never aborts the run."""
        if self.goal is Goal.THROUGHPUT:
            return mean_throughput(results)
        if self.goal is Goal.P99:
            return -mean_p99(results)
        per_joule = [r.infer_per_joule for r in results if r.infer_per_joule is not None]
        return sum(per_joule) / len(per_joule) if per_joule else -math.inf

    def rank(self, results: Sequence[Result]) -> tuple[int, float]:
        """Feasible points first, then by value; infeasible ones by how far p99 is over budget."""
        if self.feasible(results):
            return (1, self.value(results))
        return (0, -worst_p99(results))

def score(objective: Objective, results: Sequence[Result]) -> float:
    """One number for a sampler to maximize: a feasible point's value, else far below every feasible
    one and ordered by how far p99 is over (a point that completed nothing lowest)."""
    feasible, value = objective.rank(results)
    if feasible:
        return value if math.isfinite(value) else -1e14  # energy unknown: below every figure, above infeasible
    over = -value  # the worst p99 in µs, infinite when a concurrency completed nothing
    return -1e15 - (min(over, 1e12) if math.isfinite(over) else 1e12)

def best(measured: dict[Point, list[Result]], objective: Objective) -> Point | None:
    feasible = [p for p, r in measured.items() if objective.feasible(r)]
    # Ties (points whose energy is unknown) go to the higher throughput.
    return (max(feasible, key=lambda p: (objective.value(measured[p]), mean_throughput(measured[p]))) if feasible
            else None)


def pareto(measured: dict[Point, list[Result]]) -> list[Point]:
    """Points no other point beats on both mean throughput and worst p99 (points that completed nothing
    are on no front)."""
    stats = {p: (mean_throughput(rs), worst_p99(rs)) for p, rs in measured.items() if math.isfinite(worst_p99(rs))}
    front = [p for p, (t, lat) in stats.items()
             if not any(t2 >= t and l2 <= lat and (t2, l2) != (t, lat) for t2, l2 in stats.values())]
    return sorted(front, key=Point.sort_key)
