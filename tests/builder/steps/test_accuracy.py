import numpy as np
import pytest

from builder.errors import AccuracyError
from builder.spec import Task, Tolerance
from builder.steps.accuracy import Metrics, check, compare


def test_metrics_on_known_values() -> None:
    ref = {"y": np.array([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]], np.float32)}
    cand = {"y": np.array([[1.0, 0.5, 0.0], [0.0, 2.0, 0.0]], np.float32)}
    m = compare(ref, cand, Task.CLASSIFICATION)
    assert m.max_abs == pytest.approx(0.5)
    assert m.max_rel == pytest.approx(0.25)
    assert m.cosine_min == pytest.approx(1 / np.sqrt(1.25), rel=1e-6)
    assert m.samples == 2 and m.top1_agreement == 1.0
    cand["y"][0] = [0.0, 3.0, 0.0]
    assert compare(ref, cand, Task.CLASSIFICATION).top1_agreement == 0.5
    assert compare(ref, cand, Task.EMBEDDING).top1_agreement is None  # not a classifier: not measured


def test_damage_is_zero_only_for_identical_outputs() -> None:
    same = Metrics(0.0, 0.0, 1.0, 1.0, 4, top1_agreement=1.0)
    assert same.damage() == 0.0
    assert Metrics(0.1, 0.1, 0.9, 0.95, 4, top1_agreement=0.5).damage() == pytest.approx(0.55)
    assert Metrics(0.1, 0.1, 0.9, 0.95, 4).damage() == pytest.approx(0.05)


def test_check_names_variant_metric_value_and_limit() -> None:
    metrics = Metrics(max_abs=0.2, max_rel=0.1, cosine_min=0.9, cosine_mean=0.95, samples=8, top1_agreement=0.7)
    check(metrics, Tolerance(max_abs=0.3, cosine_min=0.85), "m_int8")
    below = r"m_int8: top1_agreement = 0.7 is below the limit top1_agreement_min = 0.8"
    with pytest.raises(AccuracyError, match=below):
        check(metrics, Tolerance(top1_agreement_min=0.8), "m_int8")
    with pytest.raises(AccuracyError, match=r"m_fp16: max_abs = 0.2 is above the limit max_abs = 0.1"):
        check(metrics, Tolerance(max_abs=0.1), "m_fp16")
    embedding = Metrics(max_abs=0.0, max_rel=0.0, cosine_min=1.0, cosine_mean=1.0, samples=8)
    with pytest.raises(AccuracyError, match="needs metric top1_agreement"):
        check(embedding, Tolerance(top1_agreement_min=0.5), "emb_int8")


def test_outputs_whose_length_the_data_decides_are_compared_padded_where_the_lengths_differ() -> None:
    # A TTS variant that returns one frame more than FP32 for a sample: scored, not an AccuracyError.
    reference = {"audio": np.array([[1.0, 2.0, 3.0, 0.0], [1.0, 1.0, 0.0, 0.0]])}
    longer = {"audio": np.array([[1.0, 2.0, 3.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0, 0.0]])}
    found = compare(reference, longer, Task.EMBEDDING)
    assert found.max_abs == 1.0 and found.cosine_min < 0.9 and found.cosine_mean < 1.0
    same = compare(reference, {"audio": np.pad(reference["audio"], [(0, 0), (0, 2)])}, Task.EMBEDDING)
    assert same.max_abs == 0.0 and same.cosine_min == pytest.approx(1.0)
    with pytest.raises(AccuracyError, match="output 'audio': shape"):
        compare(reference, {"audio": np.ones((3, 4))}, Task.EMBEDDING)  # another sample count


# Detectors (Task.DETECTION): rows x1, y1, x2, y2, score, class, their order and count the model's.

def _dets(*rows: tuple[float, ...], k: int = 6) -> np.ndarray:
    """One sample's [K, 6] detections, padded with zero-score rows as a top-K output is."""
    out = np.zeros((k, 6), np.float32)
    if rows:
        out[: len(rows)] = rows
    return out


def test_detections_that_reorder_agree_though_their_cosine_does_not() -> None:
    """Two boxes whose scores swap order in FP16 (0.801 vs 0.799): the rows swap, the element-wise cosine drops,
    and every detection still has its match."""
    a, b = (10, 10, 50, 50, 0.801, 3), (100, 100, 160, 140, 0.799, 7)
    ref = np.stack([_dets(a, b)])
    cand = np.stack([_dets((b[0] + 0.4, *b[1:4], 0.802, 7), (a[0], a[1] - 0.3, *a[2:4], 0.798, 3))])
    metrics = compare({"det": ref}, {"det": cand}, Task.DETECTION)
    assert metrics.detection_agreement == 1.0
    assert metrics.cosine_min < 0.9  # what the default tolerance of another task would have judged by
    check(metrics, Tolerance(detection_agreement_min=0.97), "m_fp16")


def test_a_missed_box_a_changed_class_and_a_score_at_the_threshold() -> None:
    a, b = (10, 10, 50, 50, 0.9, 3), (100, 100, 160, 140, 0.6, 7)
    ref = np.stack([_dets(a, b)])
    # b missed: 2 of 3 detections (a on both sides) have a match.
    assert compare({"d": ref}, {"d": np.stack([_dets(a)])}, Task.DETECTION).detection_agreement == pytest.approx(2 / 3)
    # b's class changed: no match for either b.
    moved = np.stack([_dets(a, (*b[:5], 8))])
    assert compare({"d": ref}, {"d": moved}, Task.DETECTION).detection_agreement == pytest.approx(0.5)
    # A box scoring 0.26 in FP32 and 0.24 in the variant is the same box: it counts once and has its match.
    edge = np.stack([_dets((*a[:4], 0.26, 3))]), np.stack([_dets((*a[:4], 0.24, 3))])
    assert compare({"d": edge[0]}, {"d": edge[1]}, Task.DETECTION).detection_agreement == 1.0
    # Nothing detected on either side: full agreement, not a division by zero.
    empty = np.stack([_dets()])
    assert compare({"d": empty}, {"d": empty}, Task.DETECTION).detection_agreement == 1.0


def test_a_detector_without_a_detection_output_is_one_line() -> None:
    with pytest.raises(AccuracyError, match=r"task detection: no output of shape \[batch, K, 6\+\].*logits \[2, 10\]"):
        compare({"logits": np.zeros((2, 10))}, {"logits": np.zeros((2, 10))}, Task.DETECTION)


def test_a_detectors_default_tolerances_bound_detection_agreement() -> None:
    from pathlib import Path

    from builder.spec import DimRange, ModelSpec, Precision

    spec = ModelSpec(name="det", onnx=Path("det.onnx"), batch=DimRange(1, 1, 1), precisions=(Precision.FP16,),
                     task=Task.DETECTION)
    assert spec.tolerance(Precision.FP16) == Tolerance(detection_agreement_min=0.97)
    assert spec.tolerance(Precision.INT8) == Tolerance(detection_agreement_min=0.9)
    ref = np.stack([_dets((10, 10, 50, 50, 0.9, 3), (100, 100, 160, 140, 0.6, 7))])
    missed = compare({"d": ref}, {"d": np.stack([_dets((10, 10, 50, 50, 0.9, 3))])}, Task.DETECTION)
    with pytest.raises(AccuracyError, match=r"detection_agreement = 0\.666667 is below the limit "
                                            r"detection_agreement_min = 0\.97"):
        check(missed, spec.tolerance(Precision.FP16), "det_fp16")
