"""A time budget for an accuracy guard's search: past it, the guard stops and reports no mix found within it.

Each candidate costs a conversion or a quantization and an evaluation (a 1280x1280 detector: about 20 s each on
2 cores), and a model whose error no small set of nodes explains tries dozens of them; without a bound one guard
ran past ten minutes to serve the FP32 graph in the end."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

DEFAULT_GUARD_BUDGET_S = 300.0


def _now() -> float:
    return time.perf_counter()  # looked up at each call (a test stands a clock in for the module's `time`)


class BudgetSpent(Exception):
    """Raised by Budget.check once the budget is spent; the guard catches it (never a user-facing error)."""


@dataclass
class Budget:
    seconds: float | None  # None: no bound
    started: float = field(default_factory=_now)
    spent: bool = False

    def check(self) -> None:
        """Before a candidate: raise BudgetSpent when the budget is spent."""
        if self.seconds is not None and _now() - self.started > self.seconds:
            self.spent = True
            raise BudgetSpent(f"the guard's budget of {self.seconds:g} s is spent")
