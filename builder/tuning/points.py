"""A point of the search space (one serving configuration), what measuring it gives, and the space."""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from builder.repository import tuned_serving

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Point:
    variant: str
    max_batch_size: int
    queue_delay_us: int | None  # None: dynamic batching off
    instances: int

    def label(self) -> str:
        batching = "off" if self.queue_delay_us is None else f"{self.queue_delay_us}us"
        return f"{self.variant} mbs={self.max_batch_size} batching={batching} inst={self.instances}"

    def sort_key(self) -> tuple[str, int, int, int]:
        return (self.variant, self.max_batch_size, delay_key(self.queue_delay_us), self.instances)


def delay_key(delay: int | None) -> int:
    return -1 if delay is None else delay  # "off" sorts before every delay


@dataclass(frozen=True)
class Result:
    point: Point
    concurrency: int
    throughput: float
    p50_us: float | None  # None: no request completed
    p99_us: float | None
    infer_per_joule: float | None
    avg_batch: float | None
    stable: bool
    errors: int

    @property
    def completed(self) -> bool:
        return self.p99_us is not None and self.throughput > 0


def worst_p99(results: Sequence[Result]) -> float:
    """The worst p99 over the concurrencies; infinite when one completed nothing."""
    return max((r.p99_us if r.p99_us is not None else math.inf for r in results), default=math.inf)


def mean_p99(results: Sequence[Result]) -> float:
    """The mean p99 over the concurrencies; infinite when one completed nothing."""
    values = [r.p99_us if r.p99_us is not None else math.inf for r in results]
    return sum(values) / len(values) if values else math.inf


def mean_throughput(results: Sequence[Result]) -> float:
    return sum(r.throughput for r in results) / len(results) if results else 0.0


def energy_note(results: Sequence[Result]) -> str | None:
    """"energy unknown" (at which concurrencies, when only some) for results without inferences per joule
    (a window whose energy read failed or did not advance); None when every one has its figure."""
    missing = [r.concurrency for r in results if r.infer_per_joule is None]
    if not missing:
        return None
    if len(missing) == len(results):
        return "energy unknown"
    return f"energy unknown at concurrency {', '.join(map(str, missing))}"

@dataclass(frozen=True)
class Space:
    variants: tuple[str, ...]
    max_batch_sizes: tuple[int, ...]
    queue_delays_us: tuple[int | None, ...]  # None: dynamic batching off
    instances: tuple[int, ...]

    def points(self) -> list[Point]:
        return [Point(*p) for p in itertools.product(self.variants, self.max_batch_sizes, self.queue_delays_us,
                                                        self.instances)]

    def including(self, point: Point) -> Space:
        """This space with the point's settings added to each axis (kept in order)."""
        return Space(self.variants, tuple(sorted(set(self.max_batch_sizes) | {point.max_batch_size})),
                     tuple(sorted(set(self.queue_delays_us) | {point.queue_delay_us}, key=delay_key)),
                     tuple(sorted(set(self.instances) | {point.instances})))

    def with_instances(self, count: int) -> Space:
        """This space with `count` among its instance counts (the as-built count: 4 per GPU for the python runner
        on CUDA, outside tune's default 1,2)."""
        return Space(self.variants, self.max_batch_sizes, self.queue_delays_us,
                     tuple(sorted(set(self.instances) | {count})))

    def bounded(self, limit: int) -> Space:
        """This space without the max batch sizes over `limit` (what the engine or its TensorRT profile
        takes); the limit itself stands in when every value was over it. A model built without batching
        (max_batch_size 0) has one setting: no batch dim, no dynamic batching."""
        if limit == 0:
            log.info("tune: the model does not batch (max_batch_size 0): only instances are searched")
            return replace(self, max_batch_sizes=(0,), queue_delays_us=(None,))
        kept = tuple(b for b in self.max_batch_sizes if b <= limit)
        dropped = sorted(set(self.max_batch_sizes) - set(kept))
        if dropped:
            log.info("tune: max batch %s left out: the engine takes batches of at most %d",
                     ", ".join(map(str, dropped)), limit)
        return replace(self, max_batch_sizes=kept or (limit,))

    def neighbours(self, point: Point) -> list[Point]:
        out = []
        axes: list[tuple[str, Sequence[Any]]] = [("variant", self.variants), ("max_batch_size", self.max_batch_sizes),
                                                 ("queue_delay_us", self.queue_delays_us),
                                                 ("instances", self.instances)]
        for name, values in axes:
            index = list(values).index(getattr(point, name))
            for step in (-1, 1):
                if 0 <= index + step < len(values):
                    out.append(replace(point, **{name: values[index + step]}))
        # max_batch_size and the queue delay act together (a larger batch with batching off, or batching
        # with a batch of 1, changes nothing), so also step both at once.
        b = list(self.max_batch_sizes).index(point.max_batch_size)
        d = list(self.queue_delays_us).index(point.queue_delay_us)
        for step in (-1, 1):
            if 0 <= b + step < len(self.max_batch_sizes) and 0 <= d + step < len(self.queue_delays_us):
                out.append(replace(point, max_batch_size=self.max_batch_sizes[b + step],
                                   queue_delay_us=self.queue_delays_us[d + step]))
        return out


Measure = Callable[[Point], list[Result]]

def serving(point: Point) -> tuned_serving.Serving:
    return tuned_serving.Serving(point.max_batch_size, point.queue_delay_us, point.instances)


def apply(config_text: str, point: Point) -> str:
    """The variant's config with the point's serving settings, through Triton's schema."""
    return tuned_serving.configure(config_text, serving(point))


def point_of(variant: str, config_text: str) -> Point:
    s = tuned_serving.serving_of(config_text)
    return Point(variant, s.max_batch_size, s.queue_delay_us, s.instances)
