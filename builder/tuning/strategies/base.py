"""The interface every search strategy implements (as Model Analyzer's run-config generators)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from builder.tuning.objective import Objective
from builder.tuning.points import Measure, Point, Result, Space


class SearchFn(Protocol):
    def __call__(self, space: Space, start: Point, measure: Measure, objective: Objective, *, trials: int,
                 seed: int) -> dict[Point, list[Result]]:
        """Measure points of `space` (through `measure`) and return every one measured."""
        ...


@dataclass(frozen=True)
class Strategy:
    search: SearchFn
    # The most points it measures (the progress bar's total); None: it cannot say before it ends.
    budget: Callable[[Space, int], int | None]
    starts_at_default: bool  # the builder's own settings are its first point (added to the space)
