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
    detection_agreement: float | None = None  # detectors only (Task.DETECTION): see detection_agreement()

    def damage(self) -> float:
        """One number for how far a variant is from FP32 (0 = identical). A detector's: its detections that
        do not agree (the element-wise cosine of rows that reorder means little there), with the cosine as a
        small tie-breaker (agreement moves in steps, and most single-node changes leave it where it was)."""
        if self.detection_agreement is not None:
            return 1.0 - self.detection_agreement + 1e-3 * (1.0 - self.cosine_mean)
        value = 1.0 - self.cosine_mean
        if self.top1_agreement is not None:
            value += 1.0 - self.top1_agreement
        return value

    def summary(self) -> str:
        top1 = "" if self.top1_agreement is None else f", top1_agreement={self.top1_agreement:.4g}"
        det = "" if self.detection_agreement is None else f", detection_agreement={self.detection_agreement:.4g}"
        return (f"max_abs={self.max_abs:.4g}, max_rel={self.max_rel:.4g}, cosine_min={self.cosine_min:.4g}, "
                f"cosine_mean={self.cosine_mean:.4g}{top1}{det}")


# Detections (Task.DETECTION): rows x1, y1, x2, y2, score, class. A detection counts from this score; its match on
# the other side needs a score of DETECTION_SCORE - SCORE_SLACK or more (a box scoring 0.251 in FP32 and 0.249 in
# FP16 is the same box), the same class and an IoU of MATCH_IOU.
DETECTION_SCORE = 0.25
SCORE_SLACK = 0.05
MATCH_IOU = 0.5
# Columns a detection row may have: 6 (x1, y1, x2, y2, score, class), more where a model appends keypoints or mask
# coefficients. A raw head ([batch, 84, 8400]: boxes and class scores per anchor, before NMS) is not detections.
MAX_DETECTION_COLUMNS = 64


def _area(boxes: NDArray[Any]) -> NDArray[Any]:
    return np.asarray(np.clip(boxes[..., 2] - boxes[..., 0], 0, None) * np.clip(boxes[..., 3] - boxes[..., 1], 0, None))


def _iou(box: NDArray[Any], boxes: NDArray[Any]) -> NDArray[Any]:
    x1, y1 = np.maximum(box[0], boxes[:, 0]), np.maximum(box[1], boxes[:, 1])
    x2, y2 = np.minimum(box[2], boxes[:, 2]), np.minimum(box[3], boxes[:, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    union = _area(box) + _area(boxes) - inter
    return np.where(union > 0, inter / np.maximum(union, 1e-30), 0.0)


def _matched(found: NDArray[Any], others: NDArray[Any]) -> int:
    """How many of `found` (scoring DETECTION_SCORE or more) have a partner among `others` (scoring at least
    DETECTION_SCORE - SCORE_SLACK), each partner used once, the highest-scoring detections matched first."""
    mine = found[found[:, 4] >= DETECTION_SCORE]
    pool = others[others[:, 4] >= DETECTION_SCORE - SCORE_SLACK]
    free = np.ones(len(pool), dtype=bool)
    count = 0
    for row in mine[np.argsort(-mine[:, 4], kind="stable")]:
        candidates = free & (np.rint(pool[:, 5]) == np.rint(row[5]))  # a class id, whatever float carries it
        if not candidates.any():
            continue
        overlap = np.where(candidates, _iou(row, pool), -1.0)
        best = int(np.argmax(overlap))
        if overlap[best] >= MATCH_IOU:
            free[best] = False
            count += 1
    return count


def detection_agreement(reference: NDArray[Any], candidate: NDArray[Any]) -> float:
    """The share of detections (either side's, scoring DETECTION_SCORE or more) that have a match on the other
    side, pooled over the samples (a sample with nothing detected adds nothing, rather than a perfect score).
    1.0 where neither side detects anything on any sample: reference_detections() says whether it did."""
    matched = total = 0
    for ref, cand in zip(reference, candidate, strict=True):
        a = np.asarray(ref, dtype=np.float64).reshape(-1, ref.shape[-1])
        b = np.asarray(cand, dtype=np.float64).reshape(-1, cand.shape[-1])
        total += int(np.sum(a[:, 4] >= DETECTION_SCORE) + np.sum(b[:, 4] >= DETECTION_SCORE))
        matched += _matched(a, b) + _matched(b, a)
    return matched / total if total else 1.0


def reference_detections(reference: NDArray[Any]) -> int:
    """How many detections the reference makes (scoring DETECTION_SCORE or more) over all samples."""
    rows = np.asarray(reference, dtype=np.float64).reshape(-1, reference.shape[-1])
    return int(np.sum(rows[:, 4] >= DETECTION_SCORE))


def _check_boxes(name: str, reference: NDArray[Any]) -> None:
    """Rows that are not x1, y1, x2, y2, score, class (xywh boxes, another column order) would give an
    agreement of nonsense: most scored boxes with x2 < x1 or y2 < y1 say so, in one line."""
    rows = np.asarray(reference, dtype=np.float64).reshape(-1, reference.shape[-1])
    scored = rows[rows[:, 4] >= DETECTION_SCORE]
    if len(scored) and np.mean((scored[:, 2] < scored[:, 0]) | (scored[:, 3] < scored[:, 1])) > 0.5:
        raise AccuracyError(f"task detection: output {name!r}: most scored rows have x2 < x1 or y2 < y1; expected "
                            "rows of x1, y1, x2, y2, score, class (not x, y, w, h or another order)")


def detection_output(outputs: Mapping[str, NDArray[Any]]) -> str:
    """The output holding the detections: the first of rank 3 or more (samples, [1,] K, 6 to
    MAX_DETECTION_COLUMNS; a model without a batch axis stacks as [samples, 1, K, 6]) whose rows are
    x1, y1, x2, y2, score, class."""
    for name, value in outputs.items():
        if value.ndim >= 3 and 6 <= value.shape[-1] <= MAX_DETECTION_COLUMNS and value.shape[-2] >= value.shape[-1]:
            return name
    shapes = ", ".join(f"{n} {list(v.shape)}" for n, v in outputs.items())
    raise AccuracyError(f"task detection: no output of shape [batch, K, 6+] (x1, y1, x2, y2, score, class) among "
                        f"{shapes}; expected a detector with its NMS (or NMS-free top-K) in the graph")


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
    detections = None
    if task is Task.DETECTION:
        name = detection_output(reference)
        _check_boxes(name, reference[name])
        detections = detection_agreement(reference[name], candidate[name])
    return Metrics(
        max_abs=max_abs,
        max_rel=max_abs / max_ref if max_ref > 0 else 0.0,
        cosine_min=float(np.min(cos)),
        cosine_mean=float(np.mean(cos)),
        samples=len(next(iter(reference.values()))),
        top1_agreement=top1,
        detection_agreement=detections,
    )


def combine(parts: list[Metrics]) -> Metrics:
    """One set of figures over several sample sets (e.g. the min, opt and max shapes, which cannot share
    one array): the worst max_abs, max_rel and cosine_min, the sample-weighted means."""
    if len(parts) == 1:
        return parts[0]
    total = sum(p.samples for p in parts)
    top1 = [p for p in parts if p.top1_agreement is not None]
    detections = [p for p in parts if p.detection_agreement is not None]
    return Metrics(
        max_abs=max(p.max_abs for p in parts),
        max_rel=max(p.max_rel for p in parts),
        cosine_min=min(p.cosine_min for p in parts),
        cosine_mean=sum(p.cosine_mean * p.samples for p in parts) / total,
        samples=total,
        top1_agreement=(sum(p.top1_agreement * p.samples for p in top1 if p.top1_agreement is not None)
                        / sum(p.samples for p in top1)) if len(top1) == len(parts) else None,
        detection_agreement=(sum(p.detection_agreement * p.samples for p in detections
                                 if p.detection_agreement is not None)
                             / sum(p.samples for p in detections)) if len(detections) == len(parts) else None,
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
        ("detection_agreement", metrics.detection_agreement, "detection_agreement_min",
         tolerance.detection_agreement_min, False),
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
