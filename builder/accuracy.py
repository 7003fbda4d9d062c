"""Accuracy of a variant against the FP32 reference on held-out inputs, and the tolerance gate."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from builder.errors import AccuracyError
from builder.manifest import Tolerance

Metrics = dict[str, float]


def compare(reference: Mapping[str, NDArray[Any]], candidate: Mapping[str, NDArray[Any]], task: str) -> Metrics:
    """max_abs: largest absolute difference; max_rel: max_abs over the largest |reference| value
    (an element-wise ratio explodes near zero); cosine: per-sample cosine similarity of each output;
    top1_agreement: share of samples whose arg-max class matches (classifiers)."""
    if set(reference) != set(candidate):
        raise AccuracyError(f"outputs differ: reference {sorted(reference)}, variant {sorted(candidate)}")
    max_abs = 0.0
    max_ref = 0.0
    cosines: list[NDArray[Any]] = []
    for name, ref in reference.items():
        ref64 = np.asarray(ref, dtype=np.float64)
        cand64 = np.asarray(candidate[name], dtype=np.float64)
        if ref64.shape != cand64.shape:
            raise AccuracyError(f"output {name!r}: shape {list(cand64.shape)}, reference {list(ref64.shape)}")
        max_abs = max(max_abs, float(np.max(np.abs(ref64 - cand64))) if ref64.size else 0.0)
        max_ref = max(max_ref, float(np.max(np.abs(ref64))) if ref64.size else 0.0)
        a = ref64.reshape(len(ref64), -1)
        b = cand64.reshape(len(cand64), -1)
        norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
        cosines.append(np.where(norms > 0, np.sum(a * b, axis=1) / np.maximum(norms, 1e-30), 1.0))
    cos = np.concatenate(cosines) if cosines else np.ones(1)
    metrics: Metrics = {
        "max_abs": max_abs,
        "max_rel": max_abs / max_ref if max_ref > 0 else 0.0,
        "cosine_min": float(np.min(cos)),
        "cosine_mean": float(np.mean(cos)),
        "samples": float(len(next(iter(reference.values())))),
    }
    if task == "classification":
        first = next(iter(reference))
        ref_top = np.argmax(reference[first].reshape(len(reference[first]), -1), axis=1)
        cand_top = np.argmax(candidate[first].reshape(len(candidate[first]), -1), axis=1)
        metrics["top1_agreement"] = float(np.mean(ref_top == cand_top))
    return metrics


def check(metrics: Metrics, tolerance: Tolerance, variant: str) -> None:
    """Raise naming the variant, the metric, the value and the limit for the first metric out of bounds."""
    limits: list[tuple[str, str, float | None, bool]] = [
        ("max_abs", "max_abs", tolerance.max_abs, True),
        ("max_rel", "max_rel", tolerance.max_rel, True),
        ("cosine_min", "cosine_min", tolerance.cosine_min, False),
        ("cosine_mean", "cosine_mean_min", tolerance.cosine_mean_min, False),
        ("top1_agreement", "top1_agreement_min", tolerance.top1_agreement_min, False),
    ]
    for metric, key, limit, upper in limits:
        if limit is None:
            continue
        if metric not in metrics:
            raise AccuracyError(f"{variant}: tolerance {key} needs metric {metric}, which this task does not give")
        value = metrics[metric]
        if (upper and value > limit) or (not upper and value < limit):
            relation = "above the limit" if upper else "below the limit"
            raise AccuracyError(f"{variant}: {metric} = {value:.6g} is {relation} {key} = {limit:g}")
