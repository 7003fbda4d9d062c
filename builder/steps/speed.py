"""Is a variant worth serving: its in-process throughput at the opt shape (ONNX Runtime on this CPU, the
intra-op threads the served runner uses) and its size, against FP32's.

A quantized variant is not automatically faster (ONNX Runtime runs many Q/DQ placements unfused: DESIGN.md),
nor smaller (tiny models carry scales and zero points). Measured in short rounds that alternate with FP32's,
compared by their medians; "slower" only where every round of the variant is below every round of FP32 (the
spread of the rounds is the measurement's noise). The variant stays built and gated either way.
"""

from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from builder.runtimes.base import feeds as sample_feeds
from builder.spec.enums import Precision
from builder.spec.model import TensorSpec
from builder.spec.shapes import Level, ModelShapes, ValueRange
from builder.steps import samples

log = logging.getLogger(__name__)

# Set (to anything but "" or "0") to skip the measurement: build.json then records no speed.
SKIP_ENV = "TRTBUILD_NO_SPEED"
ROUNDS = 3
ROUND_SECONDS = 0.15  # each round (3 runs at least, up to 1 s: runtimes.onnxruntime); FP32's rounds beside

# (models, feed, batch, threads, rounds, seconds) → each model's inferences per second per round; the build's
# options choose it (ONNX Runtime's runtimes.onnxruntime.ort_rounds by default).
Meter = Callable[..., list[list[float]]]


def skipped() -> bool:
    return os.environ.get(SKIP_ENV, "") not in ("", "0")


@dataclass(frozen=True)
class Speed:
    """What build.json and the build report record of a variant's speed and size against FP32."""

    throughput: float | None  # inferences/s at the opt shape: the median of its rounds (None: not measured)
    rounds: list[float]
    fp32_throughput: float | None  # FP32's median in rounds alternating with these (None: FP32 itself)
    fp32_rounds: list[float] | None
    ratio: float | None  # throughput / fp32_throughput
    batch: int  # inferences per run (the opt batch; 1 for a model that does not batch)
    threads: int  # ONNX Runtime intra-op threads (0: its default, as served)
    size_bytes: int
    fp32_size_bytes: int
    worth_serving: bool
    reason: str | None  # why not: "int8 0.43x FP32's throughput, 6.8 MB vs 6.7 MB"


def _size(size: int) -> str:
    return f"{size / 1e6:.1f} MB" if size >= 1e6 else f"{size / 1e3:.1f} kB"


def verdict(precision: Precision, rounds: Sequence[float], fp32_rounds: Sequence[float] | None, size: int,
            fp32_size: int) -> tuple[bool, str | None]:
    """Not worth serving: an FP16 or INT8 variant slower than FP32 beyond the rounds' spread (its median below
    FP32's and its best round below FP32's worst), or larger than FP32."""
    if precision is Precision.FP32 or not fp32_rounds:
        return True, None
    ratio = statistics.median(rounds) / statistics.median(fp32_rounds)
    slower = ratio < 1 and max(rounds) < min(fp32_rounds)
    larger = size > fp32_size
    if not (slower or larger):
        return True, None
    return False, f"{precision.value} {ratio:.2f}x FP32's throughput, {_size(size)} vs {_size(fp32_size)}"


def unmeasured(batch: int, threads: int, size: int, fp32_size: int, reason: str) -> Speed:
    """Not worth serving whatever a measurement would say (FP32's graph under a variant's name): no measurement
    is made for it."""
    return Speed(throughput=None, rounds=[], fp32_throughput=None, fp32_rounds=None, ratio=None, batch=batch,
                 threads=threads, size_bytes=size, fp32_size_bytes=fp32_size, worth_serving=False, reason=reason)


def opt_batch(shapes: ModelShapes) -> int:
    """The inferences one run at the opt shape makes: the opt batch of a batching model, else 1."""
    return shapes.batch.opt if shapes.batch is not None and shapes.batching else 1


def opt_feed(inputs: tuple[TensorSpec, ...], shapes: ModelShapes, value_ranges: Mapping[str, ValueRange],
             real: Mapping[str, NDArray[Any]] | None = None) -> tuple[dict[str, NDArray[Any]], int]:
    """One run's feed at the opt shape (the opt batch for a batching model) and the inferences it makes.

    `real`: the held-out samples. Where every input's samples have the opt shape, the feed is made of them
    (rows repeated up to the opt batch): a graph's speed can depend on its values (a detector's NMS). Elsewhere
    the feed is synthetic, its integer inputs with no declared range drawn from the values the samples hold
    (0s and 1s would send a model that branches on an integer input, a VAD's sample rate, down a branch it
    never takes, or one that fails: silero VAD's speed went unrecorded so)."""
    batch = shapes.batch.opt if shapes.batch is not None else 1
    count = batch if shapes.batching else 1
    given = real or {}
    fits = all(t.name in given and len(given[t.name])
               and given[t.name].shape[1:] == shapes.sample_range(t.name).at(Level.OPT) for t in inputs)
    if fits:
        found = {t.name: np.ascontiguousarray(given[t.name][np.arange(count) % len(given[t.name])])
                 for t in inputs}
    else:
        found = samples.synthetic(inputs, shapes, count, seed=5, level=Level.OPT, value_ranges=value_ranges,
                                  integers=True)
        found = samples.integers_seen(found, real, value_ranges, seed=5)
    if shapes.batching:
        return found, batch
    return next(sample_feeds(found, None)), 1


def measure(precision: Precision, variant: Path, fp32: Path, feed: Mapping[str, NDArray[Any]], *, batch: int,
            threads: int, size: int, fp32_size: int, meter: Meter, rounds: int = ROUNDS,
            seconds: float = ROUND_SECONDS) -> Speed:
    """The variant's throughput (and FP32's, in alternating rounds, for an FP16 or INT8 variant) and verdict."""
    paths = [variant] if precision is Precision.FP32 else [variant, fp32]
    figures = meter(paths, feed, batch=batch, threads=threads, rounds=rounds, seconds=seconds)
    mine = [round(f, 2) for f in figures[0]]
    theirs = [round(f, 2) for f in figures[1]] if len(figures) > 1 else None
    worth, reason = verdict(precision, mine, theirs, size, fp32_size)
    median = statistics.median(mine)
    fp32_median = statistics.median(theirs) if theirs else None
    return Speed(throughput=round(median, 2), rounds=mine, fp32_throughput=fp32_median, fp32_rounds=theirs,
                 ratio=round(median / fp32_median, 3) if fp32_median else None, batch=batch, threads=threads,
                 size_bytes=size, fp32_size_bytes=fp32_size, worth_serving=worth, reason=reason)
