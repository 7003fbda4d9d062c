"""Accuracy of a variant against the FP32 reference on held-out inputs, and the tolerance gate."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from builder.errors import AccuracyError
from builder.spec.enums import Task
from builder.spec.model import Tolerance


@dataclass(frozen=True)
class Metrics:
    """max_abs: largest absolute difference; max_rel: max_abs over the largest |reference| value
    (an element-wise ratio explodes near zero); cosine: per-sample cosine similarity of each output;
    top1_agreement: share of samples whose arg-max class matches (classifiers only, else None)."""

    max_abs: float
    max_rel: float
    cosine_min: float
    cosine_mean: float
    samples: int
    top1_agreement: float | None = None

    def damage(self) -> float:
        """One number for how far a variant is from FP32 (0 = identical)."""
        value = 1.0 - self.cosine_mean
        if self.top1_agreement is not None:
            value += 1.0 - self.top1_agreement
        return value

    def summary(self) -> str:
        top1 = "" if self.top1_agreement is None else f", top1_agreement={self.top1_agreement:.4g}"
        return (f"max_abs={self.max_abs:.4g}, max_rel={self.max_rel:.4g}, cosine_min={self.cosine_min:.4g}, "
                f"cosine_mean={self.cosine_mean:.4g}{top1}")


def compare(reference: Mapping[str, NDArray[Any]], candidate: Mapping[str, NDArray[Any]], task: Task) -> Metrics:
    if set(reference) != set(candidate):
        raise AccuracyError(f"outputs differ: reference {sorted(reference)}, variant {sorted(candidate)}")
    max_abs = 0.0
    max_ref = 0.0
    cosines: list[NDArray[Any]] = []
    for name, ref in reference.items():
        ref64 = np.asarray(ref, dtype=np.float64)
        cand64 = np.asarray(candidate[name], dtype=np.float64)
        if ref64.shape != cand64.shape and ref64.ndim == cand64.ndim and ref64.shape[:1] == cand64.shape[:1]:
            # A size the data decides (TTS audio) that the variant decided otherwise: both padded with zeros to
            # the larger, so the samples differ where the lengths do (runtimes.base.join pads within one run).
            common = [max(a, b) for a, b in zip(ref64.shape, cand64.shape, strict=True)]
            ref64 = np.pad(ref64, [(0, c - s) for s, c in zip(ref64.shape, common, strict=True)])
            cand64 = np.pad(cand64, [(0, c - s) for s, c in zip(cand64.shape, common, strict=True)])
        if ref64.shape != cand64.shape:
            raise AccuracyError(f"output {name!r}: shape {list(cand64.shape)}, reference {list(ref64.shape)}")
        max_abs = max(max_abs, float(np.max(np.abs(ref64 - cand64))) if ref64.size else 0.0)
        max_ref = max(max_ref, float(np.max(np.abs(ref64))) if ref64.size else 0.0)
        a = ref64.reshape(len(ref64), -1)
        b = cand64.reshape(len(cand64), -1)
        norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
        cosines.append(np.where(norms > 0, np.sum(a * b, axis=1) / np.maximum(norms, 1e-30), 1.0))
    cos = np.concatenate(cosines) if cosines else np.ones(1)
    top1 = None
    if task is Task.CLASSIFICATION:
        first = next(iter(reference))
        ref_top = np.argmax(reference[first].reshape(len(reference[first]), -1), axis=1)
        cand_top = np.argmax(candidate[first].reshape(len(candidate[first]), -1), axis=1)
        top1 = float(np.mean(ref_top == cand_top))
    return Metrics(
        max_abs=max_abs,
        max_rel=max_abs / max_ref if max_ref > 0 else 0.0,
        cosine_min=float(np.min(cos)),
        cosine_mean=float(np.mean(cos)),
        samples=len(next(iter(reference.values()))),
        top1_agreement=top1,
    )


def combine(parts: list[Metrics]) -> Metrics:
    """One set of figures over several sample sets (e.g. the min, opt and max shapes, which cannot share
    one array): the worst max_abs, max_rel and cosine_min, the sample-weighted means."""
    if len(parts) == 1:
        return parts[0]
    total = sum(p.samples for p in parts)
    top1 = [p for p in parts if p.top1_agreement is not None]
    return Metrics(
        max_abs=max(p.max_abs for p in parts),
        max_rel=max(p.max_rel for p in parts),
        cosine_min=min(p.cosine_min for p in parts),
        cosine_mean=sum(p.cosine_mean * p.samples for p in parts) / total,
        samples=total,
        top1_agreement=(sum(p.top1_agreement * p.samples for p in top1 if p.top1_agreement is not None)
                        / sum(p.samples for p in top1)) if len(top1) == len(parts) else None,
    )


@dataclass(frozen=True)
class Violation:
    """A metric out of bounds: which one, its value, the tolerance key and its limit."""

    metric: str
    value: float | None  # None: the task does not give this metric
    key: str
    limit: float
    upper: bool  # the limit is a maximum

    def text(self) -> str:
        if self.value is None:
            return f"tolerance {self.key} needs metric {self.metric}, which this task does not give"
        relation = "above the limit" if self.upper else "below the limit"
        return f"{self.metric} = {self.value:.6g} is {relation} {self.key} = {self.limit:g}"


def first_violation(metrics: Metrics, tolerance: Tolerance) -> Violation | None:
    """The first metric out of bounds; None when all are within."""
    limits: list[tuple[str, float | None, str, float | None, bool]] = [
        ("max_abs", metrics.max_abs, "max_abs", tolerance.max_abs, True),
        ("max_rel", metrics.max_rel, "max_rel", tolerance.max_rel, True),
        ("cosine_min", metrics.cosine_min, "cosine_min", tolerance.cosine_min, False),
        ("cosine_mean", metrics.cosine_mean, "cosine_mean_min", tolerance.cosine_mean_min, False),
        ("top1_agreement", metrics.top1_agreement, "top1_agreement_min", tolerance.top1_agreement_min, False),
    ]
    for metric, value, key, limit, upper in limits:
        if limit is None:
            continue
        if value is None or (upper and value > limit) or (not upper and value < limit):
            return Violation(metric, value, key, limit, upper)
    return None


def violation(metrics: Metrics, tolerance: Tolerance, variant: str) -> str | None:
    """The first metric out of bounds, named with its value and limit; None when all are within."""
    found = first_violation(metrics, tolerance)
    return None if found is None else f"{variant}: {found.text()}"


def check(metrics: Metrics, tolerance: Tolerance, variant: str) -> None:
    """Raise naming the variant, the metric, the value and the limit for the first metric out of bounds."""
    found = first_violation(metrics, tolerance)
    if found is not None:
        raise AccuracyError(f"{variant}: {found.text()}", violation=found)
